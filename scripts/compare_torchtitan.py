"""titanlite beside the real TorchTitan on the same shapes, runs taken in turn (A B A B): the ratio table.

    python scripts/compare_torchtitan.py --runner PATH/torchtitan_cpu.sh
    python scripts/compare_torchtitan.py --runner PATH/torchtitan_cpu.sh --layouts 1rank fsdp2 --repeats 3

`--runner` is a script that runs TorchTitan on this machine for a layout preset (1rank, fsdp2, tp2,
fsdp2_tp2) and prints a line `torchtitan tps=<median tokens/s per device after warm-up> ...
peak_rss_mib_max=<peak RSS of the busiest rank>`, with the shape taken from TT_* variables (the
TorchTitan CPU runner of this project's tool library does).

Both sides run the debug model (dim 256, 6 layers, 16 heads), vocab 8192 (titanlite's bundled
tokenizer, which the runner also tokenizes with), seq 256, local batch 8, fp32, 2 threads for one
rank and 1 per rank otherwise, and document-masked causal attention: TorchTitan's llama3 on CPU
runs its block-causal mask as SDPA over a boolean mask, so titanlite runs block_causal on SDPA too.
Each side's figure is the median over the repeats of its median tokens/s per device after warm-up;
memory is the peak RSS per rank (titanlite: rank 0). The ratio is the median of the repeats' own
ratios (titanlite over the TorchTitan run right after it): a shared machine drifts between runs, and
runs taken in turn drift together. Prints the table and writes OUT/compare.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import time
from pathlib import Path

from titanlite.launch import read_metrics, run_trainer

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "titanlite" / "assets" / "shakespeare_bpe8k"
SHAPE = {"TT_DIM": "256", "TT_N_LAYERS": "6", "TT_N_HEADS": "16", "TT_VOCAB": "8192", "TT_SEQ_LEN": "256", "TT_LBS": "8",
         "TT_PREC": "float32"}
LAYOUTS = {  # name: (ranks, titanlite overrides)
    "1rank": (1, []),
    "fsdp2": (2, []),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2"]),
    "fsdp2_tp2": (4, ["--parallelism.tensor_parallel_degree", "2"]),
}


def titanlite_run(layout: str, steps: int, warmup: int, folder: Path, extra: list[str]) -> dict:
    ranks, overrides = LAYOUTS[layout]
    args = [
        "--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), "--training.steps", str(steps),
        "--training.seq_len", SHAPE["TT_SEQ_LEN"], "--training.local_batch_size", SHAPE["TT_LBS"],
        "--training.mixed_precision_param", "float32", "--model.attn_mask_type", "block_causal", "--model.attn_type", "sdpa",
        "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--validation.enable", "false",
        "--checkpoint.enable", "false", *overrides, *extra, "--job.dump_folder", str(folder),
    ]
    run_trainer(ranks, args, threads_per_rank=2 if ranks == 1 else 1, log=folder / "train.log")
    rows = read_metrics(folder)[warmup:]
    return {"tps": statistics.median(r["tps"] for r in rows), "peak_mib": max(r["memory_gib"] for r in rows) * 1024}


def torchtitan_run(runner: Path, layout: str, steps: int, warmup: int, tokenizer_dir: Path, log: Path) -> dict:
    env = os.environ | SHAPE | {"TT_STEPS": str(steps), "TT_WARMUP": str(warmup), "TT_TOKENIZER_DIR": str(tokenizer_dir)}
    out = subprocess.run(["bash", str(runner), layout], env=env, capture_output=True, text=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(out.stdout + out.stderr)
    found = re.search(r"torchtitan tps=([0-9.]+) .*peak_rss_mib_max=([0-9.]+)", out.stdout)
    if out.returncode or not found:
        raise RuntimeError(f"the TorchTitan runner failed on {layout} (exit {out.returncode}); its output: {log}")
    return {"tps": float(found[1]), "peak_mib": float(found[2])}


def tokenizer_folder(out: Path) -> Path:
    """titanlite's bundled tokenizer with the two-line config that names its BOS and EOS for TorchTitan."""
    folder = out / "tokenizer"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_bytes((TOKENIZER / "tokenizer.json").read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runner", type=Path, required=True, help="the TorchTitan CPU runner script")
    parser.add_argument("--layouts", nargs="*", choices=sorted(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--repeats", type=int, default=2, help="A B pairs per layout")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "compare_torchtitan")
    parser.add_argument("--titanlite-args", default="", help="more overrides for titanlite's runs, e.g. "
                        "--titanlite-args='--model.fused_projections false' "
                        "(the separate projections)")
    args = parser.parse_args()
    titanlite_extra = shlex.split(args.titanlite_args)
    tokenizer_dir = tokenizer_folder(args.out)
    results = {}
    for layout in args.layouts:
        sides = {"titanlite": [], "torchtitan": []}
        for repeat in range(args.repeats):
            folder = args.out / layout / f"titanlite_{repeat}"
            sides["titanlite"].append(titanlite_run(layout, args.steps, args.warmup, folder, titanlite_extra))
            sides["torchtitan"].append(torchtitan_run(args.runner, layout, args.steps, args.warmup, tokenizer_dir,
                                                      args.out / layout / f"torchtitan_{repeat}.log"))
            print(f"{layout} repeat {repeat}: " + ", ".join(f"{side} {runs[-1]['tps']:,.0f} tok/s, {runs[-1]['peak_mib']:,.0f} MiB"
                                                            for side, runs in sides.items()), flush=True)
        results[layout] = {side: {key: statistics.median(r[key] for r in runs) for key in ("tps", "peak_mib")} | {"runs": runs}
                           for side, runs in sides.items()}
    lines = ["| layout | titanlite tok/s | TorchTitan tok/s | ratio | each repeat | titanlite MiB | TorchTitan MiB | memory ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for layout, r in results.items():
        ours, theirs = r["titanlite"], r["torchtitan"]
        pairs = [a["tps"] / b["tps"] for a, b in zip(ours["runs"], theirs["runs"])]
        r["ratio"] = statistics.median(pairs)
        lines.append(f"| {layout} | {ours['tps']:,.0f} | {theirs['tps']:,.0f} | {r['ratio']:.2f} | "
                     f"{', '.join(f'{p:.2f}' for p in pairs)} | {ours['peak_mib']:,.0f} | {theirs['peak_mib']:,.0f} | "
                     f"{ours['peak_mib'] / theirs['peak_mib']:.2f} |")
    if args.titanlite_args:
        lines.append(f"titanlite ran with {args.titanlite_args}")
    print("\n".join(lines))
    (args.out / "compare.json").write_text(json.dumps({"time": time.strftime("%Y-%m-%d %H:%M:%S"), "titanlite_args": args.titanlite_args,
                                                       "results": results}, indent=1))


if __name__ == "__main__":
    main()
