#!/usr/bin/env bash
# Run TorchTitan's own Llama 3 configs, unchanged, with titanlite (TorchTitan v0.2.2 schema).
#
#   scripts/run_torchtitan_configs.sh /path/to/torchtitan [OUT_DIR]
#
# Only what points at TorchTitan's own assets is overridden: training.dataset (c4_test, a file of its
# repository; c4 needs the hub) and model.hf_assets_path (its tokenizer folders). debug_model.toml
# trains on 2 CPU ranks (and again with float8, emulated); the 8B, 70B and 405B configs pass a
# fake_backend dry run for the GPU counts their headers name (64, 64, 128).
set -euo pipefail
TORCHTITAN=${1:?usage: $0 /path/to/torchtitan [OUT_DIR]}
OUT=${2:-outputs/torchtitan_configs}
CONFIGS="$TORCHTITAN/torchtitan/models/llama3/train_configs"
cd "$(dirname "$0")/.."
export PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
ASSETS=(--model.hf_assets_path shakespeare-bpe8k)
results=()

attempt() {  # attempt NAME ENV... -- ARGS...: run run_train.sh, keep its log, note pass/fail
    local name=$1; shift
    local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
    mkdir -p "$OUT"
    echo "== $name" >&2
    if env "${envs[@]}" ./run_train.sh "$@" > "$OUT/$name.log" 2>&1; then
        results+=("$name: pass ($(grep -oE 'done: .*tokens/s per device|dry run OK[^;]*' "$OUT/$name.log" | tail -1))")
    else
        results+=("$name: FAIL (see $OUT/$name.log)")
    fi
}

DEBUG=(--training.dataset shakespeare "${ASSETS[@]}")
attempt debug_model CONFIG_FILE="$CONFIGS/debug_model.toml" NGPU=2 -- "${DEBUG[@]}" --job.dump_folder "$OUT/debug_model"
attempt debug_model_float8 CONFIG_FILE="$CONFIGS/debug_model.toml" NGPU=2 -- "${DEBUG[@]}" \
    --model.converters float8 --quantize.linear.float8.emulate true --job.dump_folder "$OUT/debug_model_float8"
for spec in llama3_8b:64 llama3_70b:64 llama3_405b:128; do
    attempt "${spec%:*}_dry_run" CONFIG_FILE="$CONFIGS/${spec%:*}.toml" NGPU="${spec#*:}" COMM_MODE=fake_backend -- "${ASSETS[@]}"
done
printf '%s\n' "${results[@]}"
! printf '%s\n' "${results[@]}" | grep -q FAIL
