"""The held-out loss of a saved model (MaxText/train/evaluation.py, as during training).

  python -m MaxText.evaluate configs/base.yml load_parameters_path=CKPT [dataset keys] eval_steps=M

Parameters: `load_parameters_path` (a run's checkpoints/, a step, a converter's output) or
`hf_path=HF_DIR` (converted in memory). Data: `eval_dataset_path` (read with `dataset_format` /
`dataset_text_field`), else the `eval_split_fraction` share held out of the dataset keys'
documents (what a training run with that fraction never read: a share other than the one the
run behind the checkpoint held out is refused, exit 2, `resolve/held_out.py`), else every document
of the dataset keys; packed into rows of `max_target_length`, `eval_steps` global batches of
`per_device_batch_size` x devices rows (fewer when the documents end first). The tokenizer:
`tokenizer_path`, else the checkpoint's. Mesh and sharding keys as for training.

Prints the model and data, then as its LAST line `eval_loss=<x> eval_perplexity=<y> tokens=<n>`
(the mean cross-entropy per target token, exp of it, the target tokens counted). Exit 0; 2 on a
bad config; 3 on bad data; 4 on a damaged checkpoint.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Sequence

from MaxText.config import cli
from MaxText.config.load import ConfigError, load_config
from MaxText.data.errors import DataError
from MaxText.runtime.exit_codes import EXIT_OK, reported
from MaxText.runtime.startup import StartupClock
from MaxText.backend.device_type import Device

if TYPE_CHECKING:

  from MaxText.train.evaluation import Evaluator


def prepare(argv: Sequence[str], devices: Sequence[Device] | None = None
            ) -> tuple[Evaluator, object]:
  """(the evaluator, the parameters on the mesh); ConfigError or DataError before any data is
  read (exit 2), CheckpointError (exit 4)."""
  first = load_config(argv, tool="evaluate")    # a key evaluation does not read: refused
  # pylint: disable=import-outside-toplevel  (the model's machinery, jax: after --help)
  import jax

  from MaxText.data.config import DataConfig
  from MaxText.data.eval_data import eval_problems
  from MaxText.inference import load_config_for_decoding, model_tokenizer, place_hf
  from MaxText.models.model_config import ModelConfig
  from MaxText.models.registry import make_model_def
  from MaxText.resolve import held_out, lora_base
  from MaxText.resolve.config_checks import check_config
  from MaxText.runtime import compile_cache
  from MaxText.runtime.host_data import data_layout, process_rows
  from MaxText.sharding.mesh import create_mesh
  from MaxText.sharding.rules import batch_sharding, parse_rules, tree_shardings
  from MaxText.train.evaluation import Evaluator
  print(compile_cache.use(first.jax_cache_dir), file=sys.stderr)
  cfg, hf_params = load_config_for_decoding(argv)
  if not cfg.load_parameters_path and hf_params is None:
    raise ConfigError("evaluate needs parameters: set load_parameters_path or hf_path")
  cfg, source = model_tokenizer(cfg)
  devices = list(jax.devices() if devices is None else devices)
  tokenizer = check_config(cfg, devices)
  if cfg.eval_dataset_path or cfg.eval_split_fraction:
    for key, problem in eval_problems(DataConfig.from_config(cfg), cfg.eval_dataset_path):
      raise ConfigError(f"{key}: {problem}")
  note = held_out.check_evaluation(cfg)   # the share must be the one the run held out
  mesh, rules = create_mesh(cfg, devices), parse_rules(cfg.logical_axis_rules, cfg.mesh_axes)
  model_def = make_model_def(ModelConfig.from_config(cfg))
  shardings = tree_shardings(model_def.logical_axes, model_def.abstract_params, mesh, rules)
  if hf_params is not None:
    params = place_hf(hf_params, ModelConfig.from_config(cfg), model_def, shardings)
  else:
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            model_def.abstract_params, shardings)
    params = lora_base.load_cast(cfg.load_parameters_path, ModelConfig.from_config(cfg), abstract,
                                 verify=cfg.checkpoint_verify)   # in weight_dtype
  global_batch = cfg.micro_batch_size(len(devices))
  sharding = batch_sharding(mesh, rules, global_batch, cfg.max_target_length)
  rows = process_rows(sharding, (global_batch, cfg.max_target_length))
  layout = data_layout(cfg.data_shards, None, jax.process_count(), global_batch, rows)
  where = cfg.eval_dataset_path or (f"the eval_split_fraction={cfg.eval_split_fraction} held-out "
                                    f"share of" if cfg.eval_split_fraction else "all of")
  if not cfg.eval_dataset_path:
    where += f" dataset_type={cfg.dataset_type} {cfg.dataset_path}".rstrip()
  print(f"model {cfg.decoder_block} ({cfg.num_decoder_layers} layers); {source}; data: "
        f"{where}; {cfg.eval_steps} batches of {global_batch} x {cfg.max_target_length}")
  if note:
    print(note)
  evaluator = Evaluator(cfg, tokenizer, model_def, mesh, rules, sharding, global_batch,
                        layout.shard_ids, layout.num_shards, layout.shard_batch,
                        whole_dataset=True)
  return evaluator, params


def main(argv: Sequence[str]) -> int:
  if cli.wants_help(argv):
    cli.print_help(cli.usage(__doc__, {}, "evaluate"))
    return EXIT_OK

  def run() -> int:
    clock = StartupClock()
    evaluator, params = prepare(argv)    # bad data found here is a bad config: exit 2
    clock.mark("config + model")

    def evaluate() -> int:
      from MaxText.runtime import compile_cache  # pylint: disable=import-outside-toplevel
      with compile_cache.CompileMeter() as compiling:
        result = evaluator.run(params)
      clock.mark("answer")
      print(clock.line("the first answer", f"({compiling.text()})"), file=sys.stderr)
      return report(result)
    return reported(evaluate, (), data=(DataError,))   # exit 3
  return reported(run, (ConfigError, DataError))


def report(result: dict) -> int:
  from MaxText.train.evaluation import format_eval  # pylint: disable=import-outside-toplevel
  print(format_eval(None, result))
  print(f"eval_loss={result['eval_loss']:.6f} eval_perplexity={result['eval_perplexity']:.6f} "
        f"tokens={int(result['eval_tokens'])}")
  return EXIT_OK

if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
