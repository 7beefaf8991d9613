# Helpers of the GPU scripts here; each sources this file with
#   . "$(dirname "$0")/lib.sh"
#
# run NAME LIMIT CMD...: CMD under `timeout LIMIT` (exit 124 = timed out), its
# output into $RUN_OUT/NAME, and one summary line
#   -- NAME: exit RC after S s (limit L s)
# Returns CMD's exit status. The caller sets:
#   RUN_OUT     the folder of the parts' outputs;
#   RUN_BUDGET  (optional) seconds for the whole script, counted from RUN_T0 (a
#               value of $SECONDS): a part's limit is cut to what is left of
#               them, and a part with less than 5 s left is not started
#               ("-- NAME: skipped (no time left)", status 1).
run() {
  local name=$1 limit=$2 start=$SECONDS rc left
  shift 2
  if [ -n "${RUN_BUDGET:-}" ]; then
    left=$((RUN_BUDGET - (SECONDS - RUN_T0)))
    [ "$left" -lt "$limit" ] && limit=$left
    [ "$limit" -lt 5 ] && { echo "-- $name: skipped (no time left)"; return 1; }
  fi
  timeout "$limit" "$@" >"$RUN_OUT/$name" 2>&1; rc=$?
  echo "-- $name: exit $rc after $((SECONDS - start)) s (limit $limit s)"
  return $rc
}
