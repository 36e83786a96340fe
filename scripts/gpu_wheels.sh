#!/usr/bin/env bash
# Wheels for a GPU machine that has torch and no network (scripts/gpu_benchmark.sh installs them from
# .whl/): torchdata at this checkout's version, for CPython 3.12 on x86-64 (the GPU machines' Python),
# and any other package named on the command line (NAME or NAME==VERSION), without their dependencies.
#   bash scripts/gpu_wheels.sh [NAME ...]       e.g. bash scripts/gpu_wheels.sh datasets==4.0.0
set -euo pipefail
PYTHON=${PYTHON:-.venv/bin/python}
version=$("$PYTHON" -c "import importlib.metadata as m; print(m.version('torchdata'))")
mkdir -p .whl
platforms=()
for n in 28 27 17; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d .whl "torchdata==$version" "$@"
ls -l .whl
