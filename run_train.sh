#!/usr/bin/env bash
# Launch titanlite with torchrun.
#
#   ./run_train.sh                                   # default config; 1 process on CPU, all GPUs on CUDA
#   CONFIG_FILE=train_configs/llama3_8b.toml NGPU=8 ./run_train.sh --training.steps 100
#   NNODES=2 NODE_RANK=0 RDZV_ENDPOINT=host0:29500 ./run_train.sh      # on each node (c10d rendezvous)
#   COMM_MODE=fake_backend NGPU=512 ./run_train.sh   # dry run: check a 512-rank layout in one process
#
# Env: NGPU (processes per node; default: the GPU count, or 1 without GPUs), CONFIG_FILE, LOG_RANK
# (ranks whose output is shown, default 0), NNODES, NODE_RANK, RDZV_ENDPOINT, RDZV_ID, COMM_MODE,
# MAX_RESTARTS (torchrun restarts the job after a rank dies; with checkpoints on, it resumes by itself).
# Fault tolerance ([fault_tolerance] enable; each replica group is one run_train.sh): FT_LIGHTHOUSE=start
# runs torchft's Lighthouse here for every group (FT_MIN_REPLICAS, default 1; FT_LIGHTHOUSE_PORT, default
# 29510) until this group ends; the other groups join it with TORCHFT_LIGHTHOUSE=http://this-host:port.
# The job then depends on this group: for real runs start torchft_lighthouse on a host of its own.
# Extra arguments are config overrides (--section.key value) passed to the trainer.
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
CONFIG_FILE=${CONFIG_FILE:-train_configs/debug_model.toml}
if [ -z "${NGPU:-}" ]; then
    NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    [ "$NGPU" -ge 1 ] 2>/dev/null || NGPU=1
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
LOG_RANK=${LOG_RANK:-0}
COMM_MODE=${COMM_MODE:-}
# Rank 0 hosts a fresh store for each attempt of the job, instead of every attempt sharing the agent's:
# a node that replaces a dead one can then rejoin (it would wait for addresses nobody republishes).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
# CPU runs: one thread per process unless the user says otherwise (ranks share the cores).
if [ "$NGPU" -gt 1 ]; then export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}; fi

if [ "${FT_LIGHTHOUSE:-}" = "start" ]; then
    FT_LIGHTHOUSE_PORT=${FT_LIGHTHOUSE_PORT:-29510}
    "$PYTHON" scripts/lighthouse.py \
        --min_replicas "${FT_MIN_REPLICAS:-1}" --bind "[::]:$FT_LIGHTHOUSE_PORT" &
    LIGHTHOUSE_PID=$!
    trap 'kill $LIGHTHOUSE_PID 2>/dev/null || true' EXIT
    export TORCHFT_LIGHTHOUSE=${TORCHFT_LIGHTHOUSE:-http://$(hostname):$FT_LIGHTHOUSE_PORT}
fi

# Check the config (and --help) before starting any process: bad input fails here in one line.
WORLD_SIZE=$((NGPU * NNODES)) "$PYTHON" -m titanlite.preflight --job.config_file "$CONFIG_FILE" "$@" ${COMM_MODE:+--comm.mode "$COMM_MODE"}
for arg in "$@"; do case "$arg" in -h|--help) exit 0 ;; esac; done

if [ "$COMM_MODE" = "fake_backend" ]; then  # a dry run in this one process, as TorchTitan's COMM_MODE
    WORLD_SIZE=$((NGPU * NNODES)) exec "$PYTHON" -m titanlite.train --job.config_file "$CONFIG_FILE" "$@" --comm.mode "$COMM_MODE"
fi

if [ "$NNODES" -gt 1 ]; then
    RENDEZVOUS=(--nnodes "$NNODES" --node_rank "$NODE_RANK" --rdzv_backend c10d
        --rdzv_endpoint "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port for multi-node runs}"
        --rdzv_id "${RDZV_ID:-titanlite}")
else
    RENDEZVOUS=(--standalone)
fi

# titanlite.torchrun is torchrun that shows a failed rank's one-line error instead of its traceback.
LAUNCH=("$PYTHON" -m titanlite.torchrun "${RENDEZVOUS[@]}" --nproc_per_node "$NGPU" --max-restarts "${MAX_RESTARTS:-0}"
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3
    -m titanlite.train --job.config_file "$CONFIG_FILE" "$@" ${COMM_MODE:+--comm.mode "$COMM_MODE"})
if [ -z "${LIGHTHOUSE_PID:-}" ]; then
    exec "${LAUNCH[@]}"
fi
# Not exec'd while a Lighthouse started here runs (the EXIT trap stops it when the group ends); a TERM
# or INT for this script goes on to torchrun, and the script waits for it to finish.
"${LAUNCH[@]}" &
GROUP_PID=$!
trap 'kill -TERM "$GROUP_PID" 2>/dev/null || true' TERM INT
set +e
while wait "$GROUP_PID"; STATUS=$?; kill -0 "$GROUP_PID" 2>/dev/null; do :; done
exit "$STATUS"
