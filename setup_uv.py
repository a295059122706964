"""setup.sh's installs through uv, configured as pip is: `python setup_uv.py UV ARGS...` runs
`UV pip install ARGS...` into this python's environment with the package sources that pip's own
configuration gives `pip install` (its config files and PIP_* variables, read by pip itself): the
index, the extra indexes, find-links, constraints, pre-releases, trusted hosts, the CA bundle and
the time-out. uv reads none of pip's configuration; its own (uv.toml) is not read (--no-config), so
what it installs is what pip would. pip's choice among indexes is the best version over all of them
(uv's default takes the first index that has the package: --index-strategy unsafe-best-match). The
bytecode is compiled at install (--compile-bytecode, as pip does) only where Python cannot cache it
itself, PYTHONDONTWRITEBYTECODE set: elsewhere Python writes the bytecode of what a process imports
the first time it imports it, rather than every file of every package (most of torch and
transformers never imported) at install. A pip setting with no translation here
stops it (status 1, naming the setting) before uv runs: setup.sh then installs with pip.
`--print` first: prints the uv command and the variables it adds instead of running it."""
import math
import os
import shlex
import sys

from pip._internal.commands import create_command

# pip settings that do not change what is installed or from where (uv keeps its own cache)
IGNORED = {"disable_pip_version_check", "cache_dir", "retries", "progress_bar", "no_color", "quiet",
           "verbose", "log", "no_input", "root_user_action", "warn_script_location",
           "warn_about_conflicts", "no_python_version_warning", "require_venv", "compile"}


def uv_command(uv: str, args: list[str]) -> tuple[list[str], dict[str, str]]:
  """The uv command for `pip install ARGS` under pip's configuration, and the variables it adds."""
  install = create_command("install")
  opts, _ = install.parse_args([])   # pip's defaults updated from its config files and PIP_*
  flags = ["--python", sys.executable, "--no-config", "--quiet",
           *(["--compile-bytecode"] if os.environ.get("PYTHONDONTWRITEBYTECODE") else []),
           "--index-strategy", "unsafe-best-match"]
  if opts.no_index:
    flags.append("--no-index")
  else:
    # pip takes the best file (wheel tag) of a version among all indexes; uv takes the version's
    # files from the first index that has it. The main index first: an extra index that mirrors
    # part of it (here /opt/pypi: multiprocess 0.70.19's py310 wheel, not PyPI's py311 one pip
    # installs) leaves uv the main index's full set.
    indexes = [opts.index_url, *opts.extra_index_urls]
    flags += [f for url in indexes for f in ("--index", url)] + ["--default-index", opts.index_url]
  flags += [f for place in opts.find_links for f in ("--find-links", place)]
  flags += [f for path in opts.constraints for f in ("--constraint", path)]
  flags += [f for host in opts.trusted_hosts for f in ("--allow-insecure-host", host)]
  if opts.pre:
    flags += ["--prerelease", "allow"]
  env = {"UV_HTTP_TIMEOUT": str(math.ceil(opts.timeout))}
  if opts.cert:
    env["SSL_CERT_FILE"] = opts.cert
  handled = {"index_url", "no_index", "extra_index_urls", "find_links", "constraints",
             "trusted_hosts", "pre", "timeout", "cert"}
  defaults = install.parser.defaults
  left = sorted(name for name, value in vars(opts).items()
                if name not in handled | IGNORED and value != defaults.get(name))
  if left:
    sys.exit(f"setup_uv.py: pip's configuration sets {', '.join(left)}, which is not handed to uv")
  return [uv, "pip", "install", *flags, *args], env


def main(argv: list[str]) -> None:
  show = argv[:1] == ["--print"]
  if show:
    argv = argv[1:]
  command, env = uv_command(argv[0], argv[1:])
  if show:
    print(shlex.join(command))
    print("\n".join(f"{name}={value}" for name, value in env.items()))
    return
  os.execve(command[0], command, {**os.environ, **env})


if __name__ == "__main__":
  main(sys.argv[1:])
