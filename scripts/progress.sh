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
#   phase_beside NAME CMD...   the same, but CMD runs in the background and the script goes on
#                        with the next phases: for a phase that leaves a core idle beside phases
#                        that do not need what it makes (the images' build, busy 56 % of 2 cores,
#                        beside the Go builds). Its output goes to a log of its own, appended to
#                        the log when it is joined.
#   phases_joined        waits for the phases started beside, in order: prints each one's line
#                        ("NAME  <seconds> (beside)", its own start to its own end), or fails the
#                        script as `phase` does, with that phase's report.
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
  _timing "$_phase_name" "$took"
  _phase_name=""
}

_timing() {  # NAME SECONDS [MARK]: a line for $TRAINOP_TIMINGS, when set
  [[ -z ${TRAINOP_TIMINGS:-} ]] || printf '  %-30s %5ds%s\n' "$1" "$2" "${3:+  $3}" >>"$TRAINOP_TIMINGS"
}

_beside=()  # the phases running beside: "NAME<TAB>PID<TAB>START<TAB>OWN LOG"

phase_beside() {
  local name=$1 log
  shift
  log="$PROGRESS_LOG.beside.${#_beside[@]}"
  printf '\n=== %s: %s (%s)\n' "$name" "$*" "$(date '+%F %T')" >"$log"
  # (errexit holds in the subshell; its EXIT trap notes when it ended, failed or not)
  ( trap 'echo $SECONDS >"$log.end"' EXIT; "$@" ) >>"$log" 2>&1 &
  _beside+=("$name"$'\t'"$!"$'\t'"$SECONDS"$'\t'"$log")
  printf '  %-32s started, beside the next phases\n' "$name"
}

phases_joined() {
  local entry pid log rc took
  for entry in "${_beside[@]}"; do
    IFS=$'\t' read -r _phase_name pid _phase_start log <<<"$entry"
    rc=0
    wait "$pid" || rc=$?
    _phase_line=$(wc -l <"$PROGRESS_LOG")
    cat "$log" >>"$PROGRESS_LOG"
    took=$(($(cat "$log.end" 2>/dev/null || echo $SECONDS) - _phase_start))
    rm -f "$log" "$log.end"
    if ((rc)); then
      printf '  %-32s ' "$_phase_name"
      _phase_start=$((SECONDS - took))  # (the report's time: the phase's own)
      exit "$rc"
    fi
    printf '  %-32s %s (beside)\n' "$_phase_name" "$(_duration "$took")"
    _timing "$_phase_name" "$took" beside
  done
  _beside=() _phase_name=""
}

_kill_tree() {  # (no job control here: the phase's builders are not in a group of their own)
  local child
  for child in $(pgrep -P "$1" || true); do _kill_tree "$child"; done
  kill "$1" 2>/dev/null || true
}

_progress_exit() {
  local rc=$1 entry pid
  for entry in "${_beside[@]}"; do  # the script ends early: what runs beside stops too
    IFS=$'\t' read -r _ pid _ _ <<<"$entry"
    _kill_tree "$pid"
  done
  [[ -n $_phase_name ]] || return 0
  local took=$((SECONDS - _phase_start))
  echo "FAILED after $(_duration "$took")"
  _timing "$_phase_name" "$took" FAILED
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
