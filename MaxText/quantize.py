"""Post-training quantization: a checkpoint → a checkpoint with integer weights (int8 or int4 levels
+ float32 scales per group) that MaxText.decode and MaxText.evaluate load directly.

  python -m MaxText.quantize configs/base.yml load_parameters_path=CKPT output_path=QCKPT \\
      method=rtn|gptq bits=8|4 group_size=128 calibration_steps=N [act_order=true] [dataset keys]

What is quantized: the decoder's attention and MLP projections and the routed experts of MoE layers
(each expert's wi / wo on its own; layers/quant_experts.py); the embedding, the LM head, norms and routers
stay as they are, and so do the modules whose path the regex `weight_quant_exclude` searches
(e.g. "experts"). With `weight_quant_vocab=true` (bits=8) the vocabulary tables are int8 too: the
embedding (a tied LM head's table) and Gemma's per-layer-input table by RTN with one scale per
vocabulary row whatever the method (layers/quant_vocab.py), an untied LM head as a projection. Scales: symmetric, one per `group_size` consecutive input
rows and output column (0: one per column). Methods:
  rtn   round to nearest.
  gptq  GPTQ (quantization/gptq.py): the Hessian X^T X of each projection's input from
        `calibration_steps` batches of the dataset keys' training documents (per_device_batch_size
        x devices rows of max_target_length tokens; the eval_split_fraction share is never read,
        and a share other than the one the checkpoint's run held out is refused, exit 2),
        dampening `damp` x mean diagonal, blocked lazy updates, act_order (columns by descending
        Hessian diagonal; default true). A routed expert's Hessian: the token copies routed to it;
        an expert that none reached is quantized by RTN (logged).
With calibration_steps > 0 each matrix's relative output error ||XW - XŴ||^2 / ||XW||^2 on the
calibration tokens is logged (GPTQ: next to RTN's); else the relative weight error.

The written checkpoint carries the config with `weight_bits`, `weight_group_size` and
`weight_quant_exclude`, so loading it builds the integer model: its arrays restore as int8 (int4:
two levels per uint8), about bits/16 of bf16 in memory and on disk, plus the scales. Its dataset
keys and eval_split_fraction are those of the run that trained the weights (not this command's),
so MaxText.evaluate refuses a share of it that run trained on, as for the run's own checkpoint.
Exit 0; 2 on a bad or unsupported combination (naming the key: bits, method, group_size,
calibration_steps, an already-quantized checkpoint, lora_rank); 3 on bad data; 4 on a damaged
checkpoint.

Examples (a run that held out eval_split_fraction=0.05 of its documents, as in README.md):
  python -m MaxText.quantize configs/base.yml load_parameters_path=runs/heldout/checkpoints \\
      output_path=q8 method=rtn bits=8
  python -m MaxText.quantize configs/base.yml load_parameters_path=runs/heldout/checkpoints \\
      output_path=q4 method=gptq bits=4 group_size=64 calibration_steps=8 eval_split_fraction=0.05
"""
from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Sequence

from MaxText.config import cli
from MaxText.config.load import ConfigError, load_config, replace
from MaxText.data.errors import DataError
from MaxText.runtime.exit_codes import EXIT_OK, reported

if TYPE_CHECKING:
  from MaxText.quantization import convert


ARGS = {
    "output_path": cli.Arg(help="the quantized checkpoint to write (must not exist or be empty)"),
    "method": cli.Arg(str, "rtn", "rtn | gptq"),
    "bits": cli.Arg(int, 8, "8 | 4"),
    "group_size": cli.Arg(int, 128, "input rows per scale; 0 = one scale per output column"),
    "calibration_steps": cli.Arg(int, 0, "batches of the dataset's training documents for the "
                                 "Hessians (gptq needs them; rtn: only for the error report)"),
    "act_order": cli.Arg(cli.boolean, True, "gptq: columns in descending Hessian-diagonal order"),
    "damp": cli.Arg(float, 0.01, "gptq: dampening, a fraction of the mean Hessian diagonal"),
    "block_size": cli.Arg(int, 128, "gptq: columns per lazy-update block"),
}


def quantize(argv: Sequence[str], args: dict, progress: bool = True) -> list[convert.LayerReport]:
  """Writes the quantized checkpoint; the per-matrix reports. ConfigError / DataError /
  CheckpointError as in the module docstring."""
  method, bits, gs, steps = args["method"], args["bits"], args["group_size"], \
      args["calibration_steps"]
  if method not in ("rtn", "gptq"):
    raise ConfigError(f"method={method!r}: rtn or gptq")
  if bits not in (4, 8):
    raise ConfigError(f"bits={bits}: 8 or 4")
  if gs < 0:
    raise ConfigError(f"group_size={gs}: >= 0 (0 = one scale per output column)")
  if method == "gptq" and steps <= 0:
    raise ConfigError("calibration_steps: method=gptq needs calibration batches for the Hessians "
                      "(calibration_steps=N > 0)")
  if not 0 <= args["damp"] < 1:
    raise ConfigError(f"damp={args['damp']}: in [0, 1)")
  out = args["output_path"]
  if os.path.exists(out) and os.listdir(out):
    raise ConfigError(f"output_path '{out}' exists and is not empty")
  # pylint: disable=import-outside-toplevel  (the model's machinery, jax: after --help and the
  # argument checks above)
  import jax

  from MaxText.checkpoint import tokenizer_files
  from MaxText.checkpoint.manager import (HF_SOURCE, hf_source, load_params_host, resolve_step_dir,
                                          save_params_only)
  from MaxText.data.config import DataConfig
  from MaxText.data.eval_data import EvalBatches
  from MaxText.inference import model_tokenizer
  from MaxText.models.model_config import ModelConfig
  from MaxText.models.registry import make_model_def
  from MaxText.quantization import convert
  from MaxText.resolve import held_out
  from MaxText.resolve.config_checks import check_config
  from MaxText.resolve.from_checkpoint import adopt_checkpoint_architecture
  from MaxText.sharding.mesh import create_mesh
  from MaxText.sharding.rules import parse_rules
  cfg = load_config(argv, tool="quantize")
  if not cfg.load_parameters_path:
    raise ConfigError("load_parameters_path: the checkpoint to quantize")
  # this run's choices; a float checkpoint's mean nothing
  exclude, vocab = cfg.weight_quant_exclude, cfg.weight_quant_vocab
  cfg = adopt_checkpoint_architecture(
      cfg, [a for a in argv if not a.startswith(("weight_quant_exclude=", "weight_quant_vocab="))])
  if cfg.weight_bits:
    raise ConfigError(f"load_parameters_path={cfg.load_parameters_path} is already quantized "
                      f"(weight_bits={cfg.weight_bits}); quantize the full-precision checkpoint")
  if cfg.lora_rank:
    raise ConfigError(f"lora_rank={cfg.lora_rank}: the checkpoint has LoRA adapters; export it "
                      "merged first (to_huggingface, then to_maxtext) and quantize that")
  if vocab and bits != 8:
    raise ConfigError(f"weight_quant_vocab=true stores the vocabulary tables in int8: it needs "
                      f"bits=8 (it is {bits})")
  # (the float model's config: the quantized one, `qcfg`, carries the choice of tables)
  cfg = replace(cfg, weight_quant_exclude=exclude, weight_quant_vocab=False)
  if cfg.quantization:
    cfg = replace(cfg, quantization="")   # a QAT run's weights are float: quantize them as such
  mcfg = ModelConfig.from_config(cfg)
  try:
    tgts = convert.targets(mcfg, cfg.weight_quant_exclude, vocab)
    qcfg = replace(cfg, weight_bits=bits, weight_group_size=gs, weight_quant_vocab=vocab)
    make_model_def(ModelConfig.from_config(qcfg))    # every target's layout fits (group, packing)
  except ValueError as e:
    key = "bits" if "packs" in str(e) else "group_size"
    raise ConfigError(f"{key}: {e}") from None
  if not tgts:
    raise ConfigError(f"decoder_block={cfg.decoder_block}: weight_quant_exclude="
                      f"{cfg.weight_quant_exclude!r} leaves no projection to quantize")
  abstract = make_model_def(mcfg).abstract_params
  if steps > 0:   # refused before the checkpoint is read when the batches hold too few tokens
    held_out.check_calibration(cfg)   # never the documents the run held out
    cfg, _ = model_tokenizer(cfg)
    devices = jax.devices()
    tokenizer = check_config(cfg, devices)
    rows = cfg.micro_batch_size(len(devices))
    need = convert.hessian_inputs(tgts, abstract)
    _enough_tokens(steps, steps * rows * cfg.max_target_length, need)
  params = load_params_host(cfg.load_parameters_path, abstract)
  hess = None
  if steps > 0:
    batches = EvalBatches(DataConfig.from_config(cfg), "train", tokenizer, [0], 1, rows, steps)
    print(f"calibration: {steps} batches of {rows} x {cfg.max_target_length} tokens")
    hess, seen = convert.hessians(mcfg, params, batches, cfg.weight_quant_exclude,
                                  create_mesh(cfg, devices),
                                  parse_rules(cfg.logical_axis_rules, cfg.mesh_axes), vocab)
    _enough_tokens(steps, seen, need)   # padding and short documents count for nothing
  qparams, reports = convert.quantize_params(
      params, tgts, method, bits, gs, act_order=args["act_order"], damp=args["damp"],
      block_size=args["block_size"], hess=hess, progress=progress)
  step_dir = resolve_step_dir(cfg.load_parameters_path)
  folder = tokenizer_files.in_checkpoint(step_dir)
  source = hf_source(cfg.load_parameters_path)   # a quantized conversion stays one
  # the training run's dataset keys and held-out share, not this command's (a calibration share
  # of its own would let a later evaluation read documents the run trained on)
  saved = {**qcfg.as_dict(), **held_out.trained_on(cfg.load_parameters_path)}
  save_params_only(out, qparams, saved,
                   tokenizer=tokenizer_files.files_of(folder) if folder else None,
                   meta={HF_SOURCE: source} if source else None)
  return reports


def _enough_tokens(steps: int, tokens: int, need: int) -> None:
  if tokens < need:
    raise ConfigError(f"calibration_steps={steps}: {tokens} calibration tokens; a Hessian of "
                      f"{need} inputs needs at least {need} (raise calibration_steps, "
                      f"per_device_batch_size or max_target_length)")


def main(argv: Sequence[str]) -> int:
  def run() -> int:
    if not cli.wants_help(argv) and (not argv or "=" in argv[0]):
      raise ConfigError("the first argument is the config file (configs/base.yml)")
    parsed = cli.parse(argv, ARGS, __doc__, tool="quantize", config_file=True)
    if parsed is None:
      return EXIT_OK
    args, _, config_argv = parsed
    reports = quantize(config_argv, args)
    worst = max(reports, key=lambda r: r.error)
    print(f"wrote {args['output_path']}: {args['method']} int{args['bits']} group_size="
          f"{args['group_size']}, {len(reports)} matrices; largest relative error "
          f"{worst.error:.3e} ({worst.where})")
    return EXIT_OK
  return reported(run, (ConfigError,), data=(DataError,), checkpoint=(FileNotFoundError,))


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
