"""The refit seam (MaxText/refit.py) against transformers: for every family with a Hugging Face map
the stream, taken from parameters sharded over 8 fake devices, loads into a fresh transformers
model with `load_state_dict(strict=True)` and that model computes our logits within 1e-4; a LoRA
model streams exactly its merged export; 8 devices stream what 1 does; the generator holds one
layer's blocks at a time and no tensor it yielded."""
import copy
import gc
import time
import weakref

import jax
import numpy as np
import pytest
from flax import traverse_util

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import BASE_YML, MESH_222, TINY  # noqa: E402
from hf_parity import batch, build_hf_model, hf_logits, hf_state, our_logits  # noqa: E402
from MaxText import refit  # noqa: E402
from MaxText.config.load import load_config, replace  # noqa: E402
from MaxText.layers import lora  # noqa: E402
from MaxText.models.model_config import ModelConfig  # noqa: E402
from MaxText.models.registry import get_hf_map, hf_model_type_for, init_params, make_model_def  # noqa: E402
from MaxText.sharding.mesh import create_mesh  # noqa: E402
from MaxText.sharding.rules import parse_rules, tree_shardings  # noqa: E402

_TINY_MODEL = [k for k in TINY if k.split("=")[0] in ("emb_dim", "num_decoder_layers",
                                                      "num_query_heads", "num_kv_heads",
                                                      "head_dim", "mlp_dim", "vocab_size")]
GEMMA4_MOE = ["attention_pattern=sf", "num_decoder_layers=4", "sliding_window=4",
              "num_kv_shared_layers=0", "double_wide_mlp_on_shared=false", "per_layer_input_dim=0",
              "per_layer_input_vocab_size=0", "num_experts=4", "num_experts_per_tok=2",
              "moe_mlp_dim=24"]
CASES = {"llama": [*_TINY_MODEL, "scan_layers=true"],
         "qwen3": ["model_name=qwen3-tiny", "scan_layers=false"],
         "qwen3_moe": ["model_name=qwen3-moe-tiny", "scan_layers=true"],
         "gemma4": ["model_name=gemma4-tiny", "scan_layers=true"],
         "gemma4_moe": ["model_name=gemma4-tiny", *GEMMA4_MOE, "scan_layers=false"],
         "qwen3_next": ["model_name=qwen3-next-tiny", "scan_layers=true"]}


def config(case, *extra):
  """The case's config on MESH_222 (8 devices), `extra` replacing its keys."""
  given = {e.split("=", 1)[0] for e in extra}
  return load_config([BASE_YML, *(e for e in [*CASES[case], *MESH_222]
                                  if e.split("=", 1)[0] not in given), *extra])


def sharded(cfg, params):
  """`params` placed on the config's mesh (8 fake devices) by the rules table."""
  md = make_model_def(ModelConfig.from_config(cfg))
  mesh = create_mesh(cfg)
  shardings = tree_shardings(md.logical_axes, md.abstract_params, mesh,
                             parse_rules(cfg.logical_axis_rules, mesh.axis_names))
  out = jax.device_put(params, shardings)
  assert len(jax.tree.leaves(out)[0].sharding.device_set) == 8
  return out


def with_adapters(cfg, params, seed=1):
  """`params` with non-zero random adapters for the config's LoRA targets."""
  abstract = traverse_util.flatten_dict(
      lora.split(make_model_def(ModelConfig.from_config(cfg)).abstract_params)[0])
  rng = np.random.default_rng(seed)
  adapters = {k: (0.05 * rng.standard_normal(s.shape)).astype(s.dtype) for k, s in abstract.items()}
  assert adapters
  return lora.join(traverse_util.unflatten_dict(adapters), params)


def random_params(cfg, seed):
  """Host parameters of `cfg`'s model: the init of its model without LoRA (one program per case,
  which the case's tests share through the compilation cache: the seed is an argument), joined
  with non-zero random adapters (`with_adapters`) when `cfg` has LoRA — an adapted model's base
  parameters are the plain model's (`lora.split`)."""
  base = jax.tree.map(np.asarray, init_params(ModelConfig.from_config(replace(cfg, lora_rank=0)),
                                              seed))
  return with_adapters(cfg, base) if cfg.lora_rank else base


def fresh_hf_model(cfg):
  """A random-init transformers model of `cfg`'s architecture (nothing of our parameters)."""
  hf_config = dict(get_hf_map(hf_model_type_for(ModelConfig.from_config(cfg), cfg.hf_model_type))
                   .config_to_hf(cfg))
  hf_config.pop("architectures", None)
  model_type = hf_config.pop("model_type")
  config_cls = type(transformers.AutoConfig.for_model(model_type))
  model_cls = getattr(transformers,
                      transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[
                          model_type])
  return build_hf_model(config_cls, model_cls, hf_config, perturb=())


def load_stream(model, pairs):
  result = model.load_state_dict({k: torch.from_numpy(v) for k, v in pairs}, strict=True)
  assert not result.missing_keys and not result.unexpected_keys


def check_logits(cfg, params, model):
  """Our forward (host params) vs the transformers model, per document, within 1e-4."""
  tokens, pos, seg = batch(cfg.vocab_size)
  got = our_logits(make_model_def(ModelConfig.from_config(cfg)), params, tokens, pos, seg)
  want = hf_logits(model, tokens)
  err, scale = np.abs(got - want).max(), np.abs(want).max()
  assert scale > 0.1 and err <= 1e-4 * max(1.0, scale), (err, scale)


def other_hf_params(cfg, model):
  """Our host parameters of a copy of transformers' `model` whose parameters moved by 0.02 N(0, 1)
  (tied ones stay tied), converted by the family's hf_to_params: random values for the whole tree
  without compiling our init program (1-5 s a family here)."""
  mcfg = ModelConfig.from_config(cfg)
  other, g = copy.deepcopy(model), torch.Generator().manual_seed(3)
  with torch.no_grad():
    for p in other.parameters():
      p.add_(0.02 * torch.randn(p.shape, generator=g))
  params = get_hf_map(hf_model_type_for(mcfg, cfg.hf_model_type)).hf_to_params(hf_state(other),
                                                                                  mcfg)
  shapes = lambda t: jax.tree.map(lambda a: (tuple(a.shape), np.dtype(a.dtype)), t)
  assert shapes(params) == shapes(make_model_def(mcfg).abstract_params)   # the whole tree
  return jax.tree.map(np.asarray, params)


@pytest.mark.parametrize("case", list(CASES))
def test_stream_loads_into_transformers_strict(case):
  cfg = config(case)
  model = fresh_hf_model(cfg)
  params = other_hf_params(cfg, model)
  tokens = batch(cfg.vocab_size)[0]
  before = hf_logits(model, tokens)
  load_stream(model, refit.stream(sharded(cfg, params), cfg, layout="state_dict"))
  assert np.abs(hf_logits(model, tokens) - before).max() > 1e-2     # the stream replaced them
  check_logits(cfg, params, model)


def test_checkpoint_layout_is_the_export():
  """The default layout is what to_huggingface writes (the hub's per-expert Qwen3-MoE files)."""
  cfg = config("qwen3_moe")
  mcfg = ModelConfig.from_config(cfg)
  params = jax.tree.map(np.asarray, init_params(mcfg, 4))
  export = get_hf_map("qwen3_moe").params_to_hf(params, mcfg)
  got = list(refit.stream(sharded(cfg, params), cfg))
  assert [k for k, _ in got] == list(export)
  assert any(".experts.0.gate_proj.weight" in k for k, _ in got)
  for k, v in got:
    assert v.dtype == export[k].dtype and np.array_equal(v, export[k]), k


def test_lora_streams_its_merged_export():
  cfg = config("qwen3", "lora_rank=4", "lora_alpha=8")
  params = random_params(cfg, 5)
  base_mcfg = ModelConfig.from_config(replace(cfg, lora_rank=0))
  export = get_hf_map("qwen3").params_to_hf(lora.merged(params, 2.0), base_mcfg)
  plain = get_hf_map("qwen3").params_to_hf(lora.split(params)[1], base_mcfg)
  got = dict(refit.stream(sharded(cfg, params), cfg))
  assert list(got) == list(export)
  for k, v in got.items():
    assert np.array_equal(v, export[k]), k
  assert not np.array_equal(got["model.layers.0.self_attn.q_proj.weight"],
                            plain["model.layers.0.self_attn.q_proj.weight"])   # adapters merged
  model = fresh_hf_model(replace(cfg, lora_rank=0))
  load_stream(model, refit.stream(params, cfg, layout="state_dict"))
  check_logits(cfg, params, model)


def test_eight_devices_stream_what_one_does():
  """Qwen3-Next scanned with LoRA (heads split over tensor, fsdp): blocks gathered from 8 shards
  equal the single-device stream bit for bit, in the same order; torch tensors equal NumPy's."""
  cfg = config("qwen3_next", "lora_rank=4", "lora_alpha=8")
  params = random_params(cfg, 6)
  one = list(refit.stream(jax.device_put(params, jax.devices()[0]), cfg))
  eight = list(refit.stream(sharded(cfg, params), cfg))
  assert [k for k, _ in one] == [k for k, _ in eight]
  for (k, a), (_, b) in zip(one, eight):
    assert a.dtype == b.dtype and np.array_equal(a, b), k
  as_torch = dict(refit.stream(params, cfg, tensors="torch"))
  for k, a in one:
    assert isinstance(as_torch[k], torch.Tensor) and np.array_equal(as_torch[k].numpy(), a), k


def test_a_cpu_block_is_read_out_of_the_shards():
  """On CPU devices a block (leading integer indices) is put together from the shards holding it,
  whichever axes are split (the leading ones included) and replicated: the array's own x[ints]."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"))
  x = np.arange(4 * 6 * 8 * 3, dtype=np.float32).reshape(4, 6, 8, 3)
  for spec in (P(), P("a"), P("a", "b"), P(None, "b", "c"), P(("a", "b"), None, "c"),
               P(None, None, ("a", "c"))):
    arr = jax.device_put(x, NamedSharding(mesh, spec))
    assert refit._in_host_memory(arr)
    for ints in ((0,), (3,), (1, 5), (2, 0), (-1,), (3, -2)):
      np.testing.assert_array_equal(refit._cpu_block(arr, ints), x[ints], err_msg=f"{spec} {ints}")


class Spy:
  """A host array that records the blocks the stream takes from it: each `[index]` result is
  tracked until it is freed (peak bytes alive at once, over all parameters); a whole-array copy
  counts as a block. `limit`: the most one block of it may hold (one layer of a stacked one)."""
  alive: dict = {}
  peak = 0
  too_big: list = []

  def __init__(self, name, value, limit):
    self._name, self._value, self._limit = name, value, limit
    self.shape, self.ndim, self.dtype = value.shape, value.ndim, value.dtype

  def _track(self, block):
    block = np.array(block)                 # a block of its own (not a view of the parameter)
    if block.nbytes > self._limit:
      Spy.too_big.append((self._name, block.shape))
    key = id(block)
    Spy.alive[key] = block.nbytes
    weakref.finalize(block, Spy.alive.pop, key, None)
    Spy.peak = max(Spy.peak, sum(Spy.alive.values()))
    return block

  def __getitem__(self, index):
    return self._track(self._value[index])

  def __array__(self, dtype=None, copy=None):
    return self._track(self._value)


def test_generator_holds_one_layer():
  """Scanned 6-layer model with LoRA: no block taken from a stacked parameter holds more than one
  layer, the blocks alive at once (parameter and adapter blocks, the tensor being made) never
  exceed one layer's parameters, and a yielded tensor is freed as soon as the caller drops it."""
  cfg = config("qwen3", "scan_layers=true", "num_decoder_layers=6", "lora_rank=4")
  # what the stream reads and holds is the point, not the values: NumPy-random parameters of the
  # model's shapes (no init program), with random adapters
  rng = np.random.default_rng(7)
  abstract = traverse_util.flatten_dict(
      lora.split(make_model_def(ModelConfig.from_config(cfg)).abstract_params)[1])
  params = with_adapters(cfg, traverse_util.unflatten_dict(
      {k: rng.standard_normal(s.shape).astype(s.dtype) for k, s in abstract.items()}))
  flat = traverse_util.flatten_dict(params)
  layers = cfg.num_decoder_layers
  stacked = {k for k in flat if "decoder" in k}
  assert all(flat[k].shape[0] == layers for k in stacked)
  per_layer = sum(flat[k].nbytes for k in stacked) // layers
  bound = max(per_layer, *(v.nbytes for k, v in flat.items() if k not in stacked))
  assert sum(v.nbytes for v in flat.values()) > 3 * bound     # a whole-model copy would fail
  Spy.alive.clear()
  Spy.peak = 0
  Spy.too_big.clear()
  spied = traverse_util.unflatten_dict(
      {k: Spy("/".join(map(str, k)), v, v.nbytes // layers if k in stacked else v.nbytes)
       for k, v in flat.items()})
  previous, count = None, 0
  for _, tensor in refit.stream(spied, cfg):
    assert previous is None or previous() is None          # the generator kept no reference
    previous = weakref.ref(tensor)
    del tensor
    count += 1
  assert count == len(get_hf_map("qwen3").hf_names(ModelConfig.from_config(replace(cfg, lora_rank=0))))
  assert not Spy.too_big, Spy.too_big
  assert 0 < Spy.peak <= bound, (Spy.peak, bound)


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen3"])
def test_receiver_loads_the_stream_tensor_by_tensor(case):
  """The other end (refit.Receiver): the stream of parameters on 8 devices, loaded into an
  engine's parameters on 4 other devices split another way, equals the whole-dict converter's
  import (`hf_to_params`) bit for bit; each tensor is placed before the next is pulled (the
  receiver keeps no tensor it was given); a second load overwrites the first in place."""
  cfg = config(case)
  mcfg = ModelConfig.from_config(cfg)
  engine_cfg = config(case, "ici_data_parallelism=1", "ici_fsdp_parallelism=2",
                      "ici_tensor_parallelism=2")
  md = make_model_def(mcfg)
  mesh = create_mesh(engine_cfg, jax.devices()[4:])
  shardings = tree_shardings(md.logical_axes, md.abstract_params, mesh,
                             parse_rules(engine_cfg.logical_axis_rules, mesh.axis_names))
  receiver = refit.Receiver(mcfg, shardings, hf_model_type_for(mcfg, cfg.hf_model_type))
  hf_map = get_hf_map(hf_model_type_for(mcfg, cfg.hf_model_type))
  # The objects alive before the loads (the earlier tests' among them: tests/conftest.py freezes
  # only what is alive when the file begins) are frozen out of the collector, so the collections
  # of `_let_go` walk only what the loads made; what the loads leave behind is still collected.
  gc.freeze()
  try:
    _load_twice(cfg, mcfg, receiver, shardings, hf_map)
  finally:
    gc.unfreeze()


def _let_go(refs: list, polls: int = 3000) -> bool:
  """Whether the objects of these weak references are gone once jax lets go of them: a
  host-to-device copy of a NumPy array may alias it, and the runtime releases it on its own thread
  when the program that read the copy ends (no Python object refers to it meanwhile), and jax's
  transfer leaves a reference cycle behind (collected). Polled: a kept tensor never goes."""
  for _ in range(polls):
    gc.collect()
    if all(r() is None for r in refs):
      return True
    time.sleep(0.01)
  return False


def _load_twice(cfg, mcfg, receiver, shardings, hf_map):
  loaded = None
  for seed in (11, 12):
    params = jax.tree.map(np.asarray, init_params(mcfg, seed))
    if "router_bias" in params:
      params["router_bias"] = np.zeros_like(params["router_bias"])   # HF has none: zero
    want = hf_map.hf_to_params(dict(refit.stream(params, cfg)), mcfg)
    def pulled(stream, previous):
      for name, tensor in stream:
        assert _let_go(previous), name     # the last one was let go
        previous[:] = [weakref.ref(tensor)]
        yield name, tensor
        del tensor

    first = loaded
    loaded = receiver.load(pulled(refit.stream(sharded(cfg, params), cfg), []), loaded)
    if first is not None:   # overwritten in place (the router bias, never streamed, kept)
      kept = [a is b for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(loaded))]
      assert all(x.is_deleted() != k for x, k in zip(jax.tree.leaves(first), kept))
      assert sum(kept) == ("router_bias" in loaded)
    flat, want_flat = traverse_util.flatten_dict(loaded), traverse_util.flatten_dict(want)
    assert set(flat) == set(want_flat)
    for k, v in flat.items():
      assert v.sharding == traverse_util.flatten_dict(shardings)[k], k
      assert set(v.sharding.device_set) <= set(jax.devices()[4:]), k
      assert v.dtype == want_flat[k].dtype and np.array_equal(np.asarray(v), want_flat[k]), k


def test_receiver_refuses_a_map_with_layout_changes_of_its_own():
  cfg = config("qwen3_next")
  mcfg = ModelConfig.from_config(cfg)
  with pytest.raises(ValueError, match="cannot be loaded tensor by tensor"):
    refit.Receiver(mcfg, {}, hf_model_type_for(mcfg, cfg.hf_model_type))


def test_command_line_lists_the_stream(tmp_path, capsys):
  from MaxText.checkpoint.manager import save_params_only
  cfg = config("qwen3_moe", "lora_rank=2")
  params = random_params(cfg, 9)
  save_params_only(str(tmp_path / "ck"), params, cfg.as_dict())
  assert refit.main([f"load_parameters_path={tmp_path / 'ck'}", "layout=state_dict"]) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  want = dict(refit.stream(params, cfg, layout="state_dict"))
  assert [line.split(" ")[0] for line in lines[:-1]] == list(want)
  assert lines[0] == f"{next(iter(want))} {want[next(iter(want))].shape} float32"
  assert lines[-1].startswith(f"{len(want)} tensors")
  assert refit.main([f"load_parameters_path={tmp_path / 'ck'}", "layout=npz"]) == 2
  assert refit.main([f"load_parameters_path={tmp_path / 'nothing'}"]) == 2
  assert "does not exist" in capsys.readouterr().err


def test_bad_arguments():
  cfg = config("qwen3")
  with pytest.raises(ValueError, match="layout='safetensors'"):
    next(refit.stream({}, cfg, layout="safetensors"))
  with pytest.raises(ValueError, match="tensors='jax'"):
    next(refit.stream({}, cfg, tensors="jax"))


@pytest.mark.skipif(jax.devices()[0].platform != "gpu" or not torch.cuda.is_available(),
                    reason="needs a GPU visible to jax and torch")
def test_torch_tensors_stay_on_the_gpu():
  """On a GPU platform the blocks go to torch through DLPack, on the device."""
  cfg = config("qwen3", "ici_data_parallelism=1", "ici_fsdp_parallelism=1",
               "ici_tensor_parallelism=1", "lora_rank=4")
  params = random_params(cfg, 8)
  host = dict(refit.stream(params, cfg))
  for k, t in refit.stream(jax.device_put(params, jax.devices()[0]), cfg, tensors="torch"):
    assert t.is_cuda, k
    np.testing.assert_allclose(t.cpu().numpy(), host[k], rtol=1e-6, atol=1e-6, err_msg=k)
