"""The programs that read a config, by the names the schema's `tools=` tags and the refusals use.

Each schema key says which of them read it (`Spec.tools`: its section's default, or the key's own
tag); a key the user sets away from its schema default for a tool that does not read it is refused
(`MaxText.config.load.check_read_by`: exit 2 naming the key and the tools that do read it), so that
no setting is silently ignored. And what every program's --help opens with (its usage line) and
says of its exit statuses. Imports nothing of the package.
"""
import os
import sys
import textwrap

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

# the programs that read no config key of their own (their command after `--` may): for --help
OTHER_PROGRAMS = {
    "launch": "python -m MaxText.launch",
    "launch_local": "python -m MaxText.launch.local",
    "render": "python -m MaxText.config.render",
}
PROGRAMS = {**TOOLS, **OTHER_PROGRAMS}

# what follows the program's name on its --help's "usage:" line
SYNOPSIS = {
    **{t: "CONFIG.yml [key=value ...]" for t in (*TRAINERS, "decode", "evaluate")},
    **{t: "[CONFIG.yml] [key=value ...]" for t in ("inspect", "quantize", "serve")},
    **{t: "key=value ..." for t in ("to_maxtext", "to_huggingface", "logit_check", "refit")},
    "lm_eval": "--model maxtext --model_args KEY=VALUE,... --tasks TASKS [lm-eval's arguments]",
    "launch": "key=value ... -- CONFIG.yml [key=value ...]",
    "launch_local": "[key=value ...] -- COMMAND ...",
    "render": "[--check]",
}

# the exit statuses of each program, its --help's "exit status:" line (README "Exit status",
# MaxText/runtime/exit_codes.py); anything else (a traceback's 1) is a bug
_TRAINED = ("4 bad checkpoint or failed save, 5 non-finite loss, 42 preempted (saved; rerun to "
            "resume), 130 / 143 stopped at once by a second Ctrl-C / SIGTERM (the step in flight "
            "not saved)")
EXIT_STATUS = {
    "train": f"0 done, 2 bad config (a missing data file too), 3 bad data, {_TRAINED}",
    "grpo": f"0 done, 2 bad config (a missing prompts file too), 3 more than max_bad_rewards bad "
            f"rewards, {_TRAINED}",
    "dpo": f"0 done, 2 bad config (a missing preferences file too), 3 a bad preference row, "
           f"{_TRAINED}",
    "distill": f"0 done, 2 bad config (a missing data file too), 3 bad data, {_TRAINED}",
    "decode": "0 done, 2 bad config or request, 3 an image or audio file that cannot be read, "
              "4 bad checkpoint",
    "evaluate": "0 done, 2 bad config, 3 bad data, 4 bad checkpoint",
    "inspect": "0 done, 2 bad config or request, 3 an image or audio file that cannot be read, "
               "4 bad checkpoint",
    "quantize": "0 done, 2 bad config or argument, 3 bad calibration data, 4 bad or missing "
                "checkpoint",
    "to_maxtext": "0 done, 2 bad config, argument or Hugging Face folder, 4 bad checkpoint",
    "to_huggingface": "0 done, 2 bad config or argument, 4 bad checkpoint",
    "logit_check": "0 the logits agree within the limits, 6 they do not (the check failed), "
                   "2 bad config or argument (a missing folder too), 4 bad checkpoint",
    "refit": "0 done, 2 bad config or argument, 4 bad checkpoint",
    "lm_eval": "0 done, 2 bad config or model argument, 3 bad data, 4 bad checkpoint; lm-eval's "
               "own errors as lm-eval reports them",
    "serve": "0 stopped (SIGTERM / Ctrl-C: drained), 2 bad config or argument, 4 bad checkpoint",
    "launch": "0 submitted (dry_run: printed), 2 bad config or argument (xpk not on PATH too); "
              "else xpk's own",
    "launch_local": "0 every process exited 0, 2 bad argument; else the first non-zero status of "
                    "a process (128 + n when killed by signal n)",
    "render": "0 written (--check: configs/base.yml and MaxText/config/views_generated.py are "
              "up to date), 6 --check: one is stale, 2 bad argument",
}


def usage_head(program: str) -> str:
  """The first lines of every program's --help (MaxText/config/cli.py: usage): how it is called."""
  return f"usage: {PROGRAMS[program]} {SYNOPSIS[program]}\n       {PROGRAMS[program]} --help\n\n"


def exit_status_line(program: str) -> str:
  """Its --help's paragraph of exit statuses."""
  return textwrap.fill(f"exit status: {EXIT_STATUS[program]}.", 100)


def print_help(text: str) -> None:
  """Writes a --help to stdout; a reader that stopped early (`| head`, `| grep -q`) is no error
  (no BrokenPipeError traceback: the rest goes to /dev/null)."""
  try:
    sys.stdout.write(text.rstrip("\n") + "\n")
    sys.stdout.flush()
  except BrokenPipeError:
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
