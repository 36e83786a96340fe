"""Measure throughput, MFU and memory of a matrix of configs through the real trainer.

    python scripts/benchmark.py --preset cpu            # debug shape: 1 rank, FSDP 2, TP 2, PP 2, CP 2, FSDP 2 x TP 2,
                                                        # block_causal on 1 rank and CP 2;
                                                        # debug MoE: 1 rank, EP 2, EP 2 x FSDP 2
    python scripts/benchmark.py --preset gpu            # one GPU, compiled, the short run: Llama 3 8B's blocks in
                                                        # bf16 and float8 (tensorwise, rowwise); Qwen3-30B-A3B's in
                                                        # bf16 and with float8 grouped GEMMs; DeepSeek-V2-Lite's;
                                                        # gpt-oss-20b's
    python scripts/benchmark.py --preset gpu_more       # the other GPU rows: AC modes, document masks, the chunked loss
    python scripts/benchmark.py --preset cpu --only 1rank fsdp2 --steps 30

Each run is a torchrun of `titanlite.train`; the steps after --warmup are averaged. One row per run
is appended to OUT/results.jsonl (and OUT/results.csv rewritten), with the attention kernels the
run's log names; the table is printed and drawn to OUT/results.png. With --profile the last step
of each run is profiled, and its 15 costliest kernels land in OUT/<preset>/<row>/top_kernels.txt.
--budget-s starts no row once that many seconds have passed (the rows left are named). --dry-run
checks each row's command as a COMM_MODE=fake_backend dry run in one process (the script's logic,
on any machine; nothing is timed). Runs with `bare=True` also time a bare loop (forward, backward,
clip, AdamW) of the same model on the same batches in a fresh process, and report the trainer's
overhead (the median of --overhead-repeats trainer/bare pairs).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from titanlite.launch import pyplot, read_metrics, run_trainer

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Run:
    name: str
    nproc: int
    overrides: list[str] = field(default_factory=list)
    bare: bool = False  # also time the bare loop (1 process only)


# The CPU shape of issue 9: debug model (dim 256, 6 layers, 16 heads), seq 256, local batch 8, fp32.
CPU_SHAPE = ["--training.seq_len", "256", "--training.local_batch_size", "8", "--training.mixed_precision_param", "float32"]
TP, PP, CP = "--parallelism.tensor_parallel_degree", "--parallelism.pipeline_parallel_degree", "--parallelism.context_parallel_degree"
# Llama 3 8B's block shape (dim 4096, 32 heads, 8 kv heads, ffn 14336) with 8 of its 32 blocks: one GPU.
GPU_SHAPE = ["--model.flavor", "8B", "--model.n_layers", "8", "--training.seq_len", "8192", "--training.local_batch_size", "1",
             "--training.mixed_precision_param", "bfloat16"]
COMPILE, FLOAT8 = ["--compile.enable"], ["--model.converters", "float8"]
BLOCK_CAUSAL = ["--model.attn_mask_type", "block_causal", "--model.attn_type"]  # + the kernel
# The debug MoE (8 experts, top 2, a shared expert) on the CPU shape; EP splits its experts.
MOE, EP = ["--model.name", "moe", "--model.flavor", "debugmoe"], "--parallelism.expert_parallel_degree"
# DeepSeek-V3's debug model (MLA, group-limited routing, one MTP depth) on the CPU shape.
DSV3 = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"]
# Llama 4's debug model (MoE every other block, NoPE every 4th, chunks of 64) on the CPU shape.
L4 = ["--model.name", "llama4", "--model.flavor", "debugmodel"]
# DeepSeek-V2-Lite's shape (16B flavor: MLA without query compression, 64 experts, top 6) with 4 of its
# 27 blocks and one MTP depth: one GPU.
GPU_DSV3_SHAPE = ["--model.name", "deepseek_v3", "--model.flavor", "16B", "--model.n_layers", "4", "--model.flavor_overrides",
                  "mtp_depth=1", "--training.seq_len", "4096", "--training.local_batch_size", "2"]
# Qwen3-30B-A3B's block shape (128 experts, top 8, q/k norms) with 4 of its 48 blocks: one GPU.
GPU_MOE_SHAPE = ["--model.name", "moe", "--model.flavor", "qwen3_30b_a3b", "--model.n_layers", "4", "--training.seq_len", "4096",
                 "--training.local_batch_size", "2"]
# gpt-oss-20b's block shape (sinks, a window of 128 on the first block, 32 experts, top 4) with 2 of
# its 24 blocks: one GPU.
GPU_GPT_OSS_SHAPE = ["--model.name", "gpt_oss", "--model.flavor", "20b", "--model.n_layers", "2", "--training.seq_len", "4096",
                     "--training.local_batch_size", "2"]

PRESETS = {
    "cpu": (CPU_SHAPE, 2, [
        Run("1rank", 1, bare=True),
        Run("fsdp2", 2),
        Run("tp2", 2, [TP, "2"]),
        Run("pp2", 2, [PP, "2"]),
        Run("cp2", 2, [CP, "2"]),
        Run("fsdp2_tp2", 4, [TP, "2"]),
        Run("1rank_block_causal", 1, BLOCK_CAUSAL + ["sdpa"]),
        Run("cp2_block_causal", 2, [CP, "2"] + BLOCK_CAUSAL + ["sdpa"]),
        Run("moe_1rank", 1, MOE),
        Run("moe_ep2", 2, MOE + [EP, "2"]),
        Run("moe_ep2_fsdp2", 4, MOE + [EP, "2"]),
        Run("dsv3_1rank", 1, DSV3),
        Run("dsv3_ep2", 2, DSV3 + [EP, "2"]),
        Run("l4_1rank", 1, L4),
        Run("l4_cp2", 2, L4 + [CP, "2"]),
    ]),
    # The short GPU run (scripts/gpu_benchmark.sh): what a GPU at hand for minutes should measure first.
    "gpu": (GPU_SHAPE, None, [
        Run("bf16_compile", 1, COMPILE),
        Run("float8_tensorwise_compile", 1, COMPILE + FLOAT8),
        Run("float8_rowwise_compile", 1, COMPILE + FLOAT8 + ["--quantize.linear.float8.recipe_name", "rowwise"]),
        Run("moe_qwen3_30b_a3b_bf16_compile", 1, GPU_MOE_SHAPE + COMPILE),
        # The routed experts' grouped GEMMs in float8 (rowwise, torch._scaled_grouped_mm).
        Run("moe_qwen3_30b_a3b_bf16_compile_float8_grouped", 1, GPU_MOE_SHAPE + COMPILE + [
            "--model.converters", "quantize.grouped_mm.float8", "--quantize.grouped_mm.float8.fqns", "experts"]),
        Run("dsv3_16b_4_blocks_bf16_compile", 1, GPU_DSV3_SHAPE + COMPILE),
        # gpt-oss-20b-shaped blocks in bf16, compiled: sinks and windows on FlexAttention.
        Run("gpt_oss_20b_2_blocks_bf16_flex_compile", 1, GPU_GPT_OSS_SHAPE + COMPILE + ["--model.attn_type", "flex"]),
    ]),
    "gpu_more": (GPU_SHAPE, None, [
        Run("bf16", 1),
        # The per-op policy: mode selective alone checkpoints every second block (selective_ac_option's default, 2).
        Run("bf16_compile_ac_op", 1, COMPILE + ["--activation_checkpoint.mode", "selective",
                                                "--activation_checkpoint.selective_ac_option", "op"]),
        Run("bf16_compile_ac_full", 1, COMPILE + ["--activation_checkpoint.mode", "full"]),
        # Document masks at seq 8192, against bf16_compile (SDPA causal): FlexAttention, SDPA's boolean mask.
        Run("bf16_compile_block_causal_flex", 1, COMPILE + BLOCK_CAUSAL + ["flex"]),
        Run("bf16_compile_block_causal_sdpa", 1, COMPILE + BLOCK_CAUSAL + ["sdpa"]),
        # The output projection and loss at Qwen3's 152K vocabulary, 8 pieces of tokens at a time (compiled).
        Run("moe_qwen3_30b_a3b_bf16_compile_loss_chunks8", 1, GPU_MOE_SHAPE + COMPILE + ["--training.loss_chunks", "8"]),
        Run("dsv3_debug_bf16_compile", 1, DSV3 + COMPILE + ["--training.seq_len", "4096", "--training.local_batch_size", "8"]),
        # Llama 4's debug model in bf16 on FlexAttention (chunked block masks), seq 8192.
        Run("l4_debug_bf16_flex_compile", 1, L4 + COMPILE + ["--model.attn_type", "flex", "--training.seq_len", "8192",
                                                             "--training.local_batch_size", "2"]),
    ]),
    # A quick end-to-end check of this script (the tests run it).
    "smoke": (["--training.seq_len", "64", "--training.local_batch_size", "2"], 1, [Run("1rank", 1, bare=True), Run("fsdp2", 2)]),
}


def trainer_args(shape: list[str], run: Run, tokenizer: str, dataset: str, steps: int, folder: Path) -> list[str]:
    return [
        "--job.config_file", str(REPO / "train_configs" / "debug_model.toml"),
        "--model.hf_assets_path", tokenizer, "--training.dataset", dataset, "--training.steps", str(steps),
        "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
        "--validation.enable", "false", "--checkpoint.enable", "false",
        *shape, *run.overrides, "--job.dump_folder", str(folder),
    ]


def bare_loop(args: list[str], steps: int, warmup: int) -> float:
    """Seconds per step of forward + backward + clip + AdamW on the trainer's model and batches."""
    import torch
    import torch.nn.functional as F

    from titanlite.config import parse_args
    from titanlite.data.dataset import build_dataloader
    from titanlite.data.tokenizer import build_tokenizer
    from titanlite.models import FAMILIES, model_args
    from titanlite.optim.build import build_optimizer
    from titanlite.train import reuse_freed_host_memory

    if not torch.cuda.is_available():
        reuse_freed_host_memory()  # as the trainer does: the overhead is then the trainer's own work
    config = parse_args(args)
    t = config.training
    tokenizer = build_tokenizer(*config.tokenizer)
    args = model_args(config.model.name, config.model.flavor, tokenizer.vocab_size, t.seq_len, config.model.n_layers, config.model)
    model = FAMILIES[config.model.name].plan.build(args)
    model.init_weights(config.debug.seed or 0)
    optimizer = build_optimizer(model.named_parameters(), config)
    batches = [b for _, b in zip(range(steps), build_dataloader(config, tokenizer, 0, 1))]
    start = 0.0
    for i, (x, y) in enumerate(batches):
        if i == warmup:
            start = time.perf_counter()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_norm)
        optimizer.step()
        optimizer.zero_grad()
    return (time.perf_counter() - start) / (len(batches) - warmup)


def overhead(targs: list[str], first_step_time: float, run: Run, per_rank: int | None, args) -> dict:
    """The trainer's step time over the bare loop's, as the median of --overhead-repeats pairs of
    runs taken in turn (a shared machine drifts more between runs than the overhead is)."""
    spec = json.dumps({"args": targs, "steps": args.steps, "warmup": args.warmup})
    env = os.environ | ({"OMP_NUM_THREADS": str(per_rank)} if per_rank else {})
    trainer_times, bare_times = [first_step_time], []
    for repeat in range(args.overhead_repeats):
        if repeat:
            folder = args.out / args.preset / f"{run.name}_repeat{repeat}"
            run_trainer(run.nproc, [*targs, "--job.dump_folder", str(folder)], per_rank, log=folder / "train.log")
            trainer_times.append(summarize(run, read_metrics(folder), args.warmup)["step_time_s"])
        out = subprocess.run([sys.executable, __file__, "--bare-loop", spec], capture_output=True, text=True, env=env, check=True)
        bare_times.append(json.loads(out.stdout.strip().splitlines()[-1])["bare_step_time_s"])
    ratios = sorted(t / b for t, b in zip(trainer_times, bare_times))
    return {"bare_step_time_s": sorted(bare_times)[len(bare_times) // 2], "overhead_pct": 100 * (ratios[len(ratios) // 2] - 1),
            "overhead_pct_each": [round(100 * (r - 1), 2) for r in ratios]}


def profiling(steps: int) -> list[str]:
    """Trainer flags that profile the last step (after one profiler warm-up step)."""
    return ["--profiling.enable_profiling", "--profiling.profile_freq", str(steps), "--profiling.profiler_warmup", "1",
            "--profiling.profiler_active", "1", "--profiling.save_traces_folder", "profile_trace"]


def top_kernels(folder: Path) -> str:
    """Copies rank 0's table of the profiled step's costliest kernels to the row's folder; its path."""
    tables = sorted(folder.glob("profile_trace/iteration_*/rank0_top_kernels.txt"), key=lambda p: p.stat().st_mtime)
    if not tables:
        return ""
    (folder / "top_kernels.txt").write_text(tables[-1].read_text())
    return str(folder / "top_kernels.txt")


def attention_kernels(log: Path) -> str:
    """What the run's log says of its attention kernels ('' where it says nothing)."""
    lines = [line for line in log.read_text().splitlines() if "attention kernels: " in line]
    return lines[-1].split("attention kernels: ", 1)[1].strip() if lines else ""


def dry_run(run: Run, targs: list[str], folder: Path) -> None:
    """The run's command as a COMM_MODE=fake_backend dry run of its layout in one process."""
    env = os.environ | {"WORLD_SIZE": str(run.nproc)}
    out = subprocess.run([sys.executable, "-m", "titanlite.train", *targs, "--comm.mode", "fake_backend"], env=env,
                         capture_output=True, text=True)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "dry_run.log").write_text(out.stdout + out.stderr)
    if out.returncode != 0 or "dry run OK" not in out.stdout:
        raise RuntimeError(f"{run.name}: the dry run failed:\n{(out.stdout + out.stderr)[-3000:]}")
    print(f"    {out.stdout.strip().splitlines()[-1].strip()}", flush=True)


def device_description() -> dict:
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU {platform.processor() or platform.machine()}"
    return {"device": device, "torch": torch.__version__, "python": platform.python_version()}


def cpu_inputs(out: Path) -> tuple[str, str]:
    """The CPU runs' tokenizer (a 2048-token BPE of the built-in corpus, made once) and dataset."""
    path = out / "tokenizer-2048" / "tokenizer.json"
    if not path.exists():
        from titanlite.data.corpus import read_texts, shakespeare_files
        from titanlite.data.tokenizer import train_bpe

        path.parent.mkdir(parents=True, exist_ok=True)
        train_bpe(list(read_texts(shakespeare_files()["train"])), 2048).save(str(path))
    return str(path), "shakespeare"


def gpu_inputs(out: Path) -> tuple[str, str]:
    """Byte tokens of seeded random text: speed does not depend on the words, and a GPU machine
    without network cannot build the built-in corpus."""
    import random

    path = out / "random_text.jsonl"
    if not path.exists():
        rng = random.Random(0)
        words = [bytes(rng.choices(range(97, 123), k=rng.randint(2, 9))).decode() for _ in range(5000)]
        out.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for _ in range(2000):
                f.write(json.dumps({"text": " ".join(rng.choices(words, k=3000))}) + "\n")
    return "byte", str(path)


def summarize(run: Run, rows: list[dict], warmup: int) -> dict:
    steady = rows[warmup:]

    def mean(key):
        return sum(r[key] for r in steady) / len(steady)

    return {
        "name": run.name, "nproc": run.nproc, "overrides": " ".join(run.overrides),
        "tps_per_device": mean("tps"), "tps_total": mean("tps") * run.nproc, "tflops": mean("tflops"), "mfu": mean("mfu"),
        "peak_memory_gib": max(r["memory_gib"] for r in rows), "step_time_s": mean("step_time_s"),
        "data_share": mean("data_share"), "final_loss": rows[-1]["loss"],
    }


COLUMNS = ["name", "nproc", "tps_per_device", "tps_total", "tflops", "mfu", "peak_memory_gib", "step_time_s", "data_share",
           "overhead_pct"]


def table(results: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in results:
        cells = [f"{r[c]:,.3f}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = [r["name"] for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    left.bar(names, [r["tps_per_device"] for r in results], color="tab:blue")
    left.set_ylabel("tokens/s per device")
    right.bar(names, [r["mfu"] for r in results], color="tab:orange")
    right.set_ylabel("MFU %")
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--only", nargs="*", help="run only these names of the preset")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the averages (compile, allocator)")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "benchmark")
    parser.add_argument("--overhead-repeats", type=int, default=3, help="trainer/bare-loop pairs for the overhead")
    parser.add_argument("--profile", action="store_true", help="profile each run's last step: its 15 costliest kernels")
    parser.add_argument("--budget-s", type=float, default=0, help="start no run after this many seconds (0: no limit)")
    parser.add_argument("--dry-run", action="store_true", help="check each run's command in one process (fake backend)")
    parser.add_argument("--bare-loop", help=argparse.SUPPRESS)  # internal: JSON args of one bare-loop measurement
    args = parser.parse_args()
    if args.bare_loop:
        spec = json.loads(args.bare_loop)
        print(json.dumps({"bare_step_time_s": bare_loop(spec["args"], spec["steps"], spec["warmup"])}))
        return
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} must be below --steps {args.steps}")

    shape, threads, runs = PRESETS[args.preset]
    runs = [r for r in runs if not args.only or r.name in args.only]
    tokenizer, dataset = gpu_inputs(args.out) if args.preset.startswith("gpu") else cpu_inputs(args.out)
    about = device_description() | {"preset": args.preset, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    results, failed, started = [], [], time.monotonic()
    for i, run in enumerate(runs, 1):
        left = args.budget_s - (time.monotonic() - started) if args.budget_s else None
        if left is not None and left <= 0:
            print(f"budget of {args.budget_s:.0f} s spent: not run: {', '.join(r.name for r in runs[i - 1:])}", flush=True)
            break
        folder = args.out / args.preset / run.name
        print(f"[{i}/{len(runs)}] {run.name}: {run.nproc} process(es) {' '.join(run.overrides)}", flush=True)
        # Profiled: two more steps (the profiler's warm-up and recorded ones), out of the averages.
        steps = args.steps + (2 if args.profile else 0)
        targs = trainer_args(shape, run, tokenizer, dataset, steps, folder) + (profiling(steps) if args.profile else [])
        if args.dry_run:
            dry_run(run, targs, folder)
            continue
        # threads: the CPU's cores split over the ranks (2 cores: 2 for one rank, 1 each for more).
        per_rank = max(1, threads // run.nproc) if threads else None
        try:  # a failed (or out-of-budget) run is reported, and the next one runs
            run_trainer(run.nproc, targs, per_rank, log=folder / "train.log", timeout=left)
        except RuntimeError as e:
            print(f"    FAILED: {str(e).splitlines()[0]} (its log: {folder / 'train.log'})", flush=True)
            failed.append(run.name)
            continue
        measured = read_metrics(folder)[: args.steps]
        row = about | summarize(run, measured, args.warmup) | {"attention": attention_kernels(folder / "train.log")}
        if args.profile:
            row["top_kernels"] = top_kernels(folder)
        if run.bare:
            row |= overhead(targs, row["step_time_s"], run, per_rank, args)
        print(f"    {row['tps_per_device']:,.0f} tokens/s per device, MFU {row['mfu']:.2f}%, "
              f"peak {row['peak_memory_gib']:.2f} GiB" + (f", overhead {row['overhead_pct']:+.1f}%" if run.bare else "")
              + f"; attention: {row['attention']}", flush=True)
        results.append(row)
        with open(args.out / "results.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    if failed:
        print(f"failed: {', '.join(failed)}", flush=True)
    if args.dry_run or not results:
        sys.exit(1 if failed else 0)
    every = [json.loads(line) for line in open(args.out / "results.jsonl")]
    with open(args.out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted({k for r in every for k in r}))
        writer.writeheader()
        writer.writerows(every)
    print(f"\n{about['device']}, torch {about['torch']}, preset {args.preset}, {args.steps} steps ({args.warmup} warm-up)\n")
    print(table(results))
    plot(results, args.out / f"results_{args.preset}.png", f"titanlite {args.preset} preset on {about['device']}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
