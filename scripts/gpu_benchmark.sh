#!/usr/bin/env bash
# The GPU measurement, on a machine with one GPU and the torch it has:
#   bash scripts/gpu_benchmark.sh [OUT_FOLDER]      (default: outputs/gpu_benchmark)
# Runs scripts/benchmark.py's gpu preset (Llama 3 8B shape, 8 blocks, seq 8192: bf16, compile,
# float8 tensorwise/rowwise, AC modes; MoE, DeepSeek-V3, Llama 4, gpt-oss rows) after scripts/gpu_moe_check.py,
# and leaves results.jsonl/csv, the plot, the MoE check, the GPU's name,
# driver and torch version, and the log in OUT_FOLDER. Where the machine's Python lacks a package
# titanlite needs (torchdata, say) and has no network, put its wheels in .whl/: they are installed
# into /tmp/site first.
set -euo pipefail
if [ -d .whl ]; then  # the GPU image has torch but not torchdata
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${1:-${OUT:-outputs/gpu_benchmark}}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$out/gpu.txt"
python3 scripts/gpu_moe_check.py 2>&1 | tee "$out/moe_check.log" || true  # MoE numerics on this GPU
# ONLY: names of the preset's rows to run (all by default); STEPS, WARMUP: per row.
python3 scripts/benchmark.py --preset gpu --steps "${STEPS:-15}" --warmup "${WARMUP:-5}" ${ONLY:+--only $ONLY} \
    --out "$out/bench" 2>&1 | tee "$out/benchmark.log"
cp "$out"/bench/results.* "$out"/bench/results_gpu.png "$out"/ 2>/dev/null || true
