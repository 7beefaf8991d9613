#!/bin/sh
# The library boundary: libkvforge.so exports exactly the functions that
# include/kvforge.h declares with KVF_API, and nothing else.
# usage: tests/check_exports.sh out/lib/libkvforge.so include/kvforge.h
set -eu
lib=$1 header=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
nm -D --defined-only "$lib" | awk '$2 ~ /^[TDBRV]$/ {print $3}' | sort > "$tmp/exported"
sed -n 's/^KVF_API [^(]*[ *]\(kvf_[a-z0-9_]*\)(.*/\1/p' "$header" | sort > "$tmp/declared"
if ! cmp -s "$tmp/exported" "$tmp/declared"; then
  echo "libkvforge.so's exports differ from kvforge.h's KVF_API functions (< exported, > declared):"
  diff "$tmp/exported" "$tmp/declared" || true
  exit 1
fi
echo "library boundary: $(wc -l < "$tmp/exported") symbols exported, all declared KVF_API in $header"
