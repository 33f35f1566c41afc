#!/usr/bin/env bash
# san_carry.sh RESULTS_TGZ [DIR]: after a `STEPS=sanall` call of device_check.sh,
# fold its lists into DIR (default .san_done, git-ignored), the folder the next
# call carries as SANALL_DONE_DIR: each tool's list of tests done is replaced by
# the call's (which already holds the earlier lists), its seconds appended to
# <tool>_times.tsv. Prints each tool's count of tests done.
set -eu
tgz=$1; dir=${2:-.san_done}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
tar xzf "$tgz" -C "$tmp"
mkdir -p "$dir"
for done in "$tmp"/r/sanall_done_*.txt; do
  [ -e "$done" ] || continue
  tool=$(basename "$done" .txt); tool=${tool#sanall_done_}
  cp "$done" "$dir/$tool.txt"
  [ -f "$tmp/r/sanall_times_$tool.tsv" ] && cat "$tmp/r/sanall_times_$tool.tsv" >> "$dir/${tool}_times.tsv"
  echo "$tool: $(wc -l < "$dir/$tool.txt") tests done"
done
