"""Goodput of a job across its restarts, from <dump_folder>/goodput.jsonl (titanlite/goodput.py).

    python scripts/goodput.py DUMP_FOLDER                  # the report, and DUMP_FOLDER/goodput.png
    python scripts/goodput.py DUMP_FOLDER --json           # the report as JSON

Goodput is the share of the wall time (the first attempt's process start to the last record) spent
in steps the final model keeps. The rest is split into start-up, checkpoint load and save, steps
lost (trained past the checkpoint the next attempt resumed from), time down between attempts, waits
for data, steps skipped or redone, validation and other; torchft's own figures where FT is on. The
plot: the step each attempt reached over wall time (a fall is a restart's recomputation), and the
parts of the wall time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from titanlite.goodput import PARTS, attempts, describe, read, report  # noqa: E402
from titanlite.launch import pyplot  # noqa: E402


def table(summary: dict) -> str:
    wall = summary["wall_s"] or 1.0
    lines = ["| part | seconds | share |", "|---|---|---|"]
    lines += [f"| {PARTS[k]} | {v:.1f} | {100 * v / wall:.1f}% |" for k, v in summary["parts"].items()]
    return "\n".join(lines + [f"| wall time | {summary['wall_s']:.1f} | 100% |"])


def plot(rows: list[dict], summary: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (steps, parts) = plt.subplots(2, 1, figsize=(8, 6), gridspec_kw={"height_ratios": [3, 1]})
    origin = rows[0]["wall"]
    for i, (start, records) in enumerate(attempts(rows)):
        walls = [start["wall"]] + [r["wall"] for r in records]
        reached = [start["step"]] + [r["step"] for r in records]
        steps.plot([(w - origin) / 60 for w in walls], reached, marker=".", label=f"attempt {i} (from step {start['step']})")
    steps.set_xlabel("minutes since the job's start")
    steps.set_ylabel("step")
    steps.set_title(f"goodput {100 * summary['goodput']:.1f}%, {summary['attempts']} attempt(s), {summary['lost_steps']} step(s) lost")
    steps.legend()
    left = 0.0
    for key, seconds in summary["parts"].items():
        if seconds > 0:
            parts.barh(0, seconds / 60, left=left, label=PARTS[key])
            left += seconds / 60
    parts.set_yticks([])
    parts.set_xlabel("minutes of wall time")
    parts.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.6))
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="the run's dump folder (holds goodput.jsonl)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON, no table or plot")
    parser.add_argument("--plot", type=Path, help="where the plot goes (default FOLDER/goodput.png)")
    args = parser.parse_args()
    source = args.folder / "goodput.jsonl"
    try:
        rows = read(args.folder)
        summary = report(rows)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"goodput: cannot read {source} ({e!r}): pass the dump folder of a titanlite run (job.dump_folder)", file=sys.stderr)
        sys.exit(2)
    if args.json:
        print(json.dumps(summary))
        return
    print(describe(summary) + ("" if summary["ended"] else " (the last attempt has not ended)"))
    print(table(summary))
    plot(rows, summary, args.plot or args.folder / "goodput.png")


if __name__ == "__main__":
    main()
