"""The programs that read a config, by the names the schema's `tools=` tags and the refusals use.

Each schema key says which of them read it (`Spec.tools`: its section's default, or the key's own
tag); a key the user sets away from its schema default for a tool that does not read it is refused
(`MaxText.config.load.check_read_by`: exit 2 naming the key and the tools that do read it), so that
no setting is silently ignored. Imports nothing.
"""

TOOLS = {
    "train": "train.py",
    "grpo": "python -m MaxText.rl.grpo",
    "dpo": "python -m MaxText.dpo",
    "distill": "python -m MaxText.distill",
    "decode": "python -m MaxText.decode",
    "evaluate": "python -m MaxText.evaluate",
    "inspect": "python -m MaxText.inspect",
    "quantize": "python -m MaxText.quantize",
    "to_maxtext": "python -m MaxText.checkpoint_conversion.to_maxtext",
    "to_huggingface": "python -m MaxText.checkpoint_conversion.to_huggingface",
    "logit_check": "python -m MaxText.logit_check",
    "refit": "python -m MaxText.refit",
    "lm_eval": "python -m MaxText.lmeval",
    "serve": "python -m MaxText.serve",
}

TRAINERS = ("train", "grpo", "dpo", "distill")                 # the step loop's programs
TEXT_TRAINERS = ("train", "distill")   # trainers of train.py's data, evaluation and samples
SAMPLERS = (*TEXT_TRAINERS, "grpo")  # trainers that decode (samples, rollouts)
MODEL_TOOLS = (*TRAINERS, "decode", "evaluate", "inspect", "quantize",   # build a model: a config
               "lm_eval", "serve")
CONVERT = ("to_maxtext",)            # takes the architecture from config.json (refuses yours)
DECODERS = ("decode", "inspect")     # a prompt through the model
