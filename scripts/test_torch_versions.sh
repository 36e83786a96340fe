#!/usr/bin/env bash
# Run the test suite on other torch releases, each in a venv of its own (the project's venv is left alone):
#
#   scripts/test_torch_versions.sh 2.14.1 [2.11.0 ...]
#
# Venvs live in ${VENV_ROOT:-.venvs}/torch-<version> and are reused; each run's pytest log is
# <venv>/pytest.log. One line per version goes to the console and to outputs/torch_versions.txt.
# PYTEST_ARGS passes options to pytest (e.g. PYTEST_ARGS="-x -k parity"); FULL=1 runs the whole
# suite, the tests marked `full` included, as CI does (scripts/test_full.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 TORCH_VERSION [TORCH_VERSION ...]" >&2; exit 2; }
mkdir -p outputs
status=0
for version in "$@"; do
    venv="${VENV_ROOT:-.venvs}/torch-$version"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    # torch pinned to the release under test, so pip never picks another build.
    if ! "$venv/bin/pip" install -q "torch==$version" -e ".[test]" > "$venv/install.log" 2>&1; then
        echo "torch $version: install failed (see $venv/install.log)" | tee -a outputs/torch_versions.txt
        status=1
        continue
    fi
    start=$(date +%s)
    marks=()
    [ "${FULL:-0}" = 1 ] && marks=(-m "full or not full")
    # shellcheck disable=SC2086
    if "$venv/bin/python" -m pytest -q "${marks[@]}" ${PYTEST_ARGS:-} > "$venv/pytest.log" 2>&1; then result=pass; else result=fail; status=1; fi
    summary=$(tail -n 1 "$venv/pytest.log")
    suite=$([ "${FULL:-0}" = 1 ] && echo "whole suite" || echo "default suite")
    echo "torch $version: $result ($suite: $summary; $(( $(date +%s) - start )) s; $(date -u +%Y-%m-%d))" | tee -a outputs/torch_versions.txt
done
exit $status
