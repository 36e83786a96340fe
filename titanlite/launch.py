"""The real trainer's command (torchrun for several ranks, the trainer itself for one process) and its
run from a script; read its metrics, draw figures: shared by the scripts (benchmark.py, loss_compare.py,
compare_torchtitan.py, memory.py, benchmark_muon.py) and the tests (tests/helpers.py's launch)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path


def trainer_command(nproc: int, args: list[str], max_restarts: int = 0, agent: bool = False, shown: str = "") -> list[str]:
    """`titanlite.train ARGS` on `nproc` ranks: under torchrun --standalone for several ranks, restarts
    or `agent` (`shown`: the ranks whose output it passes on, default all); one process otherwise runs
    the trainer itself, a world of 1 as under torchrun, without the agent (which imports torch a second
    time: ~3 s of CPU)."""
    cmd = [sys.executable, "-m", "titanlite.train", *args]
    if nproc > 1 or max_restarts or agent:
        agent_args = ["torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", f"--max_restarts={max_restarts}"]
        cmd[2:2] = [*agent_args, *([f"--local-ranks-filter={shown}"] if shown else []), "-m"]
    return cmd


def run_trainer(nproc: int, args: list[str], threads_per_rank: int | None = None, log: Path | None = None,
                timeout: float | None = None) -> None:
    """trainer_command(nproc, args): rank 0's output goes to `log` (or the console). Raises with the
    log's tail if the run fails or outlasts `timeout` seconds (then torchrun and its ranks are stopped)."""
    env = dict(os.environ)
    if threads_per_rank:
        env["OMP_NUM_THREADS"] = str(threads_per_rank)
    cmd = trainer_command(nproc, args, shown="0")
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") if log is not None else contextlib.nullcontext() as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()  # torchrun stops its workers on SIGTERM
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            returncode = f"stopped after {timeout:.0f} s"
    if returncode != 0:
        tail = log.read_text()[-3000:] if log else ""
        raise RuntimeError(f"trainer failed (exit {returncode}): {' '.join(cmd)}\n{tail}")


def read_metrics(folder: Path) -> list[dict]:
    """The training rows (those with a loss) of a run's metrics.jsonl."""
    rows = [json.loads(line) for line in open(Path(folder) / "metrics.jsonl")]
    return [r for r in rows if "loss" in r]


def curve_difference(curve: list[float], baseline: list[float]) -> float:
    """Largest |curve - baseline| over the steps; inf when the curves differ in length or hold a
    NaN or an infinity, so nothing slips through a `difference <= tolerance` check."""
    if len(curve) != len(baseline) or not curve:
        return math.inf
    differences = [abs(a - b) for a, b in zip(curve, baseline)]
    return max(d if math.isfinite(d) else math.inf for d in differences)


def pyplot():
    """matplotlib's pyplot without a display, or None (with a note) when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: no plot written; pip install matplotlib (or titanlite[plots]) to get one", flush=True)
        return None
    return plt
