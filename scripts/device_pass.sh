#!/usr/bin/env bash
# Run one GPU pass script on the device machine and pack everything it writes into at most a few files under
# $OUT (the device tool returns at most 8 files). Usage (first line of the device command must be
# `source .devbundle/setup.sh`):   bash scripts/device_pass.sh <name> <command...>
# Restores the carried compile cache (.cutecache/cutecache.tgz) first and ships the updated one back.
set -uo pipefail
name=$1; shift
final=${OUT:-$PWD/out}
work=/tmp/pass-$name
mkdir -p "$work" "$final"
export CACHE=$PWD/.cutecache QUACK_CACHE_AUTOTUNING=1
export QUACK_CACHE_DIR=$CACHE/quack TRITON_CACHE_DIR=$CACHE/triton
mkdir -p "$QUACK_CACHE_DIR" "$TRITON_CACHE_DIR"
if [ -f "$CACHE/cutecache.tgz" ]; then tar -xzf "$CACHE/cutecache.tgz" -C "$CACHE" && rm "$CACHE/cutecache.tgz"; fi
OUT=$work "$@" 2>&1 | tee "$work/$name-driver.log"
rc=${PIPESTATUS[0]}
tar -czf "$final/$name-results.tgz" -C "$work" .
cp "$work"/*summary*.json "$final/" 2>/dev/null
tar -czf /tmp/cutecache.tgz -C "$CACHE" quack triton 2>/dev/null \
  && [ "$(stat -c %s /tmp/cutecache.tgz)" -lt 15000000 ] && cp /tmp/cutecache.tgz "$final/"
echo "device_pass $name: rc $rc"
exit $rc
