"""Compare loss curves: two or more configs from the same seed checkpoint, or finished runs.

    # fp32 on 1 process vs FSDP 2 x TP 2 on 4, same global batch, same start:
    python scripts/loss_compare.py --steps 50 --common "--training.data_split sequences" \\
        --run single 1 "--training.local_batch_size 8" \\
        --run fsdp2_tp2 4 "--training.local_batch_size 4 --parallelism.tensor_parallel_degree 2" \\
        --assert-within 1e-4

    # bf16 vs float8 recipes, 150 steps of the default config:
    python scripts/loss_compare.py --steps 150 --run bf16 1 "" --run tensorwise 1 "--model.converters float8 --quantize.linear.float8.emulate" ...

    # causal vs document-masked attention, validation loss every 25 steps:
    python scripts/loss_compare.py --steps 300 --key val_loss --common "--validation.freq 25" \
        --run causal 1 "" --run block_causal 1 "--model.attn_mask_type block_causal"

    # two finished runs:
    python scripts/loss_compare.py --metrics a outputs/a/metrics.jsonl --metrics b outputs/b/metrics.jsonl

The first run is the baseline. Every run starts from one seed checkpoint written first (same
weights whatever the layout). Prints each run's largest loss difference from the baseline and
its final loss, saves a plot (curves and differences), and with --assert-within TOL exits 1 when
a difference exceeds TOL. --key picks the logged value compared (default: the training loss).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path

from titanlite.launch import curve_difference, pyplot, run_trainer

REPO = Path(__file__).resolve().parent.parent


def logged(path: Path, key: str) -> dict[int, float]:
    """{step: value} of `key` in a metrics.jsonl."""
    return {r["step"]: r[key] for r in map(json.loads, open(path)) if key in r}


def run_all(runs: list[tuple[str, str, str]], common: list[str], steps: int, out: Path, key: str) -> dict[str, dict[int, float]]:
    base = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), "--training.steps", str(steps),
            "--metrics.log_freq", "1", "--checkpoint.interval", str(10 * steps), *common]
    seed = out / "seed"
    print(f"seed checkpoint -> {seed}", flush=True)
    run_trainer(1, [*base, "--job.dump_folder", str(seed), "--checkpoint.enable", "--checkpoint.create_seed_checkpoint"],
                log=seed / "train.log")
    curves = {}
    for label, nproc, extra in runs:
        folder = out / label
        print(f"{label}: {nproc} process(es) {extra}", flush=True)
        run_trainer(int(nproc), [*base, *shlex.split(extra), "--job.dump_folder", str(folder),
                                 "--checkpoint.initial_load_path", str(seed / "checkpoint" / "step-0")],
                    log=folder / "train.log")
        curves[label] = logged(folder / "metrics.jsonl", key)
    return curves


def compare(curves: dict[str, dict[int, float]]) -> dict[str, float]:
    """Largest |value - baseline value| per run (inf for a NaN, or a curve logged at other steps)."""
    baseline = next(iter(curves.values()))
    return {
        label: curve_difference(list(curve.values()), list(baseline.values())) if list(curve) == list(baseline) else math.inf
        for label, curve in list(curves.items())[1:]
    }


def plot(curves: dict[str, dict[int, float]], path: Path, key: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    baseline_label, baseline = next(iter(curves.items()))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    colors = {}
    marker = "o" if max(map(len, curves.values())) <= 50 else None  # sparse curves (validation) show their points
    for label, curve in curves.items():
        (line,) = top.plot(list(curve), list(curve.values()), label=label, linewidth=1, marker=marker)
        colors[label] = line.get_color()
    for label, curve in list(curves.items())[1:]:
        steps = [step for step in curve if step in baseline]
        bottom.plot(steps, [curve[i] - baseline[i] for i in steps], color=colors[label], linewidth=1, marker=marker)
    top.set_ylabel("training loss" if key == "loss" else key)
    top.legend()
    bottom.set_ylabel(f"loss - {baseline_label}")
    bottom.set_xlabel("step")
    bottom.axhline(0, color="gray", linewidth=0.5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", nargs=3, action="append", metavar=("LABEL", "NPROC", "ARGS"), default=[],
                        help="a config to train: label, process count, trainer overrides (quoted)")
    parser.add_argument("--metrics", nargs=2, action="append", metavar=("LABEL", "PATH"), default=[],
                        help="a finished run's metrics.jsonl instead")
    parser.add_argument("--common", default="", help="overrides for every run (quoted)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "loss_compare")
    parser.add_argument("--key", default="loss", help="the metrics.jsonl value to compare: loss, val_loss, grad_norm, ...")
    parser.add_argument("--assert-within", type=float, help="exit 1 if any run's loss differs by more than this")
    args = parser.parse_args()
    if len(args.run) + len(args.metrics) < 2 or (args.run and args.metrics):
        parser.error("give two or more --run, or two or more --metrics (not both)")

    if args.run:
        curves = run_all(args.run, shlex.split(args.common), args.steps, args.out, args.key)
    else:
        curves = {label: logged(Path(path), args.key) for label, path in args.metrics}
    if not all(curves.values()):
        parser.error(f"a run logged no {args.key}: {[label for label, curve in curves.items() if not curve]}")
    args.out.mkdir(parents=True, exist_ok=True)
    differences = compare(curves)
    baseline_label = next(iter(curves))
    for label, curve in curves.items():
        note = "baseline" if label == baseline_label else f"max |difference| {differences[label]:.3e}"
        print(f"{label:>24}: {len(curve)} values, final {args.key} {list(curve.values())[-1]:.4f}, {note}")
    plot(curves, args.out / "loss_compare.png", args.key)
    (args.out / "loss_compare.json").write_text(json.dumps({"curves": curves, "max_abs_difference": differences}, indent=1))
    if args.assert_within is not None:
        failed = {label: d for label, d in differences.items() if not d <= args.assert_within}
        if failed:
            print(f"FAIL: loss differs by more than {args.assert_within} from {baseline_label}: {failed}")
            return 1
        print(f"OK: every run within {args.assert_within} of {baseline_label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
