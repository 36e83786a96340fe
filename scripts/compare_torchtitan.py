"""titanlite beside the real TorchTitan on the same shapes, runs taken in turn (A B A B): the ratio table.

    python scripts/compare_torchtitan.py --runner PATH/torchtitan_cpu.sh
    python scripts/compare_torchtitan.py --runner PATH/torchtitan_cpu.sh --layouts 1rank fsdp2 --repeats 3
    python scripts/compare_torchtitan.py --runner PATH/torchtitan_cpu.sh --layouts moe1rank moe_fsdp2 moe_ep2

`--runner` is a script that runs TorchTitan on this machine for a layout preset (1rank, fsdp2, tp2,
fsdp2_tp2, moe1rank, moe_fsdp2, moe_ep2) and prints a line `torchtitan tps=<median tokens/s per
device after warm-up> ... peak_rss_mib_max=<peak RSS of the busiest rank>`, with the shape taken from
TT_* variables (the TorchTitan CPU runner of this project's tool library does). Every shape variable
is set here, from the tables below, so neither side falls back on a default of its own.

Both sides: vocab 8192 (titanlite's bundled tokenizer, which the runner also tokenizes with), seq 256,
local batch 8, fp32, 2 threads for one rank and 1 per rank otherwise, and document-masked causal
attention: TorchTitan's decoders on CPU run their block-causal mask as SDPA over a boolean mask, so
titanlite runs block_causal on SDPA too.
- Dense layouts (1rank, fsdp2, tp2, fsdp2_tp2): the debug model, llama3 (dim 256, 6 layers, 16 heads).
- MoE layouts (moe1rank; moe_fsdp2: FSDP 2, every rank holds all experts; moe_ep2: expert parallel 2
  over the 2 FSDP ranks): titanlite's debugmoe flavor beside TorchTitan's own Qwen3-MoE model, on
  debugmoe's shape: dim 256, 4 layers, 16 heads, 4 kv heads, the first block dense (hidden 768), then
  8 routed experts (top 2, softmax scores renormalized, hidden 256) + 1 shared expert, expert-bias
  balancing with coefficient 1e-2. titanlite takes TorchTitan's Qwen3 attention (per-head q/k RMSNorm,
  norm eps 1e-6, RoPE positions restarting at each document, as TorchTitan's decoder is handed them)
  and drops its sequence-wise balance loss (TorchTitan has none); the experts run in fp32 on both
  sides (TT_MOE_GMM_DTYPE=param: TorchTitan's own code casts them to bf16). The dense layouts keep
  titanlite's positions running across the packed window, as their recorded figures did.
Both sides train on the same text: titanlite's Shakespeare training split, handed to the runner as
its C4-format corpus (TT_DATA_JSON), so the routing's balance, which sets the experts' work per rank
under expert parallel, is not one side's easier data. titanlite trains with the runner's
optimizer settings and learning-rate schedule (TORCHTITAN_SCHEDULE; its linear decay reaches 0 one
step before TorchTitan's). Left different: each side's own
inits and document packing. A WARNING line says when the two models' parameter counts
(each side's log) differ.

Each side's figure is the median over the repeats of its median tokens/s per device after warm-up;
memory is the peak RSS per rank (titanlite: rank 0). The ratio is the median of the repeats' own
ratios (titanlite over the TorchTitan run right after it): a shared machine drifts between runs, and
runs taken in turn drift together. Prints the table and writes OUT/compare.json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shlex
import statistics
import subprocess
import time
from pathlib import Path

from titanlite.data.corpus import shakespeare_files
from titanlite.launch import read_metrics, run_trainer

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "titanlite" / "assets" / "shakespeare_bpe8k"
RUN = {"TT_VOCAB": "8192", "TT_SEQ_LEN": "256", "TT_LBS": "8", "TT_PREC": "float32"}
SHAPE = RUN | {"TT_DIM": "256", "TT_N_LAYERS": "6", "TT_N_HEADS": "16"}
MOE_SHAPE = RUN | {
    "TT_DIM": "256", "TT_N_LAYERS": "4", "TT_N_HEADS": "16", "TT_N_KV_HEADS": "4", "TT_FFN_MULTIPLE_OF": "256",
    "TT_MOE_EXPERTS": "8", "TT_MOE_TOPK": "2", "TT_MOE_SHARED": "1", "TT_MOE_HIDDEN": "256", "TT_MOE_DENSE_LAYERS": "1",
    "TT_MOE_SCORE_FUNC": "softmax", "TT_MOE_ROUTE_NORM": "1", "TT_MOE_LB_COEFF": "1e-2", "TT_ROPE_THETA": "10000",
    "TT_ROPE_SCALING": "none", "TT_MOE_GMM_DTYPE": "param",
}


def moe_flavor(tt: dict) -> str:
    """titanlite's model.flavor_overrides for the runner's MoE shape: every field its TT_* variables name
    (the dense block's hidden as the runner computes it, 768), and TorchTitan's Qwen3 attention norms."""
    hidden, multiple = int(8 * int(tt["TT_DIM"]) / 3), int(tt["TT_FFN_MULTIPLE_OF"])
    dense_hidden = multiple * -(-hidden // multiple)
    return ",".join([
        f"dim={tt['TT_DIM']}", f"n_heads={tt['TT_N_HEADS']}", f"n_kv_heads={tt['TT_N_KV_HEADS']}",
        f"num_experts={tt['TT_MOE_EXPERTS']}", f"top_k={tt['TT_MOE_TOPK']}", f"num_shared_experts={tt['TT_MOE_SHARED']}",
        f"moe_hidden_dim={tt['TT_MOE_HIDDEN']}", f"n_dense_layers={tt['TT_MOE_DENSE_LAYERS']}", f"dense_hidden_dim={dense_hidden}",
        f"score_func={tt['TT_MOE_SCORE_FUNC']}", f"route_norm={str(tt['TT_MOE_ROUTE_NORM'] == '1').lower()}",
        f"rope_theta={tt['TT_ROPE_THETA']}", f"rope_scaling={str(tt['TT_ROPE_SCALING'] != 'none').lower()}",
        "qk_norm=true", "norm_eps=1e-6",
    ])


FAMILIES = {  # name: (TorchTitan's TT_* shape, titanlite's config file and overrides)
    "dense": (SHAPE, "debug_model.toml", []),
    "moe": (MOE_SHAPE, "debug_moe.toml", [
        "--model.name", "moe", "--model.flavor", "debugmoe", "--model.flavor_overrides", moe_flavor(MOE_SHAPE),
        "--model.n_layers", MOE_SHAPE["TT_N_LAYERS"], "--model.moe_grouped_mm", "true",
        "--model.moe_load_balance_coeff", MOE_SHAPE["TT_MOE_LB_COEFF"], "--model.moe_aux_loss_coeff", "0",
        "--model.reset_position_ids", "true",
    ]),
}
# The runner's optimizer and schedule (TorchTitan's debug config): AdamW at the runner's lr (TT_LR, 8e-4),
# warmup 2 steps, then the last 80% of the steps decaying linearly to 0 (titanlite's last step at 0,
# TorchTitan's at 1/24 of the peak: its decay starts a step later). The routing's balance follows
# the training, so both sides train alike.
TORCHTITAN_SCHEDULE = ["--optimizer.lr", os.environ.get("TT_LR", "8e-4"), "--lr_scheduler.warmup_steps", "2",
                       "--lr_scheduler.decay_ratio", "0.8", "--lr_scheduler.decay_type", "linear", "--lr_scheduler.min_lr_factor", "0"]
DP2 = ["--parallelism.data_parallel_shard_degree", "2"]
LAYOUTS = {  # name: (ranks, family, titanlite overrides)
    "1rank": (1, "dense", []),
    "fsdp2": (2, "dense", []),
    "tp2": (2, "dense", ["--parallelism.tensor_parallel_degree", "2"]),
    "fsdp2_tp2": (4, "dense", ["--parallelism.tensor_parallel_degree", "2"]),
    "moe1rank": (1, "moe", []),
    "moe_fsdp2": (2, "moe", [*DP2, "--parallelism.expert_parallel_degree", "1"]),
    "moe_ep2": (2, "moe", [*DP2, "--parallelism.expert_parallel_degree", "2"]),
}
DEFAULT_LAYOUTS = [name for name, (_, family, _) in LAYOUTS.items() if family == "dense"]


def titanlite_run(layout: str, steps: int, warmup: int, folder: Path, extra: list[str]) -> dict:
    ranks, family, overrides = LAYOUTS[layout]
    shape, config_file, family_args = FAMILIES[family]
    args = [
        "--job.config_file", str(REPO / "train_configs" / config_file), "--training.steps", str(steps), *TORCHTITAN_SCHEDULE,
        "--training.seq_len", shape["TT_SEQ_LEN"], "--training.local_batch_size", shape["TT_LBS"],
        "--training.mixed_precision_param", "float32", "--model.attn_mask_type", "block_causal", "--model.attn_type", "sdpa",
        "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--validation.enable", "false",
        "--checkpoint.enable", "false", *family_args, *overrides, *extra, "--job.dump_folder", str(folder),
    ]
    run_trainer(ranks, args, threads_per_rank=2 if ranks == 1 else 1, log=folder / "train.log")
    rows = read_metrics(folder)[warmup:]
    params = re.search(r"([0-9,]+) params", (folder / "train.log").read_text())
    return {"tps": statistics.median(r["tps"] for r in rows), "peak_mib": max(r["memory_gib"] for r in rows) * 1024,
            "params": int(params[1].replace(",", "")) if params else None}


def torchtitan_run(runner: Path, layout: str, steps: int, warmup: int, tokenizer_dir: Path, corpus: Path, log: Path) -> dict:
    shape = FAMILIES[LAYOUTS[layout][1]][0]
    env = os.environ | shape | {"TT_STEPS": str(steps), "TT_WARMUP": str(warmup), "TT_TOKENIZER_DIR": str(tokenizer_dir),
                                "TT_DATA_JSON": str(corpus)}
    out = subprocess.run(["bash", str(runner), layout], env=env, capture_output=True, text=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(out.stdout + out.stderr)
    found = re.search(r"torchtitan tps=([0-9.]+) .*peak_rss_mib_max=([0-9.]+)", out.stdout)
    if out.returncode or not found:
        raise RuntimeError(f"the TorchTitan runner failed on {layout} (exit {out.returncode}); its output: {log}")
    params = re.search(r"\bparams=([0-9]+)", out.stdout)
    return {"tps": float(found[1]), "peak_mib": float(found[2]), "params": int(params[1]) if params else None}


def tokenizer_folder(out: Path) -> Path:
    """titanlite's bundled tokenizer with the two-line config that names its BOS and EOS for TorchTitan."""
    folder = out / "tokenizer"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_bytes((TOKENIZER / "tokenizer.json").read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}))
    return folder


def corpus_file(out: Path) -> Path:
    """titanlite's Shakespeare training split as a C4-format JSON-lines file (the runner's TT_DATA_JSON)."""
    path = out / "shakespeare_c4.json"
    with gzip.open(shakespeare_files()["train"], "rt", encoding="utf-8") as docs, open(path, "w", encoding="utf-8") as c4:
        for i, line in enumerate(docs):
            c4.write(json.dumps({"text": json.loads(line)["text"], "timestamp": "2019-04-25T12:00:00Z", "url": f"shakespeare://{i}"}) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runner", type=Path, required=True, help="the TorchTitan CPU runner script")
    parser.add_argument("--layouts", nargs="*", choices=list(LAYOUTS), default=DEFAULT_LAYOUTS,
                        help="layouts to compare (default: the dense ones; the moe ones take TorchTitan's Qwen3-MoE)")
    parser.add_argument("--repeats", type=int, default=2, help="A B pairs per layout")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "compare_torchtitan")
    parser.add_argument("--titanlite-args", default="", help="more overrides for titanlite's runs, e.g. "
                        "--titanlite-args='--model.fused_projections false' "
                        "(the separate projections)")
    args = parser.parse_args()
    titanlite_extra = shlex.split(args.titanlite_args)
    tokenizer_dir, corpus = tokenizer_folder(args.out), corpus_file(args.out)
    results = {}
    for layout in args.layouts:
        sides = {"titanlite": [], "torchtitan": []}
        for repeat in range(args.repeats):
            folder = args.out / layout / f"titanlite_{repeat}"
            sides["titanlite"].append(titanlite_run(layout, args.steps, args.warmup, folder, titanlite_extra))
            sides["torchtitan"].append(torchtitan_run(args.runner, layout, args.steps, args.warmup, tokenizer_dir, corpus,
                                                      args.out / layout / f"torchtitan_{repeat}.log"))
            print(f"{layout} repeat {repeat}: " + ", ".join(f"{side} {runs[-1]['tps']:,.0f} tok/s, {runs[-1]['peak_mib']:,.0f} MiB"
                                                            for side, runs in sides.items()), flush=True)
            counts = {side: runs[-1]["params"] for side, runs in sides.items()}
            if None not in counts.values() and len(set(counts.values())) > 1:
                print(f"WARNING {layout}: the models differ in size: " + ", ".join(f"{side} {n:,} params" for side, n in counts.items()))
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
