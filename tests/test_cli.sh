#!/bin/sh
# The kvforge command as a Unix tool: help on stdout with exit 0, usage errors
# (unknown options, missing values, bad --arch lists, bad operands) with exit 2
# and the option named on stderr, files that are not regular refused at once,
# progress on stderr only on a terminal and never with --quiet.
#   O=out sh tests/test_cli.sh        (make test runs it)
set -u
O=${O:-out}
BIN=${KVFORGE_BIN:-$O/bin/kvforge}
DUMP=${KVF_SRC:-.}/fuzz/corpus/dump/dump_fixed
[ -x "$BIN" ] || { echo "test_cli: $BIN is not built (make)"; exit 1; }
[ -f "$DUMP" ] || { echo "test_cli: $DUMP is missing"; exit 1; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export KVFORGE_CACHE_DIR="$TMP/cache"
pass=0 fail=0 skipped=""

bad() { fail=$((fail + 1)); echo "FAIL: $*"; }

# run ARGS...: the command (under a 60 s limit), rc in $rc, stdout in $TMP/out, stderr in $TMP/err
run() {
  timeout 60 "$BIN" "$@" >"$TMP/out" 2>"$TMP/err"
  rc=$?
}

# expect RC PATTERN ARGS...: exit status RC and PATTERN (fixed text) in stderr ("" for any)
expect() {
  want=$1 pat=$2
  shift 2
  run "$@"
  if [ "$rc" -ne "$want" ]; then bad "kvforge $*: exit $rc, expected $want; stderr: $(head -c 300 "$TMP/err")"; return; fi
  if [ -n "$pat" ] && ! grep -qF -- "$pat" "$TMP/err"; then bad "kvforge $*: stderr lacks \"$pat\": $(head -c 300 "$TMP/err")"; return; fi
  pass=$((pass + 1))
}

# usage_ok PATTERN ARGS...: exit 0, PATTERN in stdout, stderr empty
usage_ok() {
  pat=$1
  shift
  run "$@"
  if [ "$rc" -ne 0 ] || ! grep -qF -- "$pat" "$TMP/out" || [ -s "$TMP/err" ]; then
    bad "kvforge $*: exit $rc, stdout $(head -c 80 "$TMP/out"), stderr $(head -c 200 "$TMP/err")"
  else
    pass=$((pass + 1))
  fi
}

# --- help: stdout, exit 0
usage_ok "usage: kvforge COMMAND" --help
usage_ok "usage: kvforge COMMAND" -h
usage_ok "usage: kvforge COMMAND" help
for cmd in gen compile export info cache demo eval version; do
  usage_ok "usage: kvforge $cmd" "$cmd" --help
  usage_ok "usage: kvforge $cmd" help "$cmd"
done
run --help
for cmd in gen compile export info cache demo eval version help; do
  grep -qE "^  $cmd( |$)" "$TMP/out" || bad "kvforge --help does not list $cmd"
done
usage_ok "usage: kvforge eval" eval -h
usage_ok "usage: kvforge demo" demo --cpu --help   # --help wins: nothing runs
[ -s "$TMP/out" ] && grep -q "^backend:" "$TMP/out" && bad "demo --cpu --help ran the demo"
usage_ok "0." version
usage_ok "0." --version

# --- no command, unknown command, option before the command
expect 2 "usage: kvforge COMMAND"
[ -s "$TMP/out" ] && bad "kvforge with no command wrote to stdout"
expect 2 "unknown command 'bogus'" bogus
expect 2 "unknown command 'bogus'" help bogus
expect 2 "unknown option '--bogus'" --bogus

# --- unknown options: exit 2, the option named, nothing done (stdout empty)
for cmd in gen compile export info cache demo eval version; do
  expect 2 "kvforge $cmd: unknown option '--bogus'" "$cmd" --bogus
  [ -s "$TMP/out" ] && bad "kvforge $cmd --bogus wrote to stdout: $(head -c 200 "$TMP/out")"
  expect 2 "kvforge $cmd: unknown option '-Z'" "$cmd" -Z
done
expect 2 "unknown option '--bogus'" demo --bogus rtn_int2
[ -s "$TMP/out" ] && bad "demo --bogus ran"
expect 2 "unknown option '-x'" demo -cx
expect 2 "unknown option '--bogus'" eval --scheme rtn_int2 --data "$DUMP" --bogus
[ -s "$TMP/out" ] && bad "eval --bogus ran"
expect 2 "option '--json' takes no value" eval --scheme rtn_int2 --data "$DUMP" --json=1

# --- options that need a value
expect 2 "option '-o' needs a value" gen rtn_int2 -o
expect 2 "option '--output' needs a value" gen rtn_int2 --output
expect 2 "option '-o' needs a value" export rtn_int2 -o
expect 2 "option '--arch' needs a value" compile rtn_int2 --arch
expect 2 "option '--data' needs a value" eval --scheme rtn_int2 --data
expect 2 "option '--threads' needs a value" eval --scheme rtn_int2 --data "$DUMP" --threads
expect 2 "--threads 'x': must be an integer" eval --scheme rtn_int2 --data "$DUMP" --threads x
expect 2 "option '--output' given twice" gen rtn_int2 -o "$TMP/a" -o "$TMP/b"
expect 2 "option '--data' given twice" eval --scheme rtn_int2 --data "$DUMP" --data "$DUMP"

# --- --arch: once, no empty entry, no entry twice
for cmd in compile export; do
  expect 2 "option '--arch' given twice" $cmd rtn_int2 --arch sm_90 --arch sm_80
  expect 2 "an empty entry" $cmd rtn_int2 --arch sm_90,,sm_80
  expect 2 "an empty entry" $cmd rtn_int2 --arch ,sm_90
  expect 2 "an empty entry" $cmd rtn_int2 --arch sm_90,
  expect 2 "an empty entry" $cmd rtn_int2 --arch=
  expect 2 "sm_90 is given twice" $cmd rtn_int2 --arch sm_90,sm_80,sm_90
  expect 2 "more than 16 entries" $cmd rtn_int2 \
    --arch sm_50,sm_52,sm_53,sm_60,sm_61,sm_62,sm_70,sm_72,sm_75,sm_80,sm_86,sm_87,sm_89,sm_90,sm_100,sm_101,sm_120
done

# --- operands
expect 2 "missing SCHEME" gen
expect 2 "missing SCHEME" info
expect 2 "unexpected argument 'extra'" info rtn_int2 extra
expect 2 "unexpected argument 'extra'" demo rtn_int2 extra
expect 2 "missing the action" cache
expect 2 "unknown action 'bogus'" cache bogus
expect 2 "unexpected argument 'extra'" eval --scheme rtn_int2 --data "$DUMP" extra
expect 2 "--data and one of --scheme or --peer are required" eval --scheme rtn_int2
expect 2 "--peer takes no --warm" eval --peer "$DUMP" --data "$DUMP" --warm

# --- files that are not regular: refused at once (a FIFO with no writer never blocks)
mkfifo "$TMP/fifo"
expect 1 "is a FIFO (named pipe), not a regular file" eval --scheme rtn_int2 --data "$TMP/fifo"
expect 1 "is a FIFO (named pipe), not a regular file" eval --peer "$TMP/fifo" --data "$DUMP"
expect 1 "is a character device, not a regular file" eval --scheme rtn_int2 --data /dev/null
expect 1 "is a directory, not a regular file" eval --scheme rtn_int2 --data "$TMP"
expect 1 "is a FIFO, not a regular file" info "$TMP/fifo"
expect 1 "is a FIFO, not a regular file" eval --scheme rtn_int2 --data "$DUMP" --write-recon "$TMP/fifo"
expect 1 "cannot open" eval --scheme rtn_int2 --data "$TMP/none.safetensors"

# --- a run: the report on stdout, no progress on a stderr that is not a terminal
expect 0 "" eval --scheme rtn_int2 --data "$DUMP" --json --threads 1
grep -q '"overall"' "$TMP/out" || bad "eval --json: no report on stdout"
[ -s "$TMP/err" ] && bad "eval on a clean dump wrote to stderr (not a terminal): $(head -c 200 "$TMP/err")"
expect 0 "warning: --warm changed nothing" eval --scheme rtn_int2 --data "$DUMP" --warm
grep -q "kvforge eval: layer" "$TMP/err" && bad "eval showed progress on a stderr that is not a terminal"

# --- calibrate: a table that eval then reads; the scheme without one refused with the way out
expect 2 "--output is required" calibrate --scheme stable_int2 --data "$DUMP"
expect 2 "--chunks 'x'" calibrate --scheme stable_int2 --data "$DUMP" -o "$TMP/t.json" --chunks x
expect 2 "--chunks '1:0'" calibrate --scheme stable_int2 --data "$DUMP" -o "$TMP/t.json" --chunks 1:0
expect 2 "option '--chunks' given twice" calibrate --scheme stable_int2 --data "$DUMP" -o "$TMP/t.json" -c 0 -c 1
expect 1 "has no mixed precision" calibrate --scheme rtn_int2 --data "$DUMP" -o "$TMP/t.json"
expect 1 "kvforge calibrate writes it" eval --scheme stable_int2 --data "$DUMP"
expect 0 "" calibrate --scheme stable_int2 --data "$DUMP" -o "$TMP/t.json" --chunks 0:2
grep -q '"key"' "$TMP/t.json" || bad "calibrate: no table written: $(head -c 200 "$TMP/t.json")"
expect 0 "" eval --scheme stable_int2 --data "$DUMP" --table "$TMP/t.json" --json --threads 1
grep -q '"anchor_spans": 1' "$TMP/out" || bad "eval --table: no anchor span in the report: $(head -c 300 "$TMP/out")"
expect 2 "--peer takes no --table" eval --peer "$DUMP" --data "$DUMP" --table "$TMP/t.json"

# --- progress on a terminal (script(1) gives a pseudo-terminal), none with --quiet
if command -v script >/dev/null 2>&1 && script -qec true /dev/null >/dev/null 2>&1; then
  tty_run() { script -qec "$1" /dev/null >"$TMP/tty" 2>&1 </dev/null; }
  tty_run "'$BIN' eval --scheme rtn_int2 --data '$DUMP' --threads 1"
  if grep -q "kvforge eval: layer 1 of 1, chunk 3 of 3 (100%)" "$TMP/tty"; then pass=$((pass + 1))
  else bad "eval on a terminal: no progress line: $(head -c 300 "$TMP/tty")"; fi
  tty_run "'$BIN' eval --scheme rtn_int2 --data '$DUMP' --threads 1 --quiet"
  if grep -q "kvforge eval: layer" "$TMP/tty"; then bad "eval --quiet showed progress"
  elif grep -q "^overall" "$TMP/tty"; then pass=$((pass + 1))
  else bad "eval --quiet on a terminal: no table: $(head -c 300 "$TMP/tty")"; fi
  # multi-arch compile: NVRTC is needed (no GPU); skipped where it is missing
  if "$BIN" compile rtn_int2 --arch sm_80 >/dev/null 2>&1; then
    tty_run "'$BIN' compile rtn_int2 --arch sm_80,sm_90"
    if grep -q "kvforge compile: sm_90 (2 of 2)" "$TMP/tty"; then pass=$((pass + 1))
    else bad "compile on a terminal: no progress: $(head -c 300 "$TMP/tty")"; fi
    tty_run "'$BIN' compile rtn_int2 --arch sm_80,sm_90 -q"
    grep -q "kvforge compile: sm_" "$TMP/tty" && bad "compile -q showed progress"
    "$BIN" compile rtn_int2 --arch sm_80,sm_90 2>"$TMP/err" >/dev/null
    [ -s "$TMP/err" ] && bad "compile wrote to a stderr that is not a terminal: $(head -c 200 "$TMP/err")"
    if command -v "${CUDA_HOME:-/usr/local/cuda}/bin/fatbinary" >/dev/null 2>&1; then
      tty_run "'$BIN' export rtn_int2 --arch sm_80,sm_90 -o '$TMP/export'"
      if grep -q "kvforge export: compute_90 PTX (3 of 3)" "$TMP/tty" && grep -q "exported rtn_int2" "$TMP/tty"; then
        pass=$((pass + 1))
      else bad "export on a terminal: no progress: $(head -c 400 "$TMP/tty")"; fi
    else skipped="$skipped export-progress(no fatbinary)"; fi
  else skipped="$skipped compile-progress(no NVRTC: $("$BIN" compile rtn_int2 --arch sm_80 2>&1 | head -c 120))"; fi
else
  skipped="$skipped terminal-progress(no script(1))"
fi

echo "test_cli: $pass passed, $fail failed${skipped:+, skipped:$skipped}"
[ "$fail" -eq 0 ]
