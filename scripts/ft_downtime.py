"""Downtime of a failure: torchft replica groups against a torchrun restart from a checkpoint.

    python scripts/ft_downtime.py                       # 3 repeats of each, the debug model
    python scripts/ft_downtime.py --repeats 1 --steps 60 --kill-at 25 -- --training.seq_len 256

Both runs train the same model on the same machine with the same ranks, and one rank is SIGKILLed
once the run has logged step --kill-at:
- fault tolerance: 2 replica groups of --ranks ranks under a Lighthouse; the killed group's
  torchrun goes, and is started again at once. Reported: the survivor's stall (seconds stalled
  across the failure, from its `ft_stalled_seconds`), its steps lost (steps it logged twice or
  never, 0 is the goal) and redone (torchft's `ft_steps_redone`), and the time from the kill until
  the restarted group logs a step it trained with the survivor;
- torchrun restart: one job of 2 x --ranks ranks (HSDP: the same 2 replicas), a checkpoint every
  --interval steps and MAX_RESTARTS=1; every rank restarts and resumes the last checkpoint.
  Reported: the steps lost (trained again) and the time from the kill to the next new step.
Each figure is the median of --repeats runs; every run's figures go to OUT/downtime.jsonl and the
table to stdout (a markdown table for docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def rows(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")) if "loss" in r]


class Watch:
    """The wall time at which each logged row of a run folder first appeared (polled every 20 ms)."""

    def __init__(self, folder: Path):
        self.folder, self.seen = folder, []  # (wall time, row)

    def poll(self) -> list[dict]:
        new = rows(self.folder)[len(self.seen):]
        now = time.time()
        self.seen += [(now, row) for row in new]
        return [row for _, row in self.seen]


def launch(args: list[str], folder: Path, ranks: int, env: dict, **launcher) -> subprocess.Popen:
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           *[f"--{k.replace('_', '-')}={v}" for k, v in launcher.items()], "-m", "titanlite.train",
           *args, "--job.dump_folder", str(folder)]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(folder / "out.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_until(condition, procs: list[subprocess.Popen], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            raise SystemExit(f"ft_downtime: gave up waiting for {what}")
        time.sleep(0.02)


def fault_tolerance_run(base: list[str], out: Path, ranks: int, kill_at: int, steps: int) -> dict:
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=2000)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHFT_LIGHTHOUSE": lighthouse.address()}
    ft = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2", "--debug.seed", "0"]
    try:
        watches = [Watch(out / f"group{i}") for i in range(2)]
        groups = [launch(base + ft + ["--fault_tolerance.replica_id", str(i)], out / f"group{i}", ranks, env) for i in range(2)]
        wait_until(lambda: all(any(r["ft_replicas"] == 2 for r in w.poll()) for w in watches), groups, 600, "both groups")
        wait_until(lambda: watches[1].poll()[-1]["step"] >= kill_at, groups, 600, f"step {kill_at}")
        os.killpg(groups[1].pid, signal.SIGKILL)
        killed = time.time()
        groups[1].wait()
        before = watches[0].poll()[-1]
        back = Watch(out / "group1_again")
        groups[1] = launch(base + ft + ["--fault_tolerance.replica_id", "1"], out / "group1_again", ranks, env)
        wait_until(lambda: any(r["ft_participating"] == 1 for r in back.poll()), groups, 600, "the restarted group")
        back_at = next(t for t, r in back.seen if r["ft_participating"] == 1)
        for group in groups:
            group.wait(timeout=600)
        survivor = watches[0].poll()
    finally:
        lighthouse.shutdown()
    logged = [r["step"] for r in survivor]
    return {
        "stall_s": survivor[-1]["ft_stalled_seconds"] - before["ft_stalled_seconds"],
        "steps_lost": len(set(range(1, steps + 1)) ^ set(logged)) + len(logged) - len(set(logged)),
        "steps_redone": survivor[-1]["ft_steps_redone"] - before["ft_steps_redone"],
        "back_after_s": back_at - killed,
        "goodput": survivor[-1]["ft_goodput"],
    }


def torchrun_restart_run(base: list[str], out: Path, ranks: int, kill_at: int, interval: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = base + ["--parallelism.data_parallel_replicate_degree", "2", "--checkpoint.enable",
                   "--checkpoint.interval", str(interval), "--debug.seed", "0"]
    watch = Watch(out)
    job = launch(args, out, 2 * ranks, env, max_restarts=1)
    wait_until(lambda: (watch.poll() or [{"step": 0}])[-1]["step"] >= kill_at, [job], 600, f"step {kill_at}")
    reached = watch.poll()[-1]["step"]
    workers = subprocess.run(["pgrep", "-f", "-P", str(job.pid), "titanlite.train"], capture_output=True, text=True).stdout.split()
    os.kill(int(workers[-1]), signal.SIGKILL)
    killed = time.time()
    seen = len(watch.poll())
    wait_until(lambda: len(watch.poll()) > seen, [job], 600, "the restarted job")
    next_at, resumed = watch.seen[seen]
    job.wait(timeout=600)
    return {"steps_lost": reached - resumed["step"] + 1, "next_step_after_s": next_at - killed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-at", type=int, default=25)
    parser.add_argument("--interval", type=int, default=10, help="the torchrun job's checkpoint interval")
    parser.add_argument("--ranks", type=int, default=1, help="ranks per replica group (FSDP inside)")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "ft_downtime")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run (after --)")
    a = parser.parse_args()
    base = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), "--training.steps", str(a.steps),
            "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--validation.enable", "false", *a.overrides]
    results = {"fault tolerance": [], "torchrun restart": []}
    a.out.mkdir(parents=True, exist_ok=True)
    for i in range(a.repeats):
        for name, run in [("fault tolerance", lambda o: fault_tolerance_run(base, o, a.ranks, a.kill_at, a.steps)),
                          ("torchrun restart", lambda o: torchrun_restart_run(base, o, a.ranks, a.kill_at, a.interval))]:
            figures = run(a.out / f"{name.split()[0]}{i}")
            results[name].append(figures)
            with open(a.out / "downtime.jsonl", "a") as f:
                f.write(json.dumps({"run": name, "repeat": i, **figures}) + "\n")
            print(f"{name} #{i + 1}: {figures}", flush=True)
    median = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in results.items()}
    ft, restart = median["fault tolerance"], median["torchrun restart"]
    print(f"\nmedian of {a.repeats}; kill at step {a.kill_at} of {a.steps}; 2 x {a.ranks} rank(s); the Lighthouse drops a "
          "silent group after 2 s\n")
    print("| failure handled by | progress lost (steps) | steps computed again | training paused (s) | failed part back after (s) |")
    print("|---|---|---|---|---|")
    print(f"| torchft replica groups | {ft['steps_lost']:.0f} | {ft['steps_redone']:.0f} | {ft['stall_s']:.2f} (the survivor) | "
          f"{ft['back_after_s']:.1f} |")
    print(f"| torchrun restart, checkpoint every {a.interval} steps | {restart['steps_lost']:.0f} | {restart['steps_lost']:.0f} | "
          f"{restart['next_step_after_s']:.1f} (every rank) | {restart['next_step_after_s']:.1f} |")

if __name__ == "__main__":
    main()
