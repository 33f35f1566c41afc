# san_shard LOG SECONDS SANITIZER_ARGS... -- PYTEST_ARGS...: the GPU-marked
# tests PYTEST_ARGS select, under compute-sanitizer SANITIZER_ARGS, within
# SECONDS, output appended to LOG. When the tool crashes (SIGSEGV), or reports
# an "Internal Sanitizer Error" (racecheck's "failed to handle a hardware
# exception", after which every CUDA call of the process fails), the test it
# happened in is logged on a line of its own as "CRASHED <id>" and the run
# resumes without it and the tests already passed or skipped. XLA runs as the
# tools need it (docs/design.md, "Sanitizers"):
#   - command buffers off: every kernel is a plain launch the tool sees;
#   - each program compiled as one module: compute-sanitizer 2025.3 crashes
#     (SIGSEGV) in programs XLA compiles in parallel pieces, the larger ones
#     such as the block's backward passes;
#   - no autotuning: racecheck stops with an internal error inside the
#     autotuner's runs of candidate GEMMs, and initcheck reports its
#     comparisons of their outputs;
#   - the slices XLA cuts from a loop's stacked operands on the main stream
#     (pass dynamic-slice-copy-fusion-async-wrapper off): on a stream of their
#     own, initcheck counts their writes before or after the reads that follow
#     them, in no fixed order.
# Every process shares one JAX compilation cache (/tmp/moelora_san_jax_cache):
# a program compiles once for all tools and shards.
# SAN_ASYNC_SLICES=1 leaves those slices on their own stream (the controls of
# scripts/san_runs/initcheck_async.tsv).
# SAN_XLA_FLAGS adds XLA flags; SAN_DONE names a file of test ids (one a line) already checked by
# this tool in earlier calls, deselected from the start. Sourced by device_check.sh;
# tests/test_device_check.py runs it with a stand-in tool.
san_shard() {
  local log=$1 end=$(( $(date +%s) + $2 )); shift 2; local san=() py=() skip=() checked=() t
  local slices=--xla_disable_hlo_passes=dynamic-slice-copy-fusion-async-wrapper
  [ "${SAN_ASYNC_SLICES:-0}" = 1 ] && slices=
  while [ "$1" != -- ]; do san+=("$1"); shift; done; shift; py=("$@")
  if [ -n "${SAN_DONE:-}" ] && [ -f "$SAN_DONE" ]; then
    for t in $(cat "$SAN_DONE"); do checked+=(--deselect "$t"); done
  fi
  while [ "$(date +%s)" -lt "$end" ]; do
    local from=$(( $( (cat "$log" 2> /dev/null || true) | wc -l) + 1 )) rc broke
    XLA_FLAGS="--xla_gpu_enable_command_buffer= --xla_gpu_force_compilation_parallelism=1 --xla_gpu_autotune_level=0 $slices ${SAN_XLA_FLAGS:-}" \
    JAX_COMPILATION_CACHE_DIR=/tmp/moelora_san_jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0 timeout $(( end - $(date +%s) )) \
      compute-sanitizer "${san[@]}" python3 -m pytest -v -p no:cacheprovider -m gpu "${py[@]}" \
      "${checked[@]}" "${skip[@]}" >> "$log" 2>&1
    rc=$?
    if [ $rc -eq 139 ]; then
      broke=$(grep -oE '^tests/[^ ]+::[^ ]+' "$log" | tail -1)
    else
      broke=$(tail -n +"$from" "$log" | grep -m1 -oE '^tests/[^ ]+::[^ ]+ =+ Internal Sanitizer Error' |
              cut -d' ' -f1)
      [ -n "$broke" ] || break
    fi
    printf '\nCRASHED %s\n' "$broke" >> "$log"
    skip=()
    for t in $(grep -oE '^tests/[^ ]+::[^ ]+ (PASSED|SKIPPED)' "$log" | cut -d' ' -f1) \
             $(grep -E '^CRASHED ' "$log" | cut -d' ' -f2); do skip+=(--deselect "$t"); done
  done
}

# san_errors LOG...: the error records the tool printed (each one is printed
# when it happens, so those of runs that crashed count too).
san_errors() {
  cat "$@" | grep -cE '^========= (Invalid|Uninitialized|Error|Race|Barrier|Potential|Warning)'
}

# san_summary LOG...: one line on the runs in the logs: the tool's summaries
# (counted), pytest's, the tests the tool crashed in, and the error records.
san_summary() {
  echo "$(grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" "$@" | sort | uniq -c | tr -s ' ' | paste -sd';'); \
$(grep -hE "(passed|failed).* in " "$@" | tr -s ' ' | paste -sd';'); \
crashed: $(cat "$@" | grep -c '^CRASHED '), error records: $(san_errors "$@")"
}
