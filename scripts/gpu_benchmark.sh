#!/usr/bin/env bash
# The GPU measurement, on a machine with one GPU and the torch it has:
#   bash scripts/gpu_benchmark.sh [OUT_FOLDER]      (default: outputs/gpu_benchmark)
# Runs scripts/gpu_moe_check.py, then scripts/benchmark.py's gpu preset (compiled: Llama 3 8B's blocks
# in bf16 and float8 tensorwise/rowwise; Qwen3-30B-A3B's in bf16 and with float8 grouped GEMMs;
# DeepSeek-V2-Lite's; gpt-oss-20b's), each run's last step profiled, within BUDGET_S seconds (default
# 420: with the MoE check, about 8 minutes on one H100 or H200). It leaves results.jsonl/csv, the plot,
# each row's top_kernels.txt (its 15 costliest kernels), the MoE check, the GPU's name, driver and
# torch version, and the log in OUT_FOLDER. Where the machine's Python lacks a package titanlite
# needs (torchdata, datasets) and has no network, put their wheels in .whl/ first
# (bash scripts/gpu_wheels.sh): they are installed into /tmp/site.
# DRY_RUN=1 checks every row's command as a fake-backend dry run instead, on any machine (a test does).
set -euo pipefail
if [ -d .whl ]; then  # the GPU image has torch but not torchdata or datasets
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
out="${1:-${OUT:-outputs/gpu_benchmark}}"
mkdir -p "$out"
if [ -n "${DRY_RUN:-}" ]; then
    "$PYTHON" scripts/benchmark.py --preset gpu --dry-run --profile --steps "${STEPS:-10}" --warmup "${WARMUP:-4}" \
        ${ONLY:+--only $ONLY} --out "$out/bench" 2>&1 | tee "$out/benchmark.log"
    exit "${PIPESTATUS[0]}"
fi
{ nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv || echo "no nvidia-smi"; } | tee "$out/gpu.txt"
"$PYTHON" -c "import torch; print('torch', torch.__version__)" | tee -a "$out/gpu.txt"
"$PYTHON" scripts/gpu_moe_check.py 2>&1 | tee "$out/moe_check.log" || true  # MoE numerics on this GPU
# ONLY: names of the preset's rows to run (all by default); STEPS, WARMUP: per row. A failed row is
# reported and the next one runs; the files are copied out whatever happened.
set +e
"$PYTHON" scripts/benchmark.py --preset gpu --profile --budget-s "${BUDGET_S:-420}" --steps "${STEPS:-10}" \
    --warmup "${WARMUP:-4}" ${ONLY:+--only $ONLY} --out "$out/bench" 2>&1 | tee "$out/benchmark.log"
status=${PIPESTATUS[0]}
set -e
cp "$out"/bench/results.* "$out"/bench/results_gpu.png "$out"/ 2>/dev/null || true
for table in "$out"/bench/gpu/*/top_kernels.txt; do
    if [ -f "$table" ]; then cp "$table" "$out/top_kernels_$(basename "$(dirname "$table")").txt"; fi
done
exit "$status"
