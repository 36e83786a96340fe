"""The health checks' cost, and their false alarms (docs/benchmarks.md#health-checks).

    python scripts/benchmark_health.py [--steps 300]

The debug model and debugmoe (their configs at seq_len 128, one process) train `steps` steps twice:
with [health]'s defaults (spikes skipped, stragglers every 50 steps, the hang watchdog), and with every
check off. It reports the alarms the first run raised (no fault is injected: the goal is none), the
seconds spent inside the checks against the run's training time, and the two runs' times.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "outputs" / "benchmark_health"
MODELS = {"debug model": ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml")],
          "debugmoe": ["--job.config_file", str(REPO / "train_configs" / "debug_moe.toml")]}
OFF = ["--health.spike_policy", "off", "--health.straggler_interval", "0", "--health.hang_watchdog", "false"]
ALARM = re.compile(r"titanlite: step \d+: (spike|not finite|straggler)|ran past comm.train_timeout_seconds")


def timed_run(argv: list[str]) -> None:
    """In this process: titanlite.train.main with the checks' functions timed; prints their seconds."""
    import titanlite.train as train_module
    from titanlite import health

    spent = {"seconds": 0.0}

    def timing(fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent["seconds"] += time.perf_counter() - start
        return run

    health.SpikeGuard.skips = timing(health.SpikeGuard.skips)
    health.Stragglers.arrive = timing(health.Stragglers.arrive)
    health.Stragglers.check = timing(health.Stragglers.check)
    health.HangWatchdog.at = timing(health.HangWatchdog.at)
    train = train_module.train

    def train_and_report(trainer):
        start = time.perf_counter()
        train(trainer)
        print(f"CHECK_SECONDS {spent['seconds']:.4f} TRAIN_SECONDS {time.perf_counter() - start:.4f}", flush=True)

    train_module.train = train_and_report
    train_module.main(argv)


def run(name: str, model: list[str], steps: int, checks: bool) -> dict:
    folder = OUT / f"{name.replace(' ', '_')}_{'checks' if checks else 'off'}"
    argv = [*model, "--training.steps", str(steps), "--training.seq_len", "128", "--metrics.log_freq", "50",
            "--metrics.enable_tensorboard", "false", "--job.dump_folder", str(folder), "--debug.seed", "0",
            *([] if checks else OFF)]
    done = subprocess.run([sys.executable, __file__, "--inner", *argv], capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    found = re.search(r"CHECK_SECONDS ([\d.]+) TRAIN_SECONDS ([\d.]+)", done.stdout)
    alarms = sorted({m.group(0) for m in ALARM.finditer(done.stdout)})
    losses = [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    return {"check_s": float(found.group(1)), "train_s": float(found.group(2)), "alarms": alarms, "last_loss": losses[-1]}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--inner":
        timed_run(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    for name, model in MODELS.items():
        on, off = run(name, model, args.steps, True), run(name, model, args.steps, False)
        print(f"{name}, {args.steps} steps: alarms {on['alarms'] or 'none'}; inside the checks {on['check_s']:.3f} s of "
              f"{on['train_s']:.1f} s training ({100 * on['check_s'] / on['train_s']:.2f}%); with the checks off "
              f"{off['train_s']:.1f} s; last loss {on['last_loss']:.4f} (off: {off['last_loss']:.4f})", flush=True)


if __name__ == "__main__":
    main()
