#!/usr/bin/env bash
# One call on the GPU machine (the device tool's `run`, kind nvidia-h200, carry [".whl"]):
# install the CUTLASS headers from the nvidia-cutlass wheel in .whl/ (the machine
# has no network: `pip download --no-deps "nvidia-cutlass==4.2.*" -d .whl` here first),
# build, run expert_matmul's GPU tests and the expert GEMM benchmark. Logs and the
# bench rows land in $OUT.
#   run: bash scripts/expert_matmul_check.sh          (timeout_s 600)
#   env: BENCH="<bench --gemm args>" (default "--models qwen": gate_up and down, T 64..16384;
#        run again with BENCH="--models mixtral" and "--models deepseek" to fit the 600 s limit)
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
O=${OUT:-/tmp/expert_matmul_check}; mkdir -p "$O"
T0=$(date +%s)
step() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$O/phases.log"; }
step build
python3 -m pip install --no-deps .whl/nvidia_cutlass-*.whl > "$O/build.log" 2>&1
timeout 300 python3 -m pip install --no-build-isolation --no-deps -v . >> "$O/build.log" 2>&1
step "build rc=$?"
grep -E "expert_matmul|ptxas info.*registers|spill" "$O/build.log" | head -20 >> "$O/phases.log"
python3 -m jax_moelora info >> "$O/phases.log" 2>&1
step tests
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_expert_matmul.py -rf \
  > "$O/tests.log" 2>&1
step "tests rc=$?"
step bench
timeout 240 python3 -m jax_moelora bench --gemm ${BENCH:---models qwen} --out "$O/bench_gemm" \
  > "$O/bench.log" 2>&1
step "bench rc=$?"
tail -45 "$O/bench.log" >> "$O/phases.log"
