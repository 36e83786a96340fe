"""Muon against AdamW (docs/benchmarks.md#muon): what the optimizer step costs, and which wins.

    python scripts/benchmark_muon.py step [--ranks 2 4]     # optimizer step time: AdamW, Muon by owners, Muon on every rank
                                                            # (FSDP on each count of ranks; FSDP 2 x TP 2 with 4)
    python scripts/benchmark_muon.py loss [--steps 300]     # validation loss of the debug model and debugmoe, best of 3 lrs each

`step` builds the real Trainer on N gloo ranks (FSDP over all of them; with 4 also FSDP 2 x TP 2,
whose matrices are cut along two mesh dims) for a model of dim 512 and 8 blocks and times optimizer.step() on fixed gradients (median of 10, after 2 warm-ups). `loss` trains
each model with each optimizer at 3 learning rates through the CLI (the debug configs at seq_len
128, 1 process), keeps each optimizer's best by its last validation loss, and plots validation loss
against steps and against wall time (docs/img/muon_vs_adamw.png).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from titanlite.launch import trainer_command

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "outputs" / "benchmark_muon"
SHAPE = ["--model.flavor_overrides", "dim=512,n_heads=8,n_kv_heads=8", "--model.n_layers", "8", "--training.seq_len", "128",
         "--training.local_batch_size", "2"]
OPTIMIZERS = {
    "AdamW": ["--optimizer.name", "AdamW"],
    "Muon, owners": ["--optimizer.name", "Muon", "--optimizer.ns_distribution", "owners"],
    "Muon, every rank": ["--optimizer.name", "Muon", "--optimizer.ns_distribution", "every_rank"],
}
LRS = {"AdamW": ["1e-3", "2e-3", "4e-3"], "Muon": ["0.01", "0.02", "0.04"]}
MODELS = {"debug model": ["--model.name", "llama3", "--model.flavor", "debugmodel"],
          "debugmoe": ["--job.config_file", str(REPO / "train_configs" / "debug_moe.toml")]}


def step_times(rank: int, world: int, port: int, layout: list[str], queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from titanlite.config import parse_args
    from titanlite.trainer import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = {}
    for label, args in OPTIMIZERS.items():
        trainer = Trainer(parse_args(["--model.hf_assets_path", "byte", *SHAPE, *layout, *args, "--job.dump_folder", str(OUT / "step")]),
                          torch.device("cpu"))
        gen = torch.Generator().manual_seed(rank)
        for p in trainer.parameters():
            sharded = isinstance(p, DTensor)
            grad = torch.randn(p.to_local().shape if sharded else p.shape, generator=gen)
            p.grad = DTensor.from_local(grad, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()) if sharded else grad
        seconds = []
        for i in range(12):
            dist.barrier()
            start = time.perf_counter()
            trainer.optimizers[0].step()
            dist.barrier()
            if i >= 2:
                seconds.append(time.perf_counter() - start)
        out[label] = statistics.median(seconds)
        del trainer
    dist.destroy_process_group()
    if rank == 0:
        queue.put(out)


def run_step(ranks: list[int]) -> dict:
    import socket

    import torch.multiprocessing as mp

    results = {}
    layouts = [(world, f"FSDP {world}", []) for world in ranks]
    if 4 in ranks:
        layouts.append((4, "FSDP 2 x TP 2", ["--parallelism.tensor_parallel_degree", "2"]))
    for world, name, layout in layouts:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=step_times, args=(r, world, port, layout, queue)) for r in range(world)]
        for p in procs:
            p.start()
        results[name] = queue.get(timeout=1800)
        for p in procs:
            p.join()
        print(f"{world} ranks ({name}), optimizer step, median of 10: " +
              ", ".join(f"{k} {1000 * v:.1f} ms" for k, v in results[name].items()), flush=True)
    return results


def train(name: str, model: list[str], optimizer: str, lr: str, steps: int) -> list[dict]:
    folder = OUT / "loss" / f"{name}_{optimizer}_{lr}".replace(" ", "_")
    extra = ["--optimizer.name", optimizer, "--optimizer.lr", lr]
    if optimizer == "Muon":
        extra += ["--optimizer.adamw_lr", "1e-3"]  # the debug configs' AdamW lr for embeddings, output, norms
    cmd = trainer_command(1, ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), *model, *extra,
                              "--training.steps", str(steps), "--validation.enable", "--validation.freq", str(steps // 6),
                              "--metrics.log_freq", "10", "--metrics.enable_tensorboard", "false", "--job.dump_folder", str(folder),
                              "--training.seq_len", "128", "--validation.seq_len", "128", "--validation.steps", "8",
                              "--debug.seed", "0", "--lr_scheduler.warmup_steps", str(steps // 15)])
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "2"})
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def run_loss(steps: int) -> dict:
    best = {}
    for name, model in MODELS.items():
        for optimizer, lrs in LRS.items():
            runs = {}
            for lr in lrs:
                rows = train(name, model, optimizer, lr, steps)
                runs[lr] = rows
                print(f"{name}, {optimizer} lr {lr}: validation loss {[round(r['val_loss'], 4) for r in rows if 'val_loss' in r]}",
                      flush=True)
            lr = min(runs, key=lambda k: [r["val_loss"] for r in runs[k] if "val_loss" in r][-1])
            best[(name, optimizer)] = (lr, runs[lr])
    plot(best)
    for (name, optimizer), (lr, rows) in best.items():
        val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        seconds = max(r["elapsed_s"] for r in rows if "elapsed_s" in r)
        print(f"best {name} {optimizer}: lr {lr}, validation loss at steps {[s for s, _ in val]}: "
              f"{[round(v, 4) for _, v in val]}, {seconds:.0f} s of training", flush=True)
    return best


def plot(best: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(MODELS), 2, figsize=(11, 4 * len(MODELS)))
    for row, name in enumerate(MODELS):
        for optimizer in LRS:
            lr, rows = best[(name, optimizer)]
            train_rows = {r["step"]: r["elapsed_s"] for r in rows if "elapsed_s" in r and "loss" in r}
            val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
            label = f"{optimizer} (lr {lr})"
            axes[row][0].plot([s for s, _ in val], [v for _, v in val], marker="o", label=label)
            axes[row][1].plot([train_rows.get(s, float("nan")) for s, _ in val], [v for _, v in val], marker="o", label=label)
        axes[row][0].set(title=f"{name}: validation loss by step", xlabel="step", ylabel="validation loss")
        axes[row][1].set(title=f"{name}: by wall time", xlabel="seconds of training", ylabel="validation loss")
        for ax in axes[row]:
            ax.legend()
    fig.tight_layout()
    path = REPO / "docs" / "img" / "muon_vs_adamw.png"
    fig.savefig(path, dpi=80)
    print(f"plot: {path}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("step", "loss"))
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.what == "step":
        run_step(args.ranks)
    else:
        run_loss(args.steps)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
