"""MaxText.inspect against Hugging Face transformers (the oracle), on the tiny random-init fp32 models
of the families' parity tests (shared through their cached builders, so nothing is built twice):
  - hidden_states, attentions and logits equal transformers' `output_hidden_states=True,
    output_attentions=True` (eager attention), each row of a ragged batch against HF run on it alone;
  - a subset of layers / heads: the same values, and only those leave the compiled program;
  - interventions (zero-ablate mlp_out.l, a steering vector at resid_post.l, embed_out rows scaled
    by a mask) equal the same edits made with torch forward hooks; an identity intervention at
    every site changes nothing, bit for bit;
  - the logit lens from unembed_weight / final_norm equals transformers' own norm and head;
  - grad at a site equals a central finite difference.
Tolerances (`tolerance`): a bound on |ours - transformers| / max|x| derived from the model's
shape: fp32 runs of the same computation in two frameworks, whose roundings differ."""
import functools

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import test_gemma4_parity as gemma4  # noqa: E402
import test_qwen3_moe_parity as qwen3_moe  # noqa: E402
import test_qwen3_next_parity as qwen3_next  # noqa: E402
import test_qwen3_parity as qwen3  # noqa: E402
from MaxText import inference  # noqa: E402
from MaxText.config.load import replace  # noqa: E402
from MaxText.inspect import Inspector  # noqa: E402
from MaxText.layers import sites  # noqa: E402

FP32_EPS = float(np.finfo(np.float32).eps)   # 2^-23
# contractions one after the other on a layer's path: q/k/v projection, scores, probabilities x
# values, output projection, MLP up (gate), MLP down
CONTRACTIONS_PER_LAYER = 6
MARGIN = 4   # the estimate below is a typical size; the largest of thousands of elements is ~4x it
# name → (test module, its variant arguments); layer l for the interventions; its HF mlp module
FAMILIES = {
    "qwen3": (qwen3, (False,), 1),
    "qwen3_moe": (qwen3_moe, ("dense_first",), 1),
    "gemma4": (gemma4, ("all",), 4),              # sliding / full, kv-shared tail (layers 4, 5), PLE
    "gemma4_moe": (gemma4, ("moe",), 2),
    "qwen3_next": (qwen3_next, ("mixed",), 1),    # linear / full; attentions of layers 1, 3 only
}
ROWS = [[3, 17, 42, 99, 7, 61, 11, 5, 23, 64], [8, 2, 77, 31, 9, 14]]   # a ragged batch


MESH_222 = ("ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2")   # sorted


@functools.lru_cache(maxsize=None)
def inspector(family: str, scan: bool = True, mesh: tuple[str, ...] = ()) -> Inspector:
  """The family's oracle converted to our parameters (default mesh: fsdp over the 8 devices)."""
  module, args, _ = FAMILIES[family]
  cfg = replace(module.our_config(*args, scan),
                **{k: int(v) for k, v in (a.split("=") for a in mesh)})
  _, _, params = module.ours(*args, scan)
  return Inspector(inference.load(cfg, params=params))


def hf(family: str):
  module, args, _ = FAMILIES[family]
  return module.hf_model(*args)


def hf_run(model, ids, **kw):
  with torch.no_grad():
    return model(input_ids=torch.tensor([ids]), use_cache=False, **kw)


def tolerance(mcfg, passes: int = 1) -> float:
  """|ours - transformers| allowed, as a fraction of the array's largest magnitude (at least 1).

  An fp32 sum of K products is off by about sqrt(K) eps of its terms' size (the roundings add as
  a random walk), K the widest contraction of the model. The path from the tokens to the logits
  has n = CONTRACTIONS_PER_LAYER x layers + 1 (the head) of them one after another (x 2 with the
  backward pass), each rounded by both frameworks independently: 2n random walks, sqrt(2 n K) eps
  together, times MARGIN. Gemma 4 MoE (4 layers, K = 128): 3.8e-5; its worst measured error was
  9.2e-6 (the fixed 1e-5 this replaces). A wrong norm, RoPE or mask is off by > 1e-3."""
  widest = max(mcfg.emb_dim, mcfg.mlp_dim, mcfg.moe_mlp_dim * mcfg.num_experts_per_tok,
               mcfg.num_query_heads * mcfg.head_dim)
  contractions = passes * (CONTRACTIONS_PER_LAYER * mcfg.num_decoder_layers + 1)
  return MARGIN * float(np.sqrt(2 * contractions * widest)) * FP32_EPS


def close(got, want, what: str, m: Inspector, passes: int = 1):
  want = np.asarray(want, np.float32)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  err, scale = float(np.abs(got - want).max()), max(1.0, float(np.abs(want).max()))
  assert err <= tolerance(m.mcfg, passes) * scale, (what, err, scale, tolerance(m.mcfg, passes))
  return err / scale


@pytest.mark.parametrize("family,scan,mesh", [(f, True, ()) for f in FAMILIES] +
                         [("qwen3_next", False, ()), ("gemma4", False, MESH_222)])
def test_trace_matches_transformers(family, scan, mesh):
  m = inspector(family, scan, mesh)
  assert dict(m.mesh.shape) == ({"data": 2, "fsdp": 2, "tensor": 2, "context": 1, "expert": 1, "stage": 1}
                                if mesh else {**dict(m.mesh.shape), "fsdp": 8})
  trace = m.forward(ROWS, capture={"hidden_states", "attentions", "logits"})
  L = m.num_layers
  assert list(trace.lengths) == [len(r) for r in ROWS] and trace.tokens.shape == (2, len(ROWS[0]))
  worst = 0.0
  for b, ids in enumerate(ROWS):
    n = len(ids)
    out = hf_run(hf(family), ids, output_hidden_states=True, output_attentions=True)
    assert len(trace.hidden_states) == len(out.hidden_states) == L + 1
    for i, (got, want) in enumerate(zip(trace.hidden_states, out.hidden_states)):
      worst = max(worst, close(got[b, :n], want[0], f"hidden_states[{i}] row {b}", m))
    assert len(trace.attentions) == len(out.attentions)
    for l, got, want in zip(trace.attention_layers, trace.attentions, out.attentions):
      worst = max(worst, close(got[b, :, :n, :n], want[0], f"attentions layer {l} row {b}", m))
    worst = max(worst, close(trace.logits[b, :n], out.logits[0], f"logits row {b}", m))
  if family == "qwen3_next":
    assert trace.attention_layers == [1, 3]
  else:
    assert trace.attention_layers == list(range(L))
  print(f"{family} scan={scan} mesh={dict(m.mesh.shape)}: worst |Δ| / max|x| = {worst:.1e} "
        f"(tolerance {tolerance(m.mcfg):.1e})")


def test_the_scanned_forward_does_not_follow_a_sets_order(monkeypatch):
  """The capture buffers of a scanned stack are built in one fixed order: the program's text, and
  so its persistent-cache key, is the same whatever order the probe's set of layer sites iterates
  in (that order changes with each process's hash seed; a program that followed it would compile
  afresh in every process)."""
  m = inspector("qwen3")
  names, _ = m._site_names(("attentions", "hidden_states"), None)
  placed = m._placed(np.zeros((1, 16), np.int32), np.array([16], np.int32))
  wanted = sites.Probe.wanted

  def text(order):
    monkeypatch.setattr(sites.Probe, "wanted",
                        lambda self, layers: tuple(order(sorted(wanted(self, layers)))))
    program, key = m._program(names, None, {})
    m._programs.pop(key)   # a fresh program: traced and lowered again
    return program.lower(m.params, *placed).as_text()
  first, reversed_ = text(list), text(lambda bases: bases[::-1])
  assert first == reversed_


def test_one_sequence_and_a_subset_of_layers_and_heads():
  m = inspector("gemma4")
  ids = ROWS[0]
  full = m.forward(ids)
  assert full.tokens.shape == (len(ids),) and full.logits.shape == (len(ids), m.mcfg.vocab_size)
  part = m.forward(ids, capture=["hidden_states", "attentions"], layers=[3], heads=[1, 0])
  assert [h is not None for h in part.hidden_states] == [True, False, False, False, True, False,
                                                        False]
  np.testing.assert_array_equal(part.hidden_states[4], full.hidden_states[4])
  assert [a is not None for a in part.attentions] == [False, False, False, True, False, False]
  np.testing.assert_array_equal(part.attentions[3], full.attentions[3][[1, 0]])
  assert part.logits is None and not part.sites
  assert set(part.arrays()) == {"token_ids", "hidden_states", "hidden_states_index",
                                "attentions_3", "heads"}


def test_capture_by_site_names_and_globs():
  """The sites against the high-level capture of the same batch (the ragged ROWS: the program
  test_trace_matches_transformers[qwen3_next] compiled), each row's positions."""
  m = inspector("qwen3_next")
  t = m.forward(ROWS, capture=["resid_post.*", "mlp_out.2", "attn_scores.3", "embed_out"])
  L = m.num_layers
  assert set(t.sites) == {*(f"resid_post.{l}" for l in range(L)), "mlp_out.2", "attn_scores.3",
                          "embed_out"}
  full = m.forward(ROWS)
  for b, n in enumerate(map(len, ROWS)):
    for l in range(L - 1):
      np.testing.assert_array_equal(t.sites[f"resid_post.{l}"][b, :n],
                                    full.hidden_states[l + 1][b, :n])
    scores = np.asarray(t.sites["attn_scores.3"][b, :, :n, :n], np.float64)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    np.testing.assert_allclose(probs / probs.sum(-1, keepdims=True),
                               full.attentions[1][b, :, :n, :n], atol=1e-6)
  with pytest.raises(ValueError, match="attn_pattern.0"):   # layer 0 is a linear layer
    m.forward(ROWS[1], capture=["attn_pattern.0"])
  with pytest.raises(ValueError, match="mlp_in"):
    m.forward(ROWS[1], capture=["mlp_in.0"])


def _hooks(family: str, model, layer: int, steer, mask):
  """The three edits as torch forward hooks: zero the MLP branch of `layer`, add `steer` to its
  output, scale the embedding rows by `mask`."""
  layers = model.model.layers
  mlp = layers[layer].post_feedforward_layernorm if family.startswith("gemma4") else \
      layers[layer].mlp

  def zero(module, args, out):
    return tuple(torch.zeros_like(o) if i == 0 else o for i, o in enumerate(out)) \
        if isinstance(out, tuple) else torch.zeros_like(out)

  def add(module, args, out):
    return (out[0] + steer, *out[1:]) if isinstance(out, tuple) else out + steer

  def scale(module, args, out):
    return out * mask[:, None]

  return [mlp.register_forward_hook(zero), layers[layer].register_forward_hook(add),
          model.model.embed_tokens.register_forward_hook(scale)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_interventions_match_torch_hooks(family):
  m = inspector(family)
  layer = FAMILIES[family][2]
  ids = ROWS[0]
  rng = np.random.default_rng(0)
  steer = rng.normal(size=m.mcfg.emb_dim).astype(np.float32)
  mask = (np.arange(len(ids)) % 3 != 1).astype(np.float32)
  edits = {f"mlp_out.{layer}": lambda x, ctx: jnp.zeros_like(x),
           f"resid_post.{layer}": lambda x, ctx: x + steer,
           "embed_out": lambda x, ctx: x * mask[None, :, None]}
  with m.intervene(edits):
    got = m.forward(ids, capture=["logits"]).logits
  model = hf(family)
  plain = hf_run(model, ids).logits[0].numpy()
  handles = _hooks(family, model, layer, torch.tensor(steer), torch.tensor(mask))
  try:
    want = hf_run(model, ids).logits[0].numpy()
  finally:
    for h in handles:
      h.remove()
  err = close(got, want, "edited logits", m)
  moved = np.abs(plain - want).max() / np.abs(want).max()
  print(f"{family}: edited |Δ| / max = {err:.1e}; the edits moved the logits by {moved:.2f}")
  assert moved > 100 * tolerance(m.mcfg)


def test_identity_interventions_change_nothing_bitwise():
  m = inspector("gemma4")
  capture = ["logits", "hidden_states", "attentions"]
  plain = m.forward(ROWS, capture=capture, buckets=False)   # the shape interventions run at
  ident = lambda x, ctx: x
  every = {"embed_out": ident, "final_norm_out": ident, "logits": ident,
           **{f"{b}.*": ident for b in ("resid_pre", "attn_scores", "attn_pattern", "attn_out",
                                         "mlp_out", "resid_post")},
           "mlp_out.3": ident}
  with m.intervene(every):
    same = m.forward(ROWS, capture=capture)
  programs = len(m._programs)
  with m.intervene(every):                   # the same sites and functions: the same program
    m.forward(ROWS, capture=capture)
  assert len(m._programs) == programs
  np.testing.assert_array_equal(same.logits, plain.logits)
  for a, b in zip(same.hidden_states + same.attentions, plain.hidden_states + plain.attentions):
    np.testing.assert_array_equal(a, b)
  with m.intervene(every):                   # in the padded buckets too
    padded = m.forward(ROWS, capture=capture, buckets=True)
  np.testing.assert_array_equal(padded.logits, m.forward(ROWS, capture=capture).logits)


def _stacked_patterns(m: Inspector, ids, **kw) -> list[tuple[int, ...]]:
  """Shapes of every rank-5 [n, B, H, S, S] value in the traced forward (attention kept for n
  layers at once), read from its jaxpr (nothing compiled or run)."""
  _, tokens, lengths = m._inputs(ids)
  names, _ = m._site_names(("attentions",), kw.get("layers"))
  program, _ = m._program(names, kw.get("heads"), {})
  S = tokens.shape[1]
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      for v in [*eqn.invars, *eqn.outvars]:
        shape = getattr(getattr(v, "aval", None), "shape", ())
        if len(shape) == 5 and shape[-2:] == (S, S):
          found.append(shape)
      for sub in jax_core.jaxprs_in_params(eqn.params):
        walk(sub)
  walk(jax.make_jaxpr(program)(m.params, *m._placed(tokens, lengths)).jaxpr)
  return found


def test_a_subset_of_layers_is_all_the_scan_keeps():
  """gemma4 "all" scans layers 0-3 as 2 repeats of (sliding, full): all attentions stack 2 rows
  per member; asking for layer 3 keeps a buffer of 1 row of the heads asked for."""
  m = inspector("gemma4")
  every = _stacked_patterns(m, ROWS[0])
  assert any(s[0] == 2 for s in every), every
  one = _stacked_patterns(m, ROWS[0], layers=[3], heads=(1,))
  assert one and all(s[0] == 1 and s[2] == 1 for s in one), one
  S, H = len(ROWS[0]), m.mcfg.num_query_heads
  cost_one = m.program_memory(S, ["attentions"], layers=[3], heads=[1])
  cost_all = m.program_memory(S, ["attentions"])
  print(f"one layer and head: {cost_one}; all: {cost_all}")
  # the arrays (fp32, replicated on each device) plus XLA's 8-byte table of a tuple of outputs
  assert cost_one["output"] == S * S * 4
  assert cost_all["output"] == m.num_layers * H * S * S * 4 + 8 * m.num_layers
  assert cost_one["temp"] < cost_all["temp"]


@pytest.mark.parametrize("family", ["qwen3", "gemma4"])
def test_logit_lens_equals_transformers_norm_and_head(family):
  m = inspector(family)
  model = hf(family)
  t = m.forward(ROWS[0])
  W = m.unembed_weight()
  np.testing.assert_array_equal(W, model.lm_head.weight.detach().numpy())
  cap = getattr(model.config, "final_logit_softcapping", None)
  softcap = (lambda z: z) if not cap else (lambda z: cap * np.tanh(z / cap))
  for i, h in enumerate(t.hidden_states[:-1]):
    with torch.no_grad():
      want = softcap(model.lm_head(model.model.norm(torch.tensor(h))).numpy())
    close(m.lens(h), want, f"lens of hidden state {i}", m)
    close(softcap(m.final_norm(h) @ W.T), want, f"final_norm @ W.T of hidden state {i}", m)
  np.testing.assert_array_equal(m.lens(t.hidden_states[-1], normed=True), t.logits)


def test_grad_equals_torch_autograd_and_a_finite_difference():
  """d log p(target | prefix) / d resid_post.0 (inside the scan): against torch autograd of the
  same objective at the output of HF's layer 0, and a central difference along a random
  direction (both rows of one batch: +eps and -eps)."""
  m = inspector("qwen3")
  ids, target = ROWS[0], 7
  objective = lambda logits: jax.nn.log_softmax(logits[-1])[target]
  value, g = m.grad("resid_post.0", objective, ids)
  assert g.shape == (len(ids), m.mcfg.emb_dim)
  model = hf(family := "qwen3")
  kept = {}
  handle = model.model.layers[0].register_forward_hook(
      lambda mod, args, out: kept.setdefault("h", out[0] if isinstance(out, tuple) else out))
  try:
    logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    kept["h"].retain_grad()
    torch.log_softmax(logits[-1], -1)[target].backward()
  finally:
    handle.remove()
    model.zero_grad()
  close(np.float32(value), torch.log_softmax(logits[-1], -1)[target].item(), f"{family} value", m)
  close(g, kept["h"].grad[0].numpy(), "grad at resid_post.0", m, passes=2)
  u = np.random.default_rng(1).normal(size=g.shape).astype(np.float32)
  eps = 1e-2
  delta = np.stack([eps * u, -eps * u])
  t = m.forward([ids, ids], capture=["logits"],
                interventions={"resid_post.0": lambda x, ctx: x + delta})
  plus, minus = (float(jax.nn.log_softmax(t.logits[b, -1])[target]) for b in (0, 1))
  fd, exact = (plus - minus) / (2 * eps), float((g * u).sum())
  # fp32 rounding of log p (~1e-6 x |log p|) / eps and the eps^2 third-order term: ~1e-3 here
  print(f"finite difference {fd:.6f}, <grad, u> {exact:.6f}")
  assert abs(fd - exact) <= 2e-3 * max(1.0, abs(exact))


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
  """The qwen3 oracle saved as a Hugging Face folder with the tiny tokenizer and chat template."""
  from end_to_end.tiny_hf import save_tiny_tokenizer
  folder = tmp_path_factory.mktemp("hf")
  hf("qwen3").save_pretrained(folder)
  save_tiny_tokenizer(str(folder))
  return str(folder)


def test_cli_writes_the_trace_and_pictures(hf_folder, tmp_path):
  from MaxText.inspect.__main__ import main
  out, pictures = tmp_path / "trace.npz", tmp_path / "pictures"
  assert main([f"hf_path={hf_folder}", "prompt=the quick brown fox", f"output={out}",
               f"plot={pictures}", "capture=hidden_states,attentions,logits,mlp_out.1"]) == 0
  got = dict(np.load(out))
  ids = [int(t) for t in got["token_ids"]]
  m = inspector("qwen3")
  S, L = len(ids), m.num_layers
  assert set(got) == {"token_ids", "hidden_states", "logits", "mlp_out.1",
                      *(f"attentions_{l}" for l in range(L))}
  assert got["hidden_states"].shape == (L + 1, S, m.mcfg.emb_dim)
  assert got["attentions_1"].shape == (m.mcfg.num_query_heads, S, S)
  want = hf_run(hf("qwen3"), ids, output_hidden_states=True, output_attentions=True)
  close(got["hidden_states"], np.stack([h[0] for h in want.hidden_states]), "cli hidden states", m)
  close(got["attentions_1"], want.attentions[1][0], "cli attentions", m)
  close(got["logits"], want.logits[0], "cli logits", m)
  files = sorted(p.name for p in pictures.iterdir())
  assert files == ["attention_layer0.png", "attention_layer1.png", "logit_lens.png"]
  for f in files:
    with open(pictures / f, "rb") as fh:
      assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args,needle", [
    (["capture=mlp_in.0"], "mlp_in.0"), (["layers=1,x"], "layers"), (["layers=9"], "layers [9]"),
    (["heads=7"], "heads [7]"), (["prompt_ids=1,2", "prompt=hi"], "exactly one"),
    (["nonsense=1"], "nonsense")])
def test_cli_refuses_bad_arguments(hf_folder, tmp_path, capsys, args, needle):
  from MaxText.inspect.__main__ import main
  base = [f"hf_path={hf_folder}", f"output={tmp_path / 't.npz'}"]
  if not any(a.startswith("prompt") for a in args):
    base.append("prompt_ids=1,2,3")
  assert main(base + args) == 2
  assert needle in capsys.readouterr().err


def test_load_and_the_decoding_api(hf_folder):
  """`load(hf_path=...)`; logprobs equals the forward's log-softmax; chat and generate run the
  decoding engine (greedy: the first token is the forward's argmax)."""
  from MaxText import inspect as mi
  m = mi.load(hf_path=hf_folder)
  ids = m.tokenize("the quick brown fox")
  t = m.forward(ids, capture=["logits"])
  logp = np.asarray(jax.nn.log_softmax(t.logits, -1))
  [got] = m.logprobs([ids[:2]], [ids[2:]])
  close(got, logp[np.arange(1, len(ids) - 1), ids[2:]], "logprobs", m)
  [g] = m.generate([ids], max_new_tokens=2, temperature=0.0)
  assert g.output_ids[0] == int(t.logits[-1].argmax())
  reply = m.chat([{"role": "user", "content": "the fox"}], max_new_tokens=2, temperature=0.0)
  assert len(reply.output_ids) == 2
  import inspect                                   # the standard library's, untouched
  assert inspect.isfunction(mi.load)


def test_load_from_a_checkpoint(tmp_path):
  """`load(load_parameters_path=...)`: the architecture comes with the checkpoint; same trace."""
  from MaxText import inspect as mi
  from MaxText.checkpoint.manager import save_params_only
  cfg = qwen3.our_config(False, True)
  save_params_only(str(tmp_path / "c"), jax.device_get(inspector("qwen3").params), cfg.as_dict())
  m = mi.load(load_parameters_path=str(tmp_path / "c"))
  assert m.num_layers == inspector("qwen3").num_layers
  got = m.forward(ROWS[0], capture=["logits"]).logits
  close(got, inspector("qwen3").forward(ROWS[0], capture=["logits"]).logits, "checkpoint logits", m)
  with pytest.raises(ValueError, match="one of hf_path"):
    mi.load()


def _inside_the_figure(fig) -> list[str]:
  """The texts (titles, axis labels, tick labels) drawn outside the figure: clipped."""
  fig.canvas.draw()
  renderer, box = fig.canvas.get_renderer(), fig.bbox
  out = []
  for ax in fig.axes:
    texts = [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.get_xticklabels(),
             *ax.get_yticklabels()]
    for t in texts:
      if t.get_visible() and t.get_text():
        e = t.get_window_extent(renderer)
        if e.x0 < box.x0 - 1 or e.y0 < box.y0 - 1 or e.x1 > box.x1 + 1 or e.y1 > box.y1 + 1:
          out.append(t.get_text())
  return out


def test_attention_heatmaps_wrap_heads_with_a_colorbar_and_nothing_clipped():
  import matplotlib.pyplot as plt
  from MaxText.inspect import plots
  S, H = 9, 6
  a = np.tril(np.ones((H, S, S)))
  a /= a.sum(-1, keepdims=True)
  labels = ["<bos>", "The", " quick", " brown", " fox", "\n", "\x00", " the", "."]
  fig = plots.attention_figure(a, 2, labels, heads=[0, 1, 2, 5, 6, 7])
  images = [ax for ax in fig.axes if ax.images]
  bars = [ax for ax in fig.axes if ax.get_ylabel() == "attention probability"]
  assert len(images) == H and len(bars) == 1                    # 6 heatmaps, one colour bar
  assert len({round(ax.get_position().y0, 3) for ax in images}) == 2   # wrapped: 4 + 2
  assert [ax.get_title() for ax in images] == [f"head {h}" for h in (0, 1, 2, 5, 6, 7)]
  ticks = [t.get_text() for t in images[0].get_xticklabels()]
  assert ticks == ["<bos>", "The", "␣quick", "␣brown", "␣fox", "\\n", "\\x00", "␣the", "."]
  assert _inside_the_figure(fig) == []
  plt.close(fig)


def test_logit_lens_labels_show_spaces_with_a_colorbar_and_nothing_clipped():
  import matplotlib.pyplot as plt
  from MaxText.inspect import plots
  words = [" the", "the", "\n", "  "]
  probs = np.zeros((3, 4, 4))
  probs[..., :] = 0.1
  for s in range(4):
    probs[:, s, s] = 0.7
  fig = plots.logit_lens_figure(probs, ["embeddings", "layer 0", "layer 1"],
                                [" a", "b", " c", "\t"], lambda ids: [words[i] for i in ids])
  ax, bar = fig.axes
  assert bar.get_ylabel() == "probability"
  assert [t.get_text() for t in ax.get_xticklabels()] == ["␣a", "b", "␣c", "\\t"]
  cells = [t.get_text() for t in ax.texts]
  assert cells[:4] == ["␣the", "the", "\\n", "␣␣"] and all(t.get_fontsize() >= 9 for t in ax.texts)
  assert _inside_the_figure(fig) == []
  plt.close(fig)
