#!/usr/bin/env bash
# Run one GPU pass and pack everything it writes into a few files under $OUT: <name>-results.tgz (logs, JSON),
# its *summary*.json files, and the updated compile cache (cutecache.tgz, when small). Restores a compile cache
# left in .cutecache/cutecache.tgz first, so that a pass on a fresh machine starts warm.
#
#   bash scripts/device_pass.sh ep python3 scripts/gpu_ep.py
set -uo pipefail
name=$1; shift
final=${OUT:-$PWD/out}
work=/tmp/pass-$name
mkdir -p "$work" "$final"
export CACHE=$PWD/.cutecache QUACK_CACHE_AUTOTUNING=1
export QUACK_CACHE_DIR=$CACHE/quack TRITON_CACHE_DIR=$CACHE/triton
mkdir -p "$QUACK_CACHE_DIR" "$TRITON_CACHE_DIR"
if [ -f "$CACHE/cutecache.tgz" ]; then tar -xzf "$CACHE/cutecache.tgz" -C "$CACHE" && rm "$CACHE/cutecache.tgz"; fi
# Into a file, not through a pipe: a background process the command leaves running (nvidia-smi -l ...) would
# keep a pipe open and hang the pass until the caller's time limit.
OUT=$work "$@" > "$work/$name-driver.log" 2>&1
rc=$?
tail -c 11000 "$work/$name-driver.log"
tar -czf "$final/$name-results.tgz" -C "$work" .
cp "$work"/*summary*.json "$final/" 2>/dev/null
tar -czf /tmp/cutecache.tgz -C "$CACHE" quack triton 2>/dev/null \
  && [ "$(stat -c %s /tmp/cutecache.tgz)" -lt 15000000 ] && cp /tmp/cutecache.tgz "$final/"
echo "device_pass $name: rc $rc"
exit $rc
