# Sourced by scripts/bootstrap.sh (and tests/unit/test_bootstrap.py): runs install phases with one
# progress line each on stdout, and puts everything they print (apt, pip, the compilers' warnings,
# npm, go) into one log file instead.
#
#   progress_log FILE    the log (the previous one is kept as FILE.1); prints its path
#   phase NAME CMD...    runs CMD (a command or a shell function) with its stdout and stderr
#                        appended to the log; prints "NAME  <seconds>" when it ends. Needs `set -e`
#                        and must not be called as part of `||`, `&&` or `if` (bash then ignores -e
#                        inside CMD, so a failing step would go unnoticed): a failure ends the script
#                        with CMD's status, and the EXIT trap set here prints the log's path and last
#                        lines on stderr.
# $TRAINOP_TIMINGS (when set) gets "NAME seconds" lines too: .ci/run prints them in its summary.

PROGRESS_LOG=/dev/null
PROGRESS_TAIL=${PROGRESS_TAIL:-40}
_phase_name="" _phase_start=0 _phase_line=0

progress_log() {
  PROGRESS_LOG=$1
  mkdir -p "$(dirname "$PROGRESS_LOG")"
  [[ -s $PROGRESS_LOG ]] && mv -f "$PROGRESS_LOG" "$PROGRESS_LOG.1"
  : >"$PROGRESS_LOG"
  echo "full output (apt, pip, compilers, npm, go): $PROGRESS_LOG"
}

_duration() {  # 75 -> "1 min 15 s"
  if (($1 < 60)); then echo "$1 s"; else printf '%d min %02d s\n' $(($1 / 60)) $(($1 % 60)); fi
}

phase() {
  _phase_name=$1 _phase_start=$SECONDS _phase_line=$(wc -l <"$PROGRESS_LOG")
  shift
  printf '  %-32s ' "$_phase_name"
  printf '\n=== %s: %s (%s)\n' "$_phase_name" "$*" "$(date '+%F %T')" >>"$PROGRESS_LOG"
  "$@" >>"$PROGRESS_LOG" 2>&1
  local took=$((SECONDS - _phase_start))
  _duration "$took"
  [[ -z ${TRAINOP_TIMINGS:-} ]] || printf '  %-30s %5ds\n' "$_phase_name" "$took" >>"$TRAINOP_TIMINGS"
  _phase_name=""
}

_progress_exit() {
  local rc=$1
  [[ -n $_phase_name ]] || return 0
  local took=$((SECONDS - _phase_start))
  echo "FAILED after $(_duration "$took")"
  [[ -z ${TRAINOP_TIMINGS:-} ]] || printf '  %-30s %5ds  FAILED\n' "$_phase_name" "$took" >>"$TRAINOP_TIMINGS"
  # A build's last lines are often the tool's traceback; the cause (a compiler's error, a full
  # disk) comes earlier, so the phase's first error lines are shown too, and the free space: a
  # full disk is the usual failure of a machine whose caches are warm.
  local errors
  errors=$(tail -n "+$((_phase_line + 1))" "$PROGRESS_LOG" |
    grep -m 5 -iE 'error:|^npm error|no space left|ENOSPC' || true)
  {
    echo "$_phase_name failed (exit status $rc)"
    [[ -z $errors ]] || { echo "its first errors:"; sed 's/^/    /' <<<"$errors"; }
    echo "free disk: $(df -h --output=avail "$(dirname "$PROGRESS_LOG")" | tail -1 | tr -d ' ')"
    echo "the last $PROGRESS_TAIL lines of $PROGRESS_LOG:"
    tail -n "$PROGRESS_TAIL" "$PROGRESS_LOG" | sed 's/^/    /'
    echo "the whole output: $PROGRESS_LOG"
  } >&2
}
trap '_progress_exit $?' EXIT
# Interrupted (Ctrl-C, a CI timeout): the EXIT trap's report then names the signal's status, not 0.
trap 'exit 130' INT
trap 'exit 143' TERM
