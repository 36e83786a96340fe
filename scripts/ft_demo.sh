#!/usr/bin/env bash
# Fault-tolerant training on one machine: torchft's Lighthouse and N replica groups, each its own
# run_train.sh (torchrun) with NGPU ranks; optionally one group killed and started again.
#
#   bash scripts/ft_demo.sh                                  # 2 groups x 2 ranks, the debug model, 60 steps
#   REPLICA_GROUPS=3 KILL_AFTER=20 bash scripts/ft_demo.sh --training.steps 200
#
# Env: REPLICA_GROUPS (default 2), NGPU (ranks per group, default 2), CONFIG_FILE, KILL_AFTER (seconds
# after the start at which the last group gets SIGKILL and is started again; unset: no kill),
# LIGHTHOUSE_PORT (default 29510), OUT (default outputs/ft_demo: each group's dump folder and log).
# Extra arguments are config overrides for every group.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
REPLICA_GROUPS=${REPLICA_GROUPS:-2}
OUT=${OUT:-outputs/ft_demo}
LIGHTHOUSE_PORT=${LIGHTHOUSE_PORT:-29510}
export NGPU=${NGPU:-2} TORCHFT_LIGHTHOUSE=http://localhost:$LIGHTHOUSE_PORT
mkdir -p "$OUT"

"$PYTHON" scripts/lighthouse.py \
    --min_replicas 1 --bind "[::]:$LIGHTHOUSE_PORT" --join_timeout_ms 1000 --heartbeat_timeout_ms 2000 > "$OUT/lighthouse.log" 2>&1 &
LIGHTHOUSE=$!
GROUP_PIDS=()
trap 'kill ${GROUP_PIDS[*]} $LIGHTHOUSE 2>/dev/null || true' EXIT

start_group() {  # replica id, log name; in a session of its own so that a kill takes all its ranks
    setsid ./run_train.sh --fault_tolerance.enable --fault_tolerance.group_size "$REPLICA_GROUPS" \
        --fault_tolerance.replica_id "$1" --debug.seed "${SEED:-0}" --training.steps 60 \
        --job.dump_folder "$OUT/$2" "${@:3}" > "$OUT/$2.log" 2>&1 &
    GROUP_PIDS[$1]=$!
}

for ((i = 0; i < REPLICA_GROUPS; i++)); do start_group "$i" "group$i" "$@"; done
echo "Lighthouse on $TORCHFT_LIGHTHOUSE; $REPLICA_GROUPS groups of $NGPU ranks; logs in $OUT"
if [ -n "${KILL_AFTER:-}" ]; then
    sleep "$KILL_AFTER"
    LAST=$((REPLICA_GROUPS - 1))
    echo "SIGKILL to group $LAST; starting it again (it heals from a live group)"
    kill -9 -- "-${GROUP_PIDS[$LAST]}" 2>/dev/null || true
    start_group "$LAST" "group${LAST}_again" "$@"
fi
for pid in "${GROUP_PIDS[@]}"; do wait "$pid"; done
echo "done: each group's metrics in $OUT/group*/metrics.jsonl (ft_replicas: the groups in each step)"
