#!/usr/bin/env bash
# One call on the GPU machine (the device tool's `run`): build against that
# machine's jaxlib, then the steps named in STEPS, one after the other on GPU 0
# (timings never share the GPU with the test suite). Everything lands in
# $OUT/results.tgz, also when a step overruns (the steps get BUDGET seconds,
# default 560; each step has its own timeout too).
#   run: bash scripts/device_check.sh                 (timeout_s 600, carry [".whl"])
# The machine has no network: the CUTLASS headers of expert_matmul come from
# the nvidia-cutlass wheel in .whl/ (`pip download --no-deps "nvidia-cutlass==4.2.*"
# -d .whl` here first); without it that kernel is not built.
#   env: STEPS="build readme bench bench2 gemm train peer timing suite soak fuzz memcheck racecheck initcheck synccheck sanall sanruns ncu scaling"
#        (soak: the 10,000-step soak with its counts printed; fuzz: the GPU
#        differential fuzzing with FUZZ examples per test, default 100, on FUZZ_N
#        workers within FUZZ_S seconds; sanall: SANALL_TOOLS, default "memcheck
#        racecheck initcheck synccheck", over the whole GPU-marked suite in
#        SANALL_N processes per tool that take the tests from one queue (default 4;
#        SANALL_SHARDS: the process numbers this call runs, default all; SANALL_DONE_DIR: a
#        carried folder of <tool>.txt lists of tests checked in earlier calls,
#        skipped, and <tool>_times.tsv, their seconds, longest run first; each call
#        writes the lists anew as sanall_done_<tool>.txt and the seconds of its
#        tests as sanall_times_<tool>.tsv, to split a run over calls), every tool at
#        once, within SANALL_S seconds (default 480), every
#        kernel checked, or those whose names match the regex SANALL_KERNELS
#        (not initcheck's: it needs every kernel's writes tracked; SANALL_API_CHECK:
#        its --check-api-memory-access, default no); scripts/san_carry.sh folds a
#        call's lists into .san_done for the next call;
#        SANALL_OPTS: more compute-sanitizer options; SAN_XLA_FLAGS: more XLA
#        flags under the tool; SAN_ASYNC_SLICES=1: a loop's slices on their own
#        stream (scripts/san_shard.sh); SANALL_FILES, SANALL_K:
#        test files and a -k expression instead of the whole suite; tests during which the
#        tool crashes or reports an internal error are listed as CRASHED and skipped;
#        on a machine of several GPUs the processes take the GPUs in turn)
#        sanruns: the sanitizer runs listed in the files SANRUNS (scripts/san_runs/),
#        all at once, one process each, a line each, tab-separated: name,
#        environment (VAR=value ..., or -), seconds, compute-sanitizer options
#        (--print-limit 20 and --show-backtrace device unless given),
#        pytest arguments (test ids; no -k expression with spaces); logs
#        sanrun_<name>.log and sanrun_times_<name>.tsv
#        (readme: the README's GPU command without its download step, which
#        builds the kernels and runs the demo on the GPU; it replaces build)
#        BENCH="<bench args>"  BENCH2="<a second bench>"  BENCH_S, BENCH2_S=<their timeouts, 240, 200>  TESTS="<pytest args of the suite step>"
#        SAN_FILES="<test files of the sanitizer steps>"  SAN_K="<their -k expression>"
#        KERNELS=<ncu name regex>  NCU_ARGS="<bench args of the ncu step>"  NCU2_ARGS="<a second one>"
#        NCU_LAUNCHES=<launches profiled per ncu run, default 2>
#        CMDBUF_FLAGS="<XLA_FLAGS of the cmdbuf step's second runs>"  GEMM="<bench --gemm args>"  GEMM_S=<its timeout, 240>
#        TRAIN="<bench --train args>"  TRAIN_S=<its timeout, 240>  (train: the training benchmark)
#        PEER="<scripts/peft_train_peer.py args>"  PEER_S=<its timeout, 150>  (peer: transformers + peft, same GPU)
#        (timing: the decode timing, then `demo --timing --prefill`, T = 4096, base and
#        4 adapters with ragged_dot and expert_matmul as the grouped GEMM, into
#        timing_prefill.json/.log; PREFILL="<its extra demo args>", PREFILL_S=<its timeout, 0 skips it>;
#        TIMING="<extra args of the decode timing>", e.g. TIMING="--trace \$OUT/r/trace")
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=$OUT/r; mkdir -p "$R"
if [ "${1:-}" != steps ]; then
  T0=$(date +%s) timeout -k 5 "${BUDGET:-560}" bash "$0" steps
  echo "steps rc=$?" >> "$R/phases.log"
  tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"
  exit 0
fi
STEPS=" ${STEPS:-build bench bench2 timing suite memcheck racecheck ncu} "
has() { case "$STEPS" in *" $1 "*) return 0;; *) return 1;; esac; }
step() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$R/phases.log"; }
export CUDA_VISIBLE_DEVICES=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi > "$R/nvidia-smi.txt" 2>&1
if has build; then
  step build
  ls .whl/nvidia_cutlass-*.whl > /dev/null 2>&1 && python3 -m pip install --no-deps .whl/nvidia_cutlass-*.whl > "$R/build.log" 2>&1
  timeout 300 python3 -m pip install --no-build-isolation --no-deps -v . >> "$R/build.log" 2>&1; step "build rc=$?"
  grep -E "expert_matmul:|jax_moelora CUDA" "$R/build.log" >> "$R/phases.log"
  python3 -m jax_moelora info >> "$R/build.log" 2>&1
fi
if has readme; then  # the README's GPU command, its first (download) step skipped
  step readme
  ls .whl/nvidia_cutlass-*.whl > /dev/null 2>&1 && python3 -m pip install --no-deps .whl/nvidia_cutlass-*.whl > "$R/readme.log" 2>&1
  CMD=$(grep -m1 '^python3 -m pip install "jax\[cuda' README.md | sed 's/^[^&]*&& //')
  echo "$CMD" >> "$R/readme.log"
  timeout 400 bash -c "$CMD" >> "$R/readme.log" 2>&1; step "readme rc=$?"
  python3 -m jax_moelora info >> "$R/readme.log" 2>&1
fi
if has cmdbuf; then  # the same folds with XLA's command buffers forced around custom calls
  CB="--models qwen --projs gate --tokens 1,64 --ranks 16 --adapters 4 --methods fast --no-check --no-plot"
  CBF=${CMDBUF_FLAGS:---xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1}
  step cmdbuf; timeout 100 python3 -m jax_moelora bench $CB --out "$R/cb0" > "$R/cmdbuf.log" 2>&1
  XLA_FLAGS="$CBF" timeout 100 python3 -m jax_moelora bench $CB --out "$R/cb1" >> "$R/cmdbuf.log" 2>&1
  XLA_FLAGS="$CBF" timeout 90 python3 -m jax_moelora demo --timing --repeats 10 > "$R/timing_cmdbuf.log" 2>&1
  step "cmdbuf rc=$?"
fi
if has bench; then
  step bench; timeout "${BENCH_S:-240}" python3 -m jax_moelora bench ${BENCH:---quick --methods fast,einsum} --out "$R/bench" > "$R/bench.log" 2>&1; step "bench rc=$?"
fi
if has bench2 && [ -n "${BENCH2:-}" ]; then
  step bench2; timeout "${BENCH2_S:-200}" python3 -m jax_moelora bench $BENCH2 --out "$R/bench2" > "$R/bench2.log" 2>&1; step "bench2 rc=$?"
fi
if has gemm; then
  step gemm; timeout "${GEMM_S:-240}" python3 -m jax_moelora bench --gemm ${GEMM:---models qwen} --out "$R/gemm" > "$R/gemm.log" 2>&1; step "gemm rc=$?"
fi
if has train; then
  step train; timeout "${TRAIN_S:-240}" python3 -m jax_moelora bench --train ${TRAIN:---quick} --out "$R/train" > "$R/train.log" 2>&1; step "train rc=$?"
fi
if has peer; then
  step peer; timeout "${PEER_S:-150}" python3 scripts/peft_train_peer.py ${PEER:---models qwen --tokens 512,4096 --rank 16} \
    --json "$R/peer.json" > "$R/peer.log" 2>&1; step "peer rc=$?"
fi
if has timing; then
  step timing; timeout 90 python3 -m jax_moelora demo --timing --repeats 10 ${TIMING:-} --json "$R/timing.json" > "$R/timing.log" 2>&1; step "timing rc=$?"
  if [ "${PREFILL_S:-150}" -gt 0 ]; then
    step "timing prefill"; timeout "${PREFILL_S:-150}" python3 -m jax_moelora demo --timing --prefill ${PREFILL:-} \
      --json "$R/timing_prefill.json" > "$R/timing_prefill.log" 2>&1; step "timing prefill rc=$?"
  fi
fi
if has suite; then
  step suite; timeout ${SUITE_S:-300} python3 -m pytest -q -p no:cacheprovider -n 8 -rf ${TESTS:-} > "$R/suite.log" 2>&1; step "suite rc=$?"
fi
if has soak; then
  step soak; timeout 200 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_soak.py > "$R/soak.log" 2>&1; step "soak rc=$?"
fi
if has fuzz; then
  step fuzz; MOELORA_FUZZ_EXAMPLES=${FUZZ:-100} timeout "${FUZZ_S:-300}" python3 -m pytest -q -p no:cacheprovider \
    -n "${FUZZ_N:-8}" tests/test_differential.py > "$R/fuzz.log" 2>&1; step "fuzz rc=$?"
fi
source "$(dirname "$0")/san_shard.sh"  # san_shard, san_errors, san_summary
if has sanall || has sanruns; then
  { compute-sanitizer --version; compute-sanitizer --help; } > "$R/sanall_tool.txt" 2>&1
fi
san() {  # san TOOL SECONDS: the tool over the sanitizer tests (SAN_FILES, SAN_K)
  step "$1"; san_shard "$R/$1.log" "$2" --tool "$1" --print-limit 20 -- -x -k "${SAN_K:-fast and not large}" \
    ${SAN_FILES:-tests/test_folds.py tests/test_stacked.py}; step "$1 done"
}
if has sanall; then  # every GPU-marked test under each tool, SANALL_N shards a tool (one process
  # each), every tool's shards at once (SANALL_S seconds in all).
  # XLA's command buffers are off, so every kernel is a plain launch the tool
  # sees. initcheck skips host-API copies: XLA's own device-to-device copies
  # move buffers it has not initialised (the fold handlers copy only their
  # base_out input); it needs every kernel tracked (no SANALL_KERNELS), or the
  # buffers XLA's kernels write look uninitialised. XLA compiles each program
  # as one module (compute-sanitizer 2025.3 crashes in programs compiled in
  # parallel pieces); should the tool still crash, san_shard logs the test
  # and goes on. SANALL_OPTS: more compute-sanitizer options. On a machine
  # of several GPUs (nvidia-h200-x2, -x4, -x8) the processes take the GPUs in
  # turn, so a call runs about 16 processes a GPU (one a CPU core).
  # The N processes of a tool take the tests from one queue (tests/conftest.py,
  # --claim): each runs the next test no other has claimed, so none idles
  # while another has a backlog. With SANALL_DONE_DIR, the queue runs the
  # tests those lists lack longest first by the <tool>_times.tsv there
  # (--order; unknown tests first); every test's seconds land in
  # sanall_times_<tool>.tsv (with a failure's message), from which the lists
  # of tests done are made (the tool's output can split a log's PASSED line).
  # Records show the device backtrace only. initcheck runs with XLA's
  # platform allocator, one cudaMalloc a buffer: under the default pool a
  # buffer reuses bytes an earlier test of the process wrote, and the tool
  # would see reads of memory nothing wrote in a process' first test only
  # (docs/design.md, "Sanitizers").
  tools=${SANALL_TOOLS:-memcheck racecheck initcheck synccheck}; n=${SANALL_N:-4}
  gpus=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU'); [ "$gpus" -ge 1 ] || gpus=1
  step "sanall: $tools, $n processes each, $gpus GPU(s)"
  rm -rf /tmp/moelora_claims; cat "${SANALL_DONE_DIR:-/nonexistent}"/*_times.tsv > /tmp/moelora_order.tsv 2> /dev/null
  j=0
  for tool in $tools; do
    opts=(--tool "$tool" --print-limit 20 --show-backtrace device ${SANALL_OPTS:-})
    if [ "$tool" = initcheck ]; then opts+=(--check-api-memory-access "${SANALL_API_CHECK:-no}")
    elif [ -n "${SANALL_KERNELS:-}" ]; then opts+=(--kernel-name "regex=$SANALL_KERNELS"); fi
    for i in ${SANALL_SHARDS:-$(seq 0 $((n - 1)))}; do
      ( export CUDA_VISIBLE_DEVICES=$(( j % gpus ))
        [ "$tool" = initcheck ] && export XLA_PYTHON_CLIENT_ALLOCATOR=platform
        SAN_DONE="${SANALL_DONE_DIR:+$SANALL_DONE_DIR/$tool.txt}" san_shard "$R/sanall_${tool}_$i.log" \
          "${SANALL_S:-480}" "${opts[@]}" -- --shard="$i/$n" --claim="/tmp/moelora_claims/$tool" \
          --order=/tmp/moelora_order.tsv --timings="$R/sanall_times_$tool.tsv" \
          ${SANALL_FILES:-} ${SANALL_K:+-k "$SANALL_K"} ) &
      j=$(( j + 1 ))
    done
  done
  wait
  for tool in $tools; do
    { [ -n "${SANALL_DONE_DIR:-}" ] && cat "$SANALL_DONE_DIR/$tool.txt" 2> /dev/null
      awk -F'\t' '$2 != "failed" {print $3}' "$R/sanall_times_$tool.tsv" 2> /dev/null
    } | sort -u > "$R/sanall_done_$tool.txt"
    step "sanall $tool: $(san_summary "$R"/sanall_"$tool"_*.log)"
    grep -h '^CRASHED ' "$R"/sanall_"$tool"_*.log >> "$R/phases.log"
  done
fi
if has sanruns; then  # the runs of SANRUNS, each in its own process, all at once
  step "sanruns: ${SANRUNS:-}"
  while IFS=$'\t' read -r name envs secs opts args; do
    case "$name" in ''|'#'*) continue;; esac
    case " $opts " in *" --print-limit "*) ;; *) opts="--print-limit 20 $opts";; esac
    case " $opts " in *" --show-backtrace "*) ;; *) opts="--show-backtrace device $opts";; esac
    ( set -f; if [ "$envs" != - ]; then export $envs; fi
      # shellcheck disable=SC2086  # opts and args are word lists
      san_shard "$R/sanrun_$name.log" "$secs" $opts -- \
        --timings="$R/sanrun_times_$name.tsv" $args ) &
  done < <(cat ${SANRUNS:-/dev/null})
  wait
  for log in "$R"/sanrun_*.log; do
    [ -f "$log" ] || continue
    step "$(basename "$log" .log): $(san_summary "$log")"
  done
fi
has memcheck && san memcheck 150
has racecheck && san racecheck 150
has initcheck && san initcheck 120
has synccheck && san synccheck 120
ncu_bench() {  # ncu_bench LOG BENCH_ARGS...: NCU_LAUNCHES launches of the kernels matching KERNELS
  # (BENCH_ARGS come last: they may override the defaults, e.g. --gemm --methods gemm@pingpong)
  local log=$1; shift
  timeout 120 ncu --clock-control none -k regex:"${KERNELS:-cells}" --launch-count "${NCU_LAUNCHES:-2}" \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats \
    python3 -m jax_moelora bench --methods fast --reps 1 --runs 1 --warmup 1 --no-check --no-plot \
    --bw-mib 16 --out /tmp/ncu_bench "$@" > "$log" 2>&1
}
if has ncu; then  # the kernels matching KERNELS in the NCU_ARGS bench, then in NCU2_ARGS when set
  step ncu; ncu_bench "$R/ncu.log" ${NCU_ARGS:---models qwen --projs gate --tokens 64 --ranks 16 --adapters 4}
  step "ncu rc=$?"
  if [ -n "${NCU2_ARGS:-}" ]; then ncu_bench "$R/ncu2.log" $NCU2_ARGS; step "ncu2 rc=$?"; fi
fi
if has scaling && [ "$(nvidia-smi -L | wc -l)" -gt 1 ]; then
  step scaling; CUDA_VISIBLE_DEVICES=0,1 timeout 90 python3 -m jax_moelora.tools.scaling --json "$R/scaling.json" > "$R/scaling.log" 2>&1; step "scaling rc=$?"
fi
step done
