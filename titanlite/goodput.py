"""Goodput over a whole job, across restarts, in the manner of Google's ML Goodput measurement:
the share of the wall time spent in steps whose update the final model keeps.

Rank 0 of each attempt appends to <dump_folder>/goodput.jsonl (a fresh job starts it anew):
- `start`: the process's start (wall clock), its start-up and checkpoint-load seconds, the step it
  resumed from;
- `progress` after each log step and checkpoint save, and `end` at the run's end: the attempt's
  running totals (steps and seconds in steps that updated the weights, steps skipped or redone and
  their seconds, waits for data, checkpoint saves, validation) and torchft's figures where FT is on.

`report` reads them back. Steps an attempt trained past the checkpoint the next attempt resumed from
were lost (and recomputed); the time from an attempt's last record to the next one's start was down
(the work after that record, the hang or crash, the restart). Time no total names is `other`
(logging, the loop's own work). `scripts/goodput.py` prints the report and plots it.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

TOTALS = ("steps", "step_s", "skipped_steps", "skipped_s", "data_s", "save_s", "validation_s")
# The report's parts of the wall time, in the order a person reads them.
PARTS = {
    "productive_s": "steps kept",
    "startup_s": "start-up",
    "load_s": "checkpoint load",
    "save_s": "checkpoint save",
    "lost_s": "steps lost and recomputed",
    "down_s": "down between attempts",
    "data_s": "stalled on data",
    "skipped_s": "steps skipped, redone or replayed",
    "validation_s": "validation",
    "other_s": "other",
}


IMPORTED = time.time()


def process_start() -> float:
    """This process's start (wall clock) from /proc on Linux, so that imports count as start-up (to the
    second: the boot time is whole seconds); elsewhere, when this module was imported."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return IMPORTED


class GoodputClock:
    """The running totals of this attempt, written by rank 0 (`writes`)."""

    def __init__(self, folder: Path, writes: bool, process_start: float):
        self.path, self.writes, self.process_start = Path(folder) / "goodput.jsonl", writes, process_start
        self.totals = dict.fromkeys(TOTALS, 0.0)

    def start(self, step: int, load_s: float, setup_end: float, fresh: bool) -> None:
        """`setup_end`: the wall time before the checkpoint load; `fresh`: a new job, not a restart or resume."""
        startup = setup_end - self.process_start
        if not fresh and self.writes and self.path.exists() and self.path.stat().st_size:
            with open(self.path, "rb+") as f:  # a line the last attempt's crash cut short stays apart from ours
                f.seek(-1, 2)
                if f.read(1) != b"\n":
                    f.write(b"\n")
        self.write({"event": "start", "step": step, "wall": self.process_start, "startup_s": startup, "load_s": load_s}, fresh)

    def restart(self, step: int, load_s: float) -> None:
        """A rollback to `step`'s checkpoint (`load_s` to load it): a new attempt from there, in this process."""
        self.totals = dict.fromkeys(TOTALS, 0.0)
        self.write({"event": "start", "step": step, "wall": time.time() - load_s, "startup_s": 0.0, "load_s": load_s})

    def step(self, seconds: float, data_s: float, kept: bool, replayed_s: float = 0.0) -> None:
        """A step of `seconds`, `replayed_s` of them in a replay on suspicion (counted with skipped steps)."""
        self.totals["data_s"] += data_s
        self.totals["steps" if kept else "skipped_steps"] += 1
        self.totals["step_s" if kept else "skipped_s"] += seconds - replayed_s
        self.totals["skipped_s"] += replayed_s

    def add(self, total: str, seconds: float) -> None:
        self.totals[total] += seconds

    def record(self, step: int, ft_figures: dict[str, float] | None = None, event: str = "progress") -> None:
        row = {"event": event, "step": step, "wall": time.time()} | self.totals
        if ft_figures:
            row |= {k: v for k, v in ft_figures.items() if k in ("ft_stalled_seconds", "ft_steps_redone", "ft_goodput")}
        self.write(row)

    def write(self, row: dict, fresh: bool = False) -> None:
        if self.writes:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "w" if fresh else "a") as f:
                f.write(json.dumps(row) + "\n")


def read(folder: Path) -> list[dict]:
    """goodput.jsonl's records; a last line cut short by a crash is left out."""
    rows = []
    for line in (Path(folder) / "goodput.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def attempts(rows: list[dict]) -> list[tuple[dict, list[dict]]]:
    """(start record, its progress and end records) per attempt."""
    out = []
    for row in rows:
        if row["event"] == "start":
            out.append((row, []))
        elif out:
            out[-1][1].append(row)
    return out


def report(rows: list[dict]) -> dict:
    """The job's wall time split into PARTS (seconds), goodput, steps kept (each step of the final
    model once) and lost, attempts, whether the last one ended, torchft's figures."""
    runs = attempts(rows)
    if not runs:
        raise ValueError("goodput.jsonl holds no start record")
    none = dict.fromkeys(TOTALS, 0.0)
    parts = dict.fromkeys(PARTS, 0.0)
    kept_steps, lost_steps = 0, 0
    # An attempt's step survives unless a later attempt resumed from a step before it.
    bounds = [min((later["step"] for later, _ in runs[i + 1:]), default=math.inf) for i in range(len(runs))]
    ends = [records[-1] if records else none | {"wall": start["wall"] + start["startup_s"] + start["load_s"]}
            for start, records in runs]
    for i, ((start, records), bound, last) in enumerate(zip(runs, bounds, ends)):
        kept = ([r for r in records if r["step"] <= bound] or [none])[-1]
        parts["startup_s"] += start["startup_s"]
        parts["load_s"] += start["load_s"]
        parts["productive_s"] += kept["step_s"]
        parts["lost_s"] += last["step_s"] - kept["step_s"]
        parts["down_s"] += runs[i + 1][0]["wall"] - last["wall"] if i + 1 < len(runs) else 0.0
        for total in ("save_s", "data_s", "skipped_s", "validation_s"):
            parts[total] += last[total]
        kept_steps += int(kept["steps"])
        lost_steps += int(last["steps"] - kept["steps"])
    last = ends[-1]
    wall = last["wall"] - runs[0][0]["wall"]
    parts["other_s"] = wall - sum(parts.values())
    return {"wall_s": wall, "goodput": parts["productive_s"] / wall if wall > 0 else 0.0, "parts": parts,
            "attempts": len(runs), "kept_steps": kept_steps, "lost_steps": lost_steps, "ended": last.get("event") == "end"} | {
        k: v for k, v in last.items() if k.startswith("ft_")}


def describe(summary: dict) -> str:
    """One line: goodput, wall time, attempts and each part's share."""
    wall = summary["wall_s"] or 1.0
    shares = ", ".join(f"{PARTS[k]} {100 * v / wall:.1f}%" for k, v in summary["parts"].items() if k != "productive_s" and abs(v) >= 0.0005 * wall)
    ft = (f"; torchft: {summary['ft_stalled_seconds']:.1f}s stalled, {summary['ft_steps_redone']:.0f} steps redone"
          if "ft_stalled_seconds" in summary else "")
    return (f"goodput {100 * summary['goodput']:.1f}% of {summary['wall_s']:.1f}s over {summary['attempts']} attempt(s), "
            f"{summary['lost_steps']} step(s) lost: {shares}{ft}")
