"""Proof that a model family is a plug-in: a family defined entirely in this test module — PaLM
style, a parallel attention + MLP block (x + attn(norm(x)) + s * mlp(norm(x))) and the LM head tied
to the input embedding; its supported keys, a config key of its own (`parallel_mlp_scale`, the s
above), its own check and its FLOPs — registered at run time, with nothing under MaxText/ edited
for it (not even the schema), trains through the ordinary trainer; 5 steps on 8 fake devices (data
2 x fsdp 2 x tensor 2) equal one device, its FLOPs are what MFU counts, and a key it does not
implement (or its own check) is refused with exit 2. Its own key is validated, shown by --help,
read by its model and refused by the other families like any key of the schema."""
import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import MESH_1, MESH_222, ROOT, argv, train
from MaxText.config import render, schema
from MaxText.config.load import ConfigError, load_config
from MaxText.config.spec import key
from MaxText.config.tools import MODEL_TOOLS
from MaxText.layers.attention_ops import attention_op
from MaxText.layers.linear import DenseGeneral, param
from MaxText.layers.mlp import GatedMLP
from MaxText.layers.norms import RMSNorm
from MaxText.layers.rope import apply_rope
from MaxText.layers.stack import PatternStack
from MaxText.metrics.flops import (FlopCount, attention_pairs, attention_params,
                                   attention_score_flops, gated_mlp_params)
from MaxText.models import registry
from MaxText.models.family import COMMON_KEYS, Family
from MaxText.models.model_config import ModelConfig
from MaxText.resolve import auto_settings
from MaxText.sharding.rules import constrain
from MaxText.train import usage
from MaxText.train.loop import run

NAME = "parallel_test"
ACT = ("activation_batch", "activation_length", "activation_embed")


class ParallelBlock(nnx.Module):
  """x + attention(norm(x)) + MLP(norm(x)): one norm, both branches from the same input."""

  def __init__(self, cfg: ModelConfig, kind: str, *, rngs: nnx.Rngs):
    D, H, K, E = cfg.emb_dim, cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
    kw = dict(rngs=rngs, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype)
    self.norm = RMSNorm(D, eps=cfg.norm_epsilon, **kw)
    self.query = DenseGeneral((D,), (H, E), ("embed", "heads", "head_dim"), **kw)
    self.key = DenseGeneral((D,), (K, E), ("embed", "kv_heads", "head_dim"), **kw)
    self.value = DenseGeneral((D,), (K, E), ("embed", "kv_heads", "head_dim"), **kw)
    self.out = DenseGeneral((H, E), (D,), ("heads", "head_dim", "embed"), **kw)
    self.mlp = GatedMLP(D, cfg.mlp_dim, "silu", **kw)
    self.op, self.theta, self.scale = attention_op(cfg), cfg.rope_theta, E ** -0.5
    self.mlp_scale = cfg.parallel_mlp_scale          # the family's own key

  def __call__(self, x_BSD, positions_BS, segment_ids_BS):
    h_BSD = self.norm(x_BSD)
    q = apply_rope(self.query(h_BSD), positions_BS, self.theta)
    k = apply_rope(self.key(h_BSD), positions_BS, self.theta)
    a_BSD = self.out(self.op(q, k, self.value(h_BSD), segment_ids_BS, scale=self.scale))
    return constrain(x_BSD + a_BSD + self.mlp_scale * self.mlp(h_BSD), ACT)


class ParallelModel(nnx.Module):
  """Embedding → parallel blocks (a pattern stack of one kind) → norm → logits = x @ embedding^T."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.blocks = PatternStack(lambda kind, r: ParallelBlock(cfg, kind, rngs=r), layer_kinds(cfg),
                               scan=cfg.scan_layers, remat_policy=cfg.remat_policy, rngs=rngs)
    self.table = param(rngs, (cfg.vocab_size, cfg.emb_dim), ("vocab", "embed"), std=cfg.init_std,
                       dtype=cfg.param_dtype)
    self.norm = RMSNorm(cfg.emb_dim, eps=cfg.norm_epsilon, rngs=rngs, dtype=cfg.compute_dtype,
                        param_dtype=cfg.param_dtype)

  def __call__(self, tokens_BS, positions_BS, segment_ids_BS):
    return self.forward_with_aux(tokens_BS, positions_BS, segment_ids_BS)[0]

  def forward_with_aux(self, tokens_BS, positions_BS, segment_ids_BS):
    table_VD = self.table[...].astype(self.norm.dtype)
    x_BSD = self.blocks(constrain(table_VD[tokens_BS], ACT), positions_BS, segment_ids_BS)
    return jnp.einsum("bsd,vd->bsv", self.norm(x_BSD), table_VD).astype(jnp.float32), {}


def layer_kinds(cfg):
  return ("parallel",) * cfg.num_decoder_layers


def flops(cfg, seq_len, causal=True):
  D, H, K, E, L = (cfg.emb_dim, cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim,
                   cfg.num_decoder_layers)
  per_layer = attention_params(D, H, K, E) + gated_mlp_params(D, cfg.mlp_dim)
  scores = attention_score_flops(attention_pairs(seq_len, causal=causal), H, E)
  return FlopCount(matmul_params=D * cfg.vocab_size + L * per_layer,
                   attention_per_sequence=L * scores)


def check(cfg):
  if not cfg.tie_word_embeddings:
    return [("tie_word_embeddings", "the head is the embedding here: set tie_word_embeddings=true")]
  return []


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelKeys:
  """The family's own config keys, declared as the schema's are (MaxText/config/spec.py)."""
  parallel_mlp_scale: float = key(1.0, "multiplier of the MLP branch of the parallel block",
                                  gt=0, max=4, model=True, section="model: parallel_test",
                                  section_tools=MODEL_TOOLS)


FAMILY = Family(name=NAME, build=ParallelModel, supports=COMMON_KEYS | {"tie_word_embeddings"},
                layer_kinds=layer_kinds, flops=flops, check=check, keys=ParallelKeys)


@pytest.fixture
def registered():
  """The family registered for the test only (`registry.registered`): after it, the schema and
  the registry are as before, so no later test file sees its key."""
  assert NAME not in registry.FAMILY_MODULES          # not a family of the repository
  with registry.registered(FAMILY):
    yield FAMILY


def test_a_family_defined_in_a_test_trains_like_any_other(registered, tmp_path, capsys):
  model = (f"decoder_block={NAME}", "tie_word_embeddings=true", "steps=5",
           "enable_checkpointing=false")
  code1, one, s1 = train(tmp_path, "one", *model, *MESH_1, devices=jax.devices()[:1])
  code8, eight, _ = train(tmp_path, "eight", *model, *MESH_222)
  assert code1 == code8 == 0
  loss = lambda rows: np.array([r["loss"] for r in rows])
  assert len(loss(one)) == 5 and loss(one)[-1] < loss(one)[0]
  np.testing.assert_allclose(loss(eight), loss(one), rtol=0, atol=1e-5)
  # its parameters are the parallel block's, scanned as one run; MFU counts its own FLOPs
  block = s1["params"]["blocks"]["runs"][0][0]
  assert set(block) == {"norm", "query", "key", "value", "out", "mlp"}
  mcfg = ModelConfig.from_config(load_config(argv(tmp_path, "one", *model)))
  kernels = sum(math.prod(a.shape) for p, a in jax.tree_util.tree_flatten_with_path(s1["params"])[0]
                if p[-1].key == "kernel")   # every matmul weight, and the tied head below
  assert registry.model_flops(mcfg, 64).matmul_params == kernels + mcfg.vocab_size * mcfg.emb_dim
  want = registry.training_flops(mcfg, seq_len=64, global_batch=8)["total"]
  row = one[-1]
  assert np.isclose(row["tflops_per_device"] * row["step_time_s"] * 1e12, want, rtol=1e-6)
  # a model key the family does not list is refused before anything compiles, naming the key
  capsys.readouterr()
  code, _ = run(argv(tmp_path, "refused", *model, *MESH_1, "use_qk_norm=true"),
                devices=jax.devices()[:1])
  assert code == 2
  assert f"use_qk_norm=True is not supported by decoder_block={NAME}" in capsys.readouterr().err
  assert run(argv(tmp_path, "untied", *model, *MESH_1, "tie_word_embeddings=false"),
             devices=jax.devices()[:1])[0] == 2
  assert "set tie_word_embeddings=true" in capsys.readouterr().err
  # no separate LM head (`logits`): loss_chunk_length=-1 (auto) is the whole sequence, a chunk
  # the user sets is refused
  long = load_config(argv(tmp_path, "one", *model, "max_target_length=1024", "vocab_size=1024"))
  assert long.loss_chunk_length == -1 and auto_settings.loss_chunk(long) == 0
  assert run(argv(tmp_path, "chunked", *model, *MESH_1, "loss_chunk_length=16"),
             devices=jax.devices()[:1])[0] == 2
  assert (f"loss_chunk_length=16: decoder_block={NAME} has no separate LM head"
          in capsys.readouterr().err)


def test_a_family_brings_its_own_config_key(registered, tmp_path, capsys):
  """`parallel_mlp_scale` is declared in this file only (MaxText/config/schema.py does not name
  it): once the family is registered it is a key of the one schema — typed and range-checked,
  in --help, a field of Config and ModelConfig, read by the model — and the other families
  refuse it; base.yml (the repository's families only) does not change."""
  with open(os.path.join(ROOT, "MaxText", "config", "schema.py"), encoding="utf-8") as f:
    assert "parallel_mlp_scale" not in f.read()
  registry.register(FAMILY)                                   # again: nothing changes
  assert schema.KEYS["parallel_mlp_scale"].family == NAME
  assert "parallel_mlp_scale" in schema.MODEL_KEYS
  assert "parallel_mlp_scale" in schema.ARCHITECTURE_KEYS
  model = (f"decoder_block={NAME}", "tie_word_embeddings=true")
  cfg = load_config(argv(tmp_path, "k", *model, "parallel_mlp_scale=0.5"))
  assert cfg.parallel_mlp_scale == 0.5 and load_config(argv(tmp_path, "k")).parallel_mlp_scale == 1
  for bad, says in (("parallel_mlp_scale=9", "parallel_mlp_scale"),
                    ("parallel_mlp_scale=big", "parallel_mlp_scale"),
                    ("parallel_mlp_scal=1", "did you mean 'parallel_mlp_scale'")):
    try:
      load_config(argv(tmp_path, "k", *model, bad))
      raise AssertionError(f"{bad} was accepted")
    except ConfigError as e:
      assert says in str(e), (bad, str(e))
  assert "\n  parallel_mlp_scale = 1.0" in usage.usage()           # train.py --help
  assert "parallel_mlp_scale" not in render.render()               # base.yml: the repository's
  # read by the model: the same parameters give other logits at another scale
  half = ModelConfig.from_config(cfg)
  one = dataclasses.replace(half, parallel_mlp_scale=1.0)
  assert half.parallel_mlp_scale == 0.5 and hash(half) != hash(one)
  tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % half.vocab_size
  pos = jnp.tile(jnp.arange(8, dtype=jnp.int32), (2, 1))
  seg = jnp.ones_like(tokens)
  logits = [np.asarray(ParallelModel(c, rngs=nnx.Rngs(0))(tokens, pos, seg)) for c in (half, one)]
  assert np.abs(logits[0] - logits[1]).max() > 1e-3
  # another family does not implement it: refused before anything compiles, naming it
  capsys.readouterr()
  code, _ = run(argv(tmp_path, "llama", "parallel_mlp_scale=0.5", *MESH_1),
                devices=jax.devices()[:1])
  assert code == 2
  assert "parallel_mlp_scale=0.5 is not supported by decoder_block=llama" in capsys.readouterr().err


def _schema_and_registry(objects: bool = True) -> dict:
  """What registering a family changes: the schema's keys (name → Spec, in order), the families'
  key classes, the registry's table, and each dataclass's fields (name, type, default) and, with
  `objects`, its generated attributes (the objects themselves, new ones each registration)."""
  classes = [schema.Config, *(cls for cls, _ in schema._VIEWS)]
  return {"keys": list(schema.KEYS.items()), "family keys": dict(schema._FAMILY_KEYS),
          "families": dict(registry._FAMILIES), "names": registry.names(),
          "model keys": list(schema.MODEL_KEYS), "architecture keys": list(schema.ARCHITECTURE_KEYS),
          **{cls.__name__: ([(f.name, f.type, f.default) for f in dataclasses.fields(cls)],
                            [cls.__dict__.get(a) for a in ("__init__", "__repr__", "__eq__",
                                                            "__hash__", "__dataclass_fields__",
                                                            "__annotations__") if objects],
                            {n: v for n, v in vars(cls).items() if not n.startswith("__")})
             for cls in classes}}


def test_registering_a_family_can_be_undone(tmp_path):
  """`registry.registered` (and `register` then `unregister`) leaves the schema's keys, the
  dataclasses' fields and the family table exactly as before: the key is unknown again."""
  before = _schema_and_registry()
  assert "parallel_mlp_scale" not in schema.KEYS
  with registry.registered(FAMILY):
    during, during_fields = _schema_and_registry(), _schema_and_registry(objects=False)
    assert "parallel_mlp_scale" in schema.KEYS and NAME in registry.names()
    assert ModelConfig(parallel_mlp_scale=0.5).parallel_mlp_scale == 0.5
    assert load_config(argv(tmp_path, "k", "parallel_mlp_scale=0.5")).parallel_mlp_scale == 0.5
  assert during != before and _schema_and_registry() == before
  try:
    load_config(argv(tmp_path, "k", "parallel_mlp_scale=0.5"))
    raise AssertionError("an unregistered family's key was accepted")
  except ConfigError as e:
    assert "parallel_mlp_scale" in str(e)
  registry.register(FAMILY)                   # the same fields again (in new generated methods)
  assert _schema_and_registry(objects=False) == during_fields
  assert registry.unregister(NAME) is FAMILY
  assert _schema_and_registry() == before
  # a family of the table stays findable: unregistering it only drops the imported entry
  llama = registry.get_family("llama")
  with_llama = _schema_and_registry()
  assert registry.unregister("llama") is llama and "llama" not in registry._FAMILIES
  assert schema.family_keys("llama") is not None and "first_k_dense_layers" in schema.KEYS
  assert registry.get_family("llama") is llama and _schema_and_registry() == with_llama
