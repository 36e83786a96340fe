#!/usr/bin/env bash
# The whole test suite, as CI runs it (.ci/run): the default (`python -m pytest -q`) plus the tests
# marked `full` (the extended parity matrix and the slowest end-to-end cases); 35-45 minutes on 2
# cores with AVX-512, about 80 without (docs/testing.md).
#   bash scripts/test_full.sh [pytest args]        PYTHON=... to pick the interpreter (default .venv/bin/python)
# Two test files at a time (pytest-xdist; a file's shared launches stay in one worker), in collection
# order, which puts the parity file first (tests/conftest.py): one at a time, the tests left ~40% of 2
# cores idle. Then the `serial` ones, which race processes, alone.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
status=0
run() {
    "$PYTHON" -m pytest -q "$@" || { code=$?; [ "$code" -eq 5 ] || status=$code; }  # 5: the selection left none
}
# One thread a process while two files run: torch's OpenMP threads spin-wait, and with 2 threads a
# process the single-process DeepSeek-V3 CLI test ran over 6x slower beside a parity launch.
OMP_NUM_THREADS=1 run -m "(full or not full) and not serial" -n 2 --dist loadfile --no-loadscope-reorder "$@"
run -m serial "$@"
exit "$status"
