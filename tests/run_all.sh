#!/bin/sh
# Run each cmocka test binary; fail if any fails. Prints a closing summary line.
pass=0; fail=0; failed=""
for t in "$@"; do
  echo "=== $t"
  if "$t"; then pass=$((pass+1)); else fail=$((fail+1)); failed="$failed $t"; fi
done
echo "test binaries: $pass passed, $fail failed"
[ $fail -eq 0 ] || { echo "failed:$failed"; exit 1; }
