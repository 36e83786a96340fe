#!/usr/bin/env bash
# The whole test suite, as CI runs it (.ci/run): the default (`python -m pytest -q`) plus the tests
# marked `full` (the extended parity matrix and the slowest end-to-end cases); about 40 minutes on 2 cores (docs/testing.md).
#   bash scripts/test_full.sh [pytest args]        PYTHON=... to pick the interpreter (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" -m pytest -q -m "full or not full" "$@"
