#!/usr/bin/env bash
# The prepared GPU measurement, for a session that is lent an H200 (the device tool):
#   here:  echo /.whl/ >> .git/info/exclude
#          python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#              --platform manylinux2014_x86_64 -d .whl torchdata==0.11.0
#   there: run(command="bash scripts/gpu_benchmark.sh", carry=[".whl"], timeout_s=540)
# Runs scripts/benchmark.py's gpu preset (Llama 3 8B shape, 8 blocks, seq 8192: bf16, compile,
# float8 tensorwise/rowwise, AC modes) and leaves results.jsonl/csv, the plot and the logs in $OUT.
set -euo pipefail
if [ -d .whl ]; then  # the GPU image has torch but not torchdata
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-outputs}"
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$out/gpu.txt"
python3 scripts/benchmark.py --preset gpu --steps 15 --warmup 5 --out "$out/bench" 2>&1 | tee "$out/benchmark.log"
cp "$out"/bench/results.* "$out"/bench/results_gpu.png "$out"/ 2>/dev/null || true
