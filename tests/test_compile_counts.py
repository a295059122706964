"""Compilations of a training run, per family (llama, qwen3, qwen3-moe, gemma4 with sliding + full +
KV-shared layers, qwen3-next): before the first step, exactly the run's own programs — the state's
initialization (the model's init program and the state made of it) and the train step (and one
eager cast), each once; from the first step on (its dispatch, the later steps, every step's
metrics read back) none at all: no program is traced again for a later step.

Counted on an empty in-memory cache (`jax.clear_caches()`), so the count does not depend on what
ran earlier in the process; a program loaded from the persistent compilation cache counts as one
(it was handed to XLA all the same). The configurations are those of the families' own training
tests (tests/test_train.py, test_moe.py, test_gemma4_train.py, test_qwen3_next_train.py), one device:
the same programs, which the persistent cache then holds once for both."""
import jax
import pytest

from compile_log import CompileLog
from conftest import MESH_1, argv
from MaxText.train import loop
from test_gemma4_train import GEMMA
from test_moe import DENSE_FIRST, MOE
from test_qwen3_next_train import MESH_1_ROWS, QWEN3_NEXT

FAMILIES = {
    "llama": ("enable_checkpointing=false",),
    "qwen3": ("model_name=qwen3-tiny", "steps=3", "enable_checkpointing=false"),
    "qwen3-moe": (*MOE, *DENSE_FIRST, "steps=3", "enable_checkpointing=false"),
    "gemma4": (*GEMMA, "attention=dot_product"),
    # its training test's rows too (4 per step): the same program, not a second one of 8 rows
    "qwen3-next": (*QWEN3_NEXT, *MESH_1_ROWS),
}
# the programs of one run, by name, before its first step: the fresh state (train/state.py:
# init_state: a tiny model's one init program, then the state made of its values on the mesh), the
# train step, and one eager dtype conversion on the way (a one-primitive program)
EXPECTED = {"jit(convert_element_type)": 1, "jit(init_traced)": 1, "jit(make)": 1, "jit(step)": 1}


class _Marked(loop.Trainer):
  """The trainer with a marker in `log` before each step's dispatch."""
  log: CompileLog

  def loop_parts(self, state, start, writer, data_iter):
    parts = super().loop_parts(state, start, writer, data_iter)
    step = parts.step

    def marked(state_, batch):
      self.log.mark("step")
      return step(state_, batch)

    parts.step = marked
    return parts


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_run_compiles_its_programs_once_and_nothing_after_the_first_step(tmp_path, family):
  jax.clear_caches()
  with CompileLog() as log:
    _Marked.log = log
    code, trainer = loop.run(argv(tmp_path, family, *FAMILIES[family], *MESH_1),
                             devices=jax.devices()[:1], trainer_class=_Marked)
  assert code == 0
  steps = sum(1 for kind, name in log.events if kind == "mark")
  assert steps == trainer.cfg.steps >= 3
  print(f"{family}: {log.events}")
  assert log.counts(before="step") == EXPECTED
  assert log.programs(after="step") == []



def test_one_init_program_for_a_model_on_every_mesh(tmp_path):
  """A small model's fresh state on 1, 8 (data 2 x fsdp 2 x tensor 2) and 4 devices (the last
  4: device 0 is not among them): its init program once, then on each mesh only the state made
  of its values (train/state.py: the init runs on the platform's lowest-numbered device whatever
  the mesh, not on a device of the mesh's `device_set`, whose order follows the devices'
  addresses; a program compiled for another device is another program, and another
  persistent-cache key in each process)."""
  from conftest import MESH_222
  from MaxText.config.load import load_config
  from MaxText.train.state import init_state
  meshes = [(MESH_1, jax.devices()[:1]), (MESH_222, jax.devices()),
            (["ici_fsdp_parallelism=4", "per_device_batch_size=2"], jax.devices()[4:])]
  jax.clear_caches()
  with CompileLog() as log:
    for mesh, devices in meshes:
      trainer = loop.Trainer(load_config(argv(tmp_path, "m", *mesh)), devices)
      state = init_state(trainer.mcfg, 0, trainer.tx, trainer.shardings)
      assert jax.tree.leaves(state)[0].sharding == jax.tree.leaves(trainer.shardings)[0]
  counts = log.counts()
  assert (counts["jit(init_traced)"], counts["jit(make)"]) == (1, len(meshes)), counts
