#!/usr/bin/env bash
# One call on the GPU machine (the device tool's `run`, kind nvidia-h200-x2):
# build against that machine's jaxlib, then the whole test suite, memcheck and
# racecheck and the decode-step timing on GPU 0, next to seed-vs-jnp, the
# benchmark and ncu on GPU 1. Everything lands in $OUT/results.tgz, also when a
# step overruns (the steps get BUDGET seconds, default 540).
#   run: bash scripts/device_check.sh                 (timeout_s 600)
#   env: BENCH="<bench args>"  BENCH2="<a second bench>"  SCALING=1  NCU=0  KERNELS=<regex>  NCU_TOKENS=<T>
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=$OUT/r; mkdir -p "$R"
if [ "${1:-}" != steps ]; then
  T0=$(date +%s) timeout -k 5 "${BUDGET:-560}" bash "$0" steps
  echo "steps rc=$?" >> "$R/phases.log"
  tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"
  exit 0
fi
step() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$R/phases.log"; }
NGPU=$(nvidia-smi -L | wc -l)
nvidia-smi > "$R/nvidia-smi.txt" 2>&1
step build; timeout 150 python3 -m pip install --no-build-isolation --no-deps . > "$R/build.log" 2>&1; step "build rc=$?"
python3 -m jax_moelora info >> "$R/build.log" 2>&1
(
  export CUDA_VISIBLE_DEVICES=0
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  step suite; timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 -rf > "$R/suite.log" 2>&1; step "suite rc=$?"
  step memcheck; timeout 100 compute-sanitizer --tool memcheck \
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_folds.py \
    -k "(matches_reference or windows or out_of_range) and not large" \
    > "$R/memcheck.log" 2>&1; step "memcheck rc=$?"
  step racecheck; timeout 90 compute-sanitizer --tool racecheck \
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_folds.py \
    -k "fold_matches_reference and fast and bf16 and L4 and map and not no_map" \
    > "$R/racecheck.log" 2>&1; step "racecheck rc=$?"
  step timing; timeout 60 python3 -m jax_moelora demo --timing --repeats 10 --json "$R/timing.json" > "$R/timing.log" 2>&1; step "timing rc=$?"
) &
(
  export CUDA_VISIBLE_DEVICES=$(( NGPU > 1 ? 1 : 0 ))
  step seed_vs_jnp; timeout 100 python3 -m jax_moelora bench --models qwen --projs gate --tokens 64,4096 --ranks 16 --adapters 1 --methods seed,jnp --no-plot --out "$R/seed_jnp" > "$R/seed_jnp.log" 2>&1; step "seed_vs_jnp rc=$?"
  step bench; timeout 200 python3 -m jax_moelora bench ${BENCH:---quick --methods fast,einsum} --out "$R/bench" > "$R/bench.log" 2>&1; step "bench rc=$?"
  if [ -n "${BENCH2:-}" ]; then
    step bench2; timeout 170 python3 -m jax_moelora bench $BENCH2 --out "$R/bench2" > "$R/bench2.log" 2>&1; step "bench2 rc=$?"
  fi
  step bench_r64; timeout 40 python3 -m jax_moelora bench --models qwen,mixtral --ranks 64 --adapters 1 --tokens 64,256 --methods fast --no-plot --out "$R/r64" > "$R/bench_r64.log" 2>&1; step "bench_r64 rc=$?"
  if [ "${NCU:-1}" = 1 ]; then  # one launch of each fast kernel (KERNELS: a name regex)
    step ncu; timeout 50 ncu --clock-control none -k regex:"${KERNELS:-rows|cells}" --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section SchedulerStats \
      python3 -m jax_moelora bench --models qwen --projs gate --tokens ${NCU_TOKENS:-4096} --ranks 16 --adapters 1 \
      --methods fast --reps 1 --runs 1 --warmup 1 --no-check --no-plot --bw-mib 16 --out /tmp/ncu_bench \
      > "$R/ncu.log" 2>&1; step "ncu rc=$?"
  fi
) &
wait
if [ "${SCALING:-0}" = 1 ] && [ "$NGPU" -gt 1 ]; then
  step scaling; timeout 90 python3 -m jax_moelora.scaling --json "$R/scaling.json" > "$R/scaling.log" 2>&1; step "scaling rc=$?"
fi
step done
