#!/usr/bin/env bash
# One call on the GPU machine (the device tool's `run`, kind nvidia-h200-x2 for the
# scaling step): build against that machine's jaxlib, then the whole test suite
# (GPU 0) next to the benchmark (GPU 1), compute-sanitizer on the folds, the
# decode-step timing, and 2-GPU scaling. Everything lands in $OUT/results.tgz.
#   run: bash scripts/device_check.sh            (timeout_s 600)
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=$OUT/r; mkdir -p "$R"
T0=$(date +%s); step() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$R/phases.log"; }
NGPU=$(nvidia-smi -L | wc -l)
step build; timeout 150 python3 -m pip install --no-build-isolation --no-deps . > "$R/build.log" 2>&1; step "build rc=$?"
python3 -m jax_moelora info >> "$R/build.log" 2>&1
(
  export CUDA_VISIBLE_DEVICES=0
  step suite; timeout 240 python3 -m pytest -q -p no:cacheprovider --maxfail=20 > "$R/suite.log" 2>&1; step "suite rc=$?"
  step memcheck; XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 compute-sanitizer --tool memcheck \
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_folds.py -k "matches_reference and not large" \
    > "$R/memcheck.log" 2>&1; step "memcheck rc=$?"
  step timing; timeout 90 python3 -m jax_moelora demo --timing --repeats 10 --json "$R/timing.json" > "$R/timing.log" 2>&1; step "timing rc=$?"
) &
(
  export CUDA_VISIBLE_DEVICES=$(( NGPU > 1 ? 1 : 0 ))
  step seed_vs_jnp; timeout 120 python3 -m jax_moelora bench --models qwen --projs gate --tokens 64,4096 --ranks 16 --adapters 1 --methods seed,jnp --no-plot --out "$R/seed_jnp" > "$R/seed_jnp.log" 2>&1; step "seed_vs_jnp rc=$?"
  step bench; timeout 300 python3 -m jax_moelora bench --ranks 16 --tokens 1,64,256,4096 --methods fast,einsum,ragged_dot --out "$R/bench" > "$R/bench.log" 2>&1; step "bench rc=$?"
) &
wait
if [ "$NGPU" -gt 1 ]; then
  step scaling; timeout 90 python3 -m jax_moelora.scaling --json "$R/scaling.json" > "$R/scaling.log" 2>&1; step "scaling rc=$?"
fi
tar czf "$OUT/results.tgz" -C "$OUT" r; step done
