"""The first part of the one schema (MaxText/config/schema.py composes `Config` from it): the keys
of a training run — its directory, the model, the data, the optimizer, adapters, quantization,
checkpoints, metrics and evaluation during training — declared as in `schema.py`, each once with
`key(default, doc, ...)` (MaxText/config/spec.py). `Config` derives from `RunKeys`, so these keys
come first in `KEYS` and in configs/base.yml, in the order written here."""
from __future__ import annotations

from dataclasses import dataclass

from MaxText.config.spec import ModelUse, key
from MaxText.config.tools import CONVERT, MODEL_TOOLS, TEXT_TRAINERS, TRAINERS

DTYPES = ("float32", "bfloat16", "float16")
AUTO = "auto"                    # dtype: resolved by MaxText.config.load.resolve_dtype
AUTO_TRAINING_DTYPE = "bfloat16"   # what dtype=auto computes in when training
AUTO_TOOL_DTYPE = "float32"        # ... and in the tools (Hugging Face parity is exact in fp32)
AUTO_LOSS_CHUNK = -1             # loss_chunk_length: resolved by resolve/auto_settings.py
_COMPUTE = ModelUse(model=True, arch=False)   # read by the model, but the parameters mean the same


@dataclass(frozen=True, kw_only=True)
class RunKeys:
  # evaluate and quantize check the run directory is writable, as training does (check_config)
  run_name: str = key("default", "run directory name under base_output_directory; rerun = resume",
                      section="run", section_tools=TRAINERS,
                      tools=(*TRAINERS, "evaluate", "quantize"))
  base_output_directory: str = key(
      "runs", "parent of run directories (metrics.jsonl, checkpoints/, config.yml)",
      tools=(*TRAINERS, "evaluate", "quantize"))
  steps: int = key(300, "optimizer steps to train in total", min=1)
  log_period: int = key(10, "print a progress line every N steps (metrics.jsonl gets every step)",
                        min=1)
  seed: int = key(0, "parameter initialisation seed; decoding: the sampling seed; logit_check: its "
                  "random token ids", min=0,
                  tools=(*TRAINERS, "decode", "logit_check"))
  jax_cache_dir: str = key("~/.cache/maxtext_jax",
                           'persistent XLA compilation cache; "" turns it off',
                           tools=(*TRAINERS, "decode", "evaluate", "inspect", "serve"))

  # ---- model -----------------------------------------------------------------------------------
  model_name: str = key("default", '"default" or a file configs/models/<model_name>.yml to overlay',
                        section="model", section_tools=(*MODEL_TOOLS, *CONVERT), tools=MODEL_TOOLS)
  decoder_block: str = key("llama", "model family plug-in (MaxText/models/registry.py)",
                           model=True)
  hf_model_type: str = key(
      "", 'Hugging Face model_type it converts to/from, one of its family\'s; "" = the first that fits',
      arch=True, tools=(*MODEL_TOOLS, *CONVERT, "to_huggingface"))
  vocab_size: int = key(384, "embedding rows; must cover the tokenizer's ids (byte: 259)", min=1,
                        model=True, data=True)
  emb_dim: int = key(256, "model width D", min=1, model=True)
  num_decoder_layers: int = key(4, "decoder layers L", min=1, model=True)
  num_query_heads: int = key(4, "query heads H", min=1, model=True)
  num_kv_heads: int = key(4, "key/value heads K (GQA when K < H; H % K == 0)", min=1, model=True)
  head_dim: int = key(64, "per-head width E", min=1, model=True)
  mlp_dim: int = key(1024, "gated-MLP hidden width F (dense layers)", min=1, model=True)
  mlp_activation: str = key("silu", "gate activation of the gated MLP: silu | gelu_tanh "
                            "(tanh-approximated GELU)", choices=("silu", "gelu_tanh"), model=True)
  norm_epsilon: float = key(1.0e-6, "RMSNorm epsilon", gt=0, model=True)
  use_qk_norm: bool = key(False, "per-head RMSNorm on q and k before RoPE (Qwen3 style)",
                          model=True)
  tie_word_embeddings: bool = key(False, "LM head shares the embedding table", model=True)
  mtp_num_layers: int = key(
      0, "multi-token-prediction depths (HF mtp.* / num_nextn_predict_layers): depth k predicts "
      "the token k+1 ahead from depth k-1's hidden state and the embedding of the token k ahead, "
      "through one transformer layer of its own and the shared head (llama, qwen3_next)", min=0,
      model=True)
  mtp_loss_scale: float = key(
      0.0, "weight of the multi-token-prediction loss (the mean over mtp_num_layers depths of "
      "each depth's token cross-entropy); 0 = the MTP block is carried unchanged, not trained",
      min=0, **_COMPUTE, tools=("train",))
  rope_theta: float = key(10000.0, "RoPE base wavelength", gt=0, model=True)
  max_position_embeddings: int = key(
      8192, "longest sequence the model is meant for (max_target_length <= it)", min=1, model=True)
  init_std: float = key(0.02, "std of the normal init of embeddings (matrices use 1/sqrt(fan_in))",
                        gt=0, model=True)
  dtype: str = key(AUTO, "compute dtype of activations and matmuls; auto: bfloat16 when training "
                   "(train.py, SFT, GRPO; fp32 master weights), float32 in the tools that compare "
                   "against a reference (decode, evaluate, conversions, inspect)",
                   choices=(AUTO, *DTYPES), **_COMPUTE, tools=(*MODEL_TOOLS, "logit_check"))
  param_init_rng: str = key(
      "auto", "the random generator of a fresh init (the normal parameters cut from a few "
      "large draws, whichever): threefry2x32 (JAX's default, the same values on every platform) "
      "| rbg (XLA's RngBitGenerator; its init program compiles fastest on a TPU) | unsafe_rbg | "
      "auto (threefry2x32 on CPU, rbg on TPU and GPU). The values differ between generators, not "
      "between runs of one",
      choices=(AUTO, "threefry2x32", "rbg", "unsafe_rbg"), **_COMPUTE)
  weight_dtype: str = key("float32", "master (stored, optimised) parameter dtype", choices=DTYPES,
                          **_COMPUTE)
  matmul_precision: str = key(
      AUTO, "precision of the model's matmuls (jax.default_matmul_precision while the model is "
      "traced): default (the platform's fastest: on TPU a float32 matmul runs in bf16 passes) | "
      "high | highest | auto (highest when dtype is float32, so float32 means float32 on every "
      "platform; else default, MaxText's matmul_precision)",
      choices=(AUTO, "default", "high", "highest"), **_COMPUTE, tools=(*MODEL_TOOLS, "logit_check"))
  logits_dtype: str = key(
      "float32", "dtype of the logits the training loss reads: float32 (straight from the LM "
      "head's fp32 accumulator) | bfloat16 (rounded once and stored in bf16, as MaxText's default "
      "and Hugging Face in bf16 have them: half the memory traffic of the 152k-vocabulary loss on "
      "a TPU; the loss is still computed in fp32 from them, their gradient rounded to bf16 as the "
      "head's matmul takes it). Decoding's logits stay fp32", choices=("float32", "bfloat16"),
      **_COMPUTE, tools=(*TRAINERS, "evaluate"))
  scan_layers: bool = key(True, "run each repeating run of layers with one lax.scan (fast "
                          "compile; parameters stacked per run)", model=True)
  remat_policy: str = key(
      "save_matmuls", "activation rematerialisation, per layer: none | full | save_matmuls "
      "(recompute all but weight-matmul outputs) | named saves, the rest recomputed: "
      "save_attention (the attention op's residuals), save_qkv_proj, save_qkv_attention, "
      "save_dot_except_mlp (q/k/v, attention, output projection), save_dot_except_mlp_in (also "
      "the MLP's down projection) | auto (the fastest of these whose memory estimate fits: "
      "train/memory_plan.py)",
      choices=(AUTO, "none", "full", "save_matmuls", "save_attention", "save_qkv_proj",
               "save_qkv_attention", "save_dot_except_mlp", "save_dot_except_mlp_in"),
      **_COMPUTE, tools=MODEL_TOOLS)
  attention: str = key(
      "autoselected", "dot_product (XLA) | flash (our Pallas kernel on GPU; JAX's splash kernel on "
      "TPU) | cudnn (NVIDIA only) | autoselected (flash on GPU/TPU, else dot_product)",
      choices=("autoselected", "dot_product", "flash", "cudnn"), **_COMPUTE, tools=MODEL_TOOLS)
  hot_path: str = key(
      "auto", "the layers' hot path: tuned (XLA:CPU's bf16 matmul and attention cores, RMSNorm "
      "VJP, 16-bit remat saves as raw bits, CPU schedule, host allocator, the step at LLVM level "
      "1) | plain (XLA's own dot, autodiff attention and norm, named remat saves) | auto (tuned "
      "on CPU, plain on GPU/TPU; "
      "MaxText/backend/hot_path.py)", choices=("auto", "tuned", "plain"), **_COMPUTE,
      tools=MODEL_TOOLS)
  flash_block_q: int = key(512, "flash attention query block (clipped to the sequence length, "
                           "on a GPU to what fits shared memory: 128, 64 for head dims > 128; "
                           "splash: a multiple of 128)", min=8, **_COMPUTE, tools=MODEL_TOOLS)
  flash_block_kv: int = key(512, "flash attention key/value block (same rules)", min=8, **_COMPUTE,
                            tools=MODEL_TOOLS)
  flash_fused_bwd: bool = key(False, "splash (flash on TPU): one fused backward kernel for dq, "
                              "dk and dv (the probabilities recomputed once, not twice)",
                              **_COMPUTE, tools=MODEL_TOOLS)
  attention_pattern: str = key(
      "", 'layer kinds, repeated over the layers: s = sliding window, f = full, l = linear '
      '(Gated DeltaNet); "" = all full',
      model=True, note="Per-layer attention variants (Gemma 4, Qwen3-Next). A family refuses any model key "
      "it does not implement\nwhen it is set away from the default written here.")
  sliding_window: int = key(0, "keys a sliding layer sees: q-W < k <= q (0 = no sliding layers)",
                            min=0, model=True)
  partial_rotary_factor: float = key(
      1.0, "share of each head's channels RoPE rotates: the first ones, as a head of that width "
      "(HF partial_rotary_factor)", gt=0, max=1, model=True)
  num_experts: int = key(
      0, "routed experts E (0 = dense MLP)", min=0, model=True,
      note="Mixture of experts (MaxText/layers/moe.py): with num_experts > 0 the MLP of every MoE "
      "layer is routed experts;\nall layers are MoE layers unless the keys after "
      "capacity_factor (and a family's own, e.g. llama's first_k_dense_layers) make some dense.")
  num_experts_per_tok: int = key(2, "experts per token (top-k)", min=1, model=True)
  moe_mlp_dim: int = key(0, "hidden width of each expert", min=0, model=True)
  norm_topk_prob: bool = key(True, "renormalise the top-k routing weights to sum to 1", model=True)
  shared_expert_mlp_dim: int = key(0, "an always-on expert gated by sigmoid(x . w) (0 = none)",
                                   min=0, model=True)
  capacity_factor: float = key(0.0, "0 = dropless; > 0 keeps at most cf * tokens*k/E copies per "
                               "expert (comparison mode)", min=0, **_COMPUTE, tools=MODEL_TOOLS)
  mlp_only_layers: list[int] = key([], "these layer indices have a dense MLP (Qwen3-MoE "
                                   "mlp_only_layers)", model=True)
  decoder_sparse_step: int = key(1, "only layers i with (i + 1) % step == 0 are MoE layers "
                                 "(Qwen3-MoE decoder_sparse_step)", min=1, model=True)
  moe_matmul: str = key("auto", "the experts' grouped matmul: ragged_dot (jax.lax.ragged_dot) | "
                        "megablox (JAX's Pallas TPU grouped matmul, interpreted off TPU) | auto "
                        "(ragged_dot)", choices=("auto", "ragged_dot", "megablox"), **_COMPUTE,
                        tools=MODEL_TOOLS)
  moe_matmul_tiles: list[int] = key([512, 1024, 1024], "moe_matmul=megablox: its row, contracted "
                                    "and output tiles (each clipped to the matrix; multiples of "
                                    "128)", **_COMPUTE, tools=MODEL_TOOLS)
  moe_dispatch: str = key("auto", "expert-parallel exchange: ragged_all_to_all (GPU/TPU) | "
                          "padded_all_to_all (CPU) | auto",
                          choices=("auto", "ragged_all_to_all", "padded_all_to_all"), **_COMPUTE,
                          tools=MODEL_TOOLS)

  # ---- data ------------------------------------------------------------------------------------
  dataset_type: str = key("embedded", "embedded (the Python standard library's source) | "
                          "synthetic | file", choices=("embedded", "synthetic", "file"),
                          data=True, section="data",
                          section_tools=(*TEXT_TRAINERS, "evaluate", "quantize"))
  dataset_path: str = key("", "file, directory or glob of the dataset when dataset_type=file",
                          data=True)
  dataset_format: str = key("auto", "auto (by extension) | text | jsonl | parquet | arrayrecord",
                            choices=("auto", "text", "jsonl", "parquet", "arrayrecord"), data=True)
  dataset_text_field: str = key("text", "field/column holding the text in jsonl, parquet, "
                                "arrayrecord", data=True)
  tokenizer_type: str = key(
      "auto", "auto (byte without tokenizer_path, else from the file: .json huggingface, .model "
      "sentencepiece) | byte | huggingface | sentencepiece",
      choices=("auto", "byte", "huggingface", "sentencepiece"), data=True, tools=MODEL_TOOLS)
  tokenizer_path: str = key(
      "", "tokenizer.json, a SentencePiece .model, or a folder holding one (\"\" with "
      "load_parameters_path: the checkpoint's)", data=True, tools=MODEL_TOOLS)
  add_bos: bool = key(True, "prepend the tokenizer's bos id to each document", data=True,
                      tools=MODEL_TOOLS)
  add_eos: bool = key(True, "append the tokenizer's eos id to each document", data=True)
  packing: bool = key(True, "pack several documents per row (segment ids + positions)", data=True)
  shuffle: bool = key(True, "shuffle documents each epoch", data=True)
  data_shuffle_seed: int = key(0, "seed of the shuffle and of synthetic data", min=0,
                               max=2**32 - 1, data=True)
  grain_worker_count: int = key(0, "Grain worker processes (0 = in the training process)", min=0,
                                data=True)
  max_bad_records: int = key(0, "unreadable records (bad JSON, missing text field) skipped and "
                             "counted; more: exit 3", min=0, data=True)
  max_target_length: int = key(256, "sequence length S of a training row", min=2, data=True,
                               tools=MODEL_TOOLS)
  sft: bool = key(False, "supervised fine-tuning: jsonl records of chat `messages` (or `prompt` / "
                  "`completion`) rendered with the tokenizer's chat template", data=True,
                  tools=TEXT_TRAINERS)
  sft_train_on_completion_only: bool = key(True, "sft: the loss counts the assistant tokens only "
                                           "(false: every token of the conversation)", data=True,
                                           tools=TEXT_TRAINERS)
  sft_overlong: str = key("truncate", "sft: a conversation longer than max_target_length is "
                          "truncated | dropped (either is counted)",
                          choices=("truncate", "drop"), data=True, tools=TEXT_TRAINERS)
  max_num_images_per_example: int = key(
      0, "sft: images a conversation may hold (its user turns' image parts), each row's image "
      "slots; 0 = conversations are text", min=0, data=True, tools=TEXT_TRAINERS)
  max_num_audio_per_example: int = key(
      0, "sft: audio clips a conversation may hold, each row's clip slots; 0 = no audio", min=0,
      data=True, tools=TEXT_TRAINERS)
  max_audio_seconds: float = key(30.0, "sft: the longest clip (seconds; the feature frames of a "
                                 "clip slot)", gt=0, data=True, tools=TEXT_TRAINERS)
  chat_template_path: str = key("", 'sft, dpo: a jinja chat template file; "" = the tokenizer\'s '
                                "own (chat_template.jinja / tokenizer_config.json)", data=True,
                                tools=(*TEXT_TRAINERS, "dpo"))
  eval_split_fraction: float = key(
      0.0, "hold out this share of the documents for evaluation; training never reads them",
      min=0, max=0.5, data=True)
  per_device_batch_size: float = key(8.0, "sequences per device per micro-batch (global = this x "
                                     "devices)", gt=0, tools=MODEL_TOOLS)
  gradient_accumulation_steps: int = key(1, "micro-batches summed into one optimizer step", min=1,
                                         tools=TRAINERS)
  data_shards: int = key(
      0, "data streams the global batch is cut from (equal blocks of rows; each process reads "
      "only its own); 0 = one per process, or as saved when resuming", min=0,
      tools=(*TEXT_TRAINERS, "evaluate"))

  # ---- optimizer -------------------------------------------------------------------------------
  learning_rate: float = key(3.0e-3, "peak learning rate", min=0, section="optimizer (optax AdamW)",
                              section_tools=TRAINERS)
  lr_schedule: str = key("cosine", "cosine (warmup + cosine) | wsd (warmup-stable-decay) | "
                         "constant", choices=("cosine", "wsd", "constant"))
  warmup_steps: int = key(20, "linear warmup from 0 to learning_rate", min=0)
  final_lr_fraction: float = key(0.1, "cosine/wsd end at learning_rate x this", min=0, max=1)
  wsd_decay_fraction: float = key(0.2, "wsd: share of the steps spent in the final linear decay",
                                  min=0, max=1)
  adam_b1: float = key(0.9, "AdamW beta1", min=0, max=1)
  adam_b2: float = key(0.95, "AdamW beta2", min=0, max=1)
  adam_eps: float = key(1.0e-8, "AdamW epsilon", gt=0)
  weight_decay: float = key(0.1, "AdamW decoupled weight decay (matrices only, not norms)", min=0)
  max_grad_norm: float = key(1.0, "global-norm gradient clipping; 0 turns it off", min=0)
  moment_dtype: str = key(
      AUTO, "dtype of both AdamW moments (mu, nu), declared once for the state, its checkpoints "
      "and the compiled step; auto = weight_dtype (as MaxText's mu_dtype unset; its nu always "
      "follows the weights); bfloat16 with float32 weights halves the optimizer state",
      choices=(AUTO, *DTYPES))
  shard_optimizer_over_data: bool = key(
      True, "AdamW moments and the update sharded over the mesh's data axes too (ZeRO-1): "
      "gradients reduce-scattered, parameters all-gathered; acts only when a data axis > 1")
  z_loss_weight: float = key(0.0, "weight of the z-loss (log Z)^2 term; 0 turns it off", min=0)
  loss_chunk_length: int = key(
      AUTO_LOSS_CHUNK, "sequence positions per loss chunk: head + cross-entropy run chunk by "
      "chunk, so [batch, seq, vocab] fp32 logits never exist at once (0 = whole sequence; -1 = "
      "auto: chunks of 128 when the family has a separate LM head, vocab_size >= 8 x emb_dim and "
      "the sequence is longer, else whole)", min=-1, tools=(*TRAINERS, "evaluate"))
  moe_aux_loss_weight: float = key(0.0, "weight of the Switch/Qwen load-balancing loss (HF "
                                   "router_aux_loss_coef)", min=0, carried=True, **_COMPUTE,
                                   tools=(*TRAINERS, *CONVERT))
  router_bias_update_rate: float = key(
      0.0, "aux-loss-free balancing: selection bias += rate * sign(mean load - load) each step",
      min=0, **_COMPUTE)
  nonfinite_policy: str = key("halt", "a step with NaN/Inf loss or grad norm is never applied; "
                              "then halt (exit 5) | skip", choices=("halt", "skip"))
  max_nonfinite_skips: int = key(10, "skip: halt (exit 5) once more than this many steps were "
                                 "skipped", min=0)

  # ---- LoRA ------------------------------------------------------------------------------------
  lora_rank: int = key(0, "train low-rank adapters of this rank on the frozen base; 0 = full "
                       "fine-tuning", min=0, section="LoRA (adapters on a frozen base)",
                       section_tools=MODEL_TOOLS,
                       carried=True, **_COMPUTE)
  lora_alpha: float = key(32.0, "adapter scale alpha: the update is (alpha / rank) x A B", gt=0,
                          carried=True, **_COMPUTE)
  lora_targets: str = key(
      "", 'regex over the dense projections\' module paths (e.g. "decoder/.*/(query|value)$"); "" '
      "= every projection of the decoder layers with a named axis on each side (attention, MLP, "
      "Gated DeltaNet; not routers, gates to one value or the head)", carried=True, **_COMPUTE)

  # ---- quantization ------------------------------------------------------------------------------
  quantization: str = key(
      "", "quantized training through qwix on the decoder's dense projections and routed experts: "
      "int8 (weights and activations) | fp8 (e4m3) | int4 (weights only); \"\" = off. The "
      "embedding, the LM head and routers stay in full precision",
      choices=("", "int8", "fp8", "int4"),
      section="quantization (qwix; MaxText.quantize for post-training)",
      section_tools=MODEL_TOOLS, **_COMPUTE)
  quantization_exclude: str = key(
      "", "regex over the projections' module paths left in full precision by quantization "
      '(e.g. "attention/out$"; "experts": the routed experts)', **_COMPUTE)
  weight_bits: int = key(0, "integer weights of a quantized checkpoint (MaxText.quantize writes "
                         "it): 8 | 4; 0 = float weights", min=0, max=8, model=True)
  weight_group_size: int = key(0, "rows of the flattened input per weight scale of a quantized "
                               "checkpoint; 0 = one per output column", min=0, model=True)
  weight_quant_exclude: str = key("", "regex over the module paths a quantized checkpoint kept in "
                                  "float", model=True)
  weight_quant_vocab: bool = key(
      False, "a quantized checkpoint's vocabulary tables are int8 too (weight_bits=8): the "
      "embedding and Gemma's per-layer-input table with one scale per vocabulary row (a lookup "
      "scales the rows it gathers; a tied LM head multiplies by the int8 table and scales the "
      "logits), an untied LM head as the projections; weight_quant_exclude keeps one in float "
      '("embedding", "ple_embedding", "lm_head")', model=True)

  # ---- checkpoints -----------------------------------------------------------------------------
  enable_checkpointing: bool = key(True, "save checkpoints under <run dir>/checkpoints/",
                                   section="checkpoints (Orbax)",
                                   section_tools=TRAINERS)
  async_checkpointing: bool = key(True, "write checkpoints in the background")
  checkpoint_period: int = key(100, "save every N steps (and at the last step)", min=1)
  max_checkpoints_to_keep: int = key(3, "keep the newest N committed checkpoints", min=1)
  load_parameters_path: str = key("", 'start from these parameters only (fine-tuning); "" = fresh '
                                  "init. The tools: the checkpoint they read",
                                  tools=(*MODEL_TOOLS, "to_huggingface", "logit_check", "refit"))
  checkpoint_verify: bool = key(True, "on restore, check the manifest (file digests, array "
                                "checksums); false = faster, unchecked", tools=MODEL_TOOLS)
  checkpoint_fallback: bool = key(False, "a damaged newest step is set aside and the previous one "
                                  "restored (logged); false = exit 4")
  checkpoint_save_timeout_s: float = key(600.0, "a save not committed within this many seconds is "
                                         "an error (exit 4): hung storage", gt=0)

  # ---- metrics ---------------------------------------------------------------------------------
  enable_tensorboard: bool = key(True, "also write TensorBoard scalars to <run dir>/tensorboard/",
                                 section="metrics",
                                 section_tools=TRAINERS)
  peak_tflops_per_device: float = key(0.0, "peak for MFU; 0 = device table (GPU/TPU) or a "
                                      "measured CPU matmul rate", min=0)
  profiler: str = key("", '"" = off | xplane: trace profiler_steps steps with jax.profiler into '
                      "<run dir>/profile/ (TensorBoard's profile plugin / xprof read it; "
                      "`python benchmarks/tpu_profile.py summary DIR` prints its ops)",
                      choices=("", "xplane"))
  skip_first_n_steps_for_profiler: int = key(1, "profiler: the run's first N steps (compile, "
                                             "warm-up) are not traced", min=0)
  profiler_steps: int = key(5, "profiler: steps traced", min=1)

  # ---- evaluation and samples ------------------------------------------------------------------
  eval_period: int = key(0, "every N steps (and after the last) log eval_loss on held-out data; "
                         "0 = off", min=0, section="evaluation and samples during training",
                         section_tools=TEXT_TRAINERS)
  eval_steps: int = key(10, "batches per evaluation (fewer when the held-out data ends first)",
                        min=1, tools=(*TEXT_TRAINERS, "evaluate"))
  eval_dataset_path: str = key(
      "", "held-out file, directory or glob (dataset_format, dataset_text_field as for training); "
      '"" = the eval_split_fraction share of the training documents', tools=(*TEXT_TRAINERS, "evaluate"))
  sample_period: int = key(0, "every N steps print a sample (prompt, max_new_tokens and the "
                           "sampling keys below); 0 = off", min=0)
  sample_at_end: bool = key(True, "print a sample after the last step")
  sample_temperature: float = key(0.8, "the training samples' temperature (0 = greedy, which "
                                  "on a small model soon repeats one token)", min=0)
  sample_top_k: int = key(40, "the training samples' top-k (0 = off)", min=0)
  sample_prompt_tokens: int = key(
      32, "without prompt / prompt_ids, a training sample continues the first N tokens of a "
      "held-out document (eval_dataset_path / eval_split_fraction), else of the first training "
      "document", min=1)
