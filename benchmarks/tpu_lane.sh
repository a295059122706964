# What the chip's lane scripts share (benchmarks/tpu_suite.sh, tpu_profile.sh): sourced from the
# repository root after the script has set DRY (1: --dry-run).
#   run CMD ...          runs a stage's command; in a dry run prints it instead, as `[dry-run] ...`
#                        on the script's own stdout (fd 3), whatever the call redirects
#   lane_install NAME    installs .whl-tpu (benchmarks/tpu_install.sh) into this shell; exit 3
#                        naming NAME when the wheels do not install
#   lane_commit          the commit a report names: $SUITE_COMMIT, else `git describe --dirty` (the
#                        chip's copy of a tree whose .git is older says -dirty)
exec 3>&1
run() {
  if [ "$DRY" = 1 ]; then { printf '[dry-run]'; printf ' %q' "$@"; echo; } >&3; return 0; fi
  "$@"
}
lane_install() {
  # shellcheck source=/dev/null
  source benchmarks/tpu_install.sh || { echo "$1: the wheels did not install" >&2; exit 3; }
}
lane_commit() {
  echo "${SUITE_COMMIT:-$(git describe --always --dirty --abbrev=7 2>/dev/null || echo unknown)}"
}
