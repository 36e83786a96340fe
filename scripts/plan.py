"""Choose a layout before spending GPU hours: memory per GPU and step time of every candidate.

    python scripts/plan.py --model 70B --gpu H100 --gpus 256 --seq-len 8192 --global-batch 512
    python scripts/plan.py --model 405B --gpu H200 --gpus 512 --float8 --top 10
    python scripts/plan.py --dims 12288,96,96,8 --vocab 50304 --gpu H100 --gpus 1024 --seq-len 2048 --global-batch 1536
    python scripts/plan.py --model 8B --gpu H100 --gpus 8 --layout dp_shard=8,ac=op   # one layout, estimated

Ranks the layouts that fit by estimated step time and explains the winner against the nearest
alternatives (see titanlite/planner.py for the model and its constants; docs/planner.md for how
its predictions compare with published runs).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from titanlite.hardware import GPUS, find_gpu
from titanlite.models.args import LLAMA3_FLAVORS, MOE_FLAVORS, ModelArgs
from titanlite.planner import GIB, Layout, breakdown, estimate, explain, plan


# Megatron's data parallel (distributed optimizer: one gradient reduce-scatter and one parameter
# all-gather per step, not per microbatch) is modelled as dp_replicate: one all-reduce per step.
def gpt(dim: int, layers: int, heads: int) -> ModelArgs:
    """Megatron's GPT shapes as Llama args: MHA and an 8/3-wide SwiGLU have GPT's 4d^2 + 8d^2 weights per block."""
    return ModelArgs(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=heads, vocab_size=131072, multiple_of=256,
                     ffn_dim_multiplier=None)


L3, MOE = LLAMA3_FLAVORS, MOE_FLAVORS
FLAVORS = {name: args for name, args in (L3 | MOE).items() if "debug" not in name}
# (source, model, seq, global batch, GPU, layout, measured tokens/s per GPU or None, measured MFU or None)
PUBLISHED = [
    ("TorchTitan 8B, 8 GPU, compile, SAC", L3["8B"], 8192, 16, "H100", Layout(dp_shard=8, microbatch=2, ac="op"), 6667, None),
    ("TorchTitan 8B, 8 GPU, compile, SAC, float8", L3["8B"], 8192, 16, "H100",
     Layout(dp_shard=8, microbatch=2, ac="op", float8=True), 8532, None),
    ("TorchTitan 8B, 128 GPU, compile, SAC", L3["8B"], 8192, 256, "H100", Layout(dp_shard=128, microbatch=2, ac="op"), 6514, None),
    ("TorchTitan 8B, 128 GPU, compile, SAC, float8", L3["8B"], 8192, 256, "H100",
     Layout(dp_shard=128, microbatch=2, ac="op", float8=True), 8380, None),
    ("TorchTitan 70B, 256 GPU FSDP32 TP8, float8, full AC", L3["70B"], 8192, 512, "H100",
     Layout(dp_shard=32, tp=8, microbatch=16, ac="full", float8=True), 829, None),
    ("TorchTitan 405B, 512 GPU FSDP8 TP8 PP8 1F1B, float8, full AC", L3["405B"], 8192, 256, "H100",
     Layout(dp_shard=8, tp=8, pp=8, microbatch=1, ac="full", float8=True), 100, None),
    ("TorchTitan 8B, 8 H200 x 4 nodes, float8, SAC", L3["8B"], 8192, 64, "H200",
     Layout(dp_shard=32, microbatch=2, ac="op", float8=True), 10938, None),
    ("Megatron GPT 1.7B, TP1 DP48", gpt(2048, 24, 16), 4096, 192, "H100", Layout(dp_replicate=48, microbatch=1, ac="op"), None, 0.41),
    ("Megatron GPT 7.1B, TP2 DP48", gpt(4096, 30, 32), 4096, 192, "H100", Layout(dp_replicate=48, tp=2, microbatch=1, ac="op"), None, 0.47),
    ("Megatron GPT 16B, TP4 DP48", gpt(6144, 32, 48), 4096, 192, "H100", Layout(dp_replicate=48, tp=4, microbatch=1, ac="op"), None, 0.49),
    ("Megatron GPT 32B, TP8 DP48", gpt(7168, 48, 56), 4096, 192, "H100", Layout(dp_replicate=48, tp=8, microbatch=1, ac="op"), None, 0.46),
    ("Megatron GPT 70B, TP8 PP2 DP48", gpt(8192, 84, 64), 4096, 384, "H100",
     Layout(dp_replicate=48, tp=8, pp=2, microbatch=1, ac="op"), None, 0.42),
    ("Megatron GPT 177B, TP8 PP6 DP48", gpt(12288, 96, 96), 4096, 1152, "H100",
     Layout(dp_replicate=48, tp=8, pp=6, microbatch=1, ac="op"), None, 0.44),
    # Mixture of experts, sequence 4096, with force-balanced routing as these benchmarks state. Sources:
    # NVIDIA-NeMo/Automodel docs/performance-summary.mdx (Qwen3 MoE 30B row) and NVIDIA-NeMo/Megatron-Bridge
    # docs/performance-summary-archive.md, 26.04.01 container (DGX-H100 rows of Qwen3-30B-A3B and Qwen3-235B-A22B).
    ("Automodel Qwen3-30B-A3B, 8 GPU FSDP8 EP8", MOE["qwen3_30b_a3b"], 4096, 512, "H100",
     Layout(dp_shard=8, ep=8, microbatch=4, ac="none"), 12040, None),
    ("Megatron-Bridge Qwen3-30B-A3B, 16 GPU EP16, fp8", MOE["qwen3_30b_a3b"], 4096, 1024, "H100",
     Layout(dp_shard=16, ep=16, microbatch=1, ac="none", float8=True), 8960, None),
    ("Megatron-Bridge Qwen3-235B-A22B, 256 GPU TP2 PP8 EP32, fp8", MOE["qwen3_235b_a22b"], 4096, 8192, "H100",
     Layout(dp_shard=16, tp=2, pp=8, ep=32, microbatch=1, ac="none", float8=True), 1712, None),
]


def published_table() -> str:
    """The planner's predictions for published runs, next to what they measured."""
    lines = ["| run | layout | predicted GiB/GPU | predicted tok/s/GPU | measured tok/s/GPU | predicted MFU | measured MFU | error |",
             "|---|---|---|---|---|---|---|---|"]
    for name, model, seq, batch, gpu_name, layout, tps, mfu in PUBLISHED:
        e = estimate(model, seq, batch, find_gpu(gpu_name), layout)
        if tps:
            error = f"{100 * (e.tokens_per_second_per_gpu / tps - 1):+.0f}% tok/s"
        else:
            error = f"{100 * (e.mfu / mfu - 1):+.0f}% MFU"
        lines.append(f"| {name} | {layout.describe()} | {e.memory_total / GIB:.0f} | {e.tokens_per_second_per_gpu:,.0f} | "
                     f"{f'{tps:,}' if tps else '-'} | {100 * e.mfu:.0f}% | {f'{100 * mfu:.0f}%' if mfu else '-'} | {error} |")
    return "\n".join(lines)


def parse_layout(text: str) -> Layout:
    kinds = {f.name: f.type for f in fields(Layout)}
    values = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key not in kinds:
            raise SystemExit(f"plan.py: --layout key '{key}' unknown; use {', '.join(kinds)}")
        values[key] = value if key == "ac" else (value.lower() == "true" if key == "float8" else int(value))
    return Layout(**values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(FLAVORS), default="8B")
    parser.add_argument("--dims", help="dim,layers,heads,kv_heads instead of --model (ffn = Llama's rule)")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--gpu", default="H100", help=f"one of {', '.join(g.name for g in GPUS)}")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--global-batch", type=int, default=0, help="sequences per step (default: 2 per GPU)")
    parser.add_argument("--float8", action=argparse.BooleanOptionalAction, default=None,
                        help="only float8 (--float8) or only bf16 (--no-float8) layouts; default both")
    parser.add_argument("--layout", help="estimate one layout, e.g. dp_shard=8,tp=2,ac=op,microbatch=1")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--published", action="store_true", help="print predictions for published runs (docs/planner.md)")
    args = parser.parse_args()
    if args.published:
        print(published_table())
        return 0
    gpu = find_gpu(args.gpu)
    if gpu is None:
        print(f"plan.py: --gpu '{args.gpu}' unknown; use one of {', '.join(g.name for g in GPUS)}", file=sys.stderr)
        return 2
    if args.dims:
        dim, layers, heads, kv = map(int, args.dims.split(","))
        model = ModelArgs(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv, vocab_size=args.vocab)
    else:
        model = FLAVORS[args.model]
    global_batch = args.global_batch or 2 * args.gpus
    print(f"{args.model if not args.dims else args.dims}: {model.num_params() / 1e9:.1f}B params; {args.gpus} x {gpu.name} "
          f"({gpu.hbm_bytes / GIB:.0f} GiB); seq {args.seq_len}, global batch {global_batch} sequences")
    if args.layout:
        layout = parse_layout(args.layout)
        if layout.gpus != args.gpus:
            print(f"plan.py: --layout uses {layout.gpus} GPUs, not --gpus {args.gpus}", file=sys.stderr)
            return 2
        e = estimate(model, args.seq_len, global_batch, gpu, layout)
        print(f"{layout.describe()}: {'fits' if e.fits else 'DOES NOT FIT'}; {e.tokens_per_second_per_gpu:,.0f} tokens/s per GPU, "
              f"MFU {100 * e.mfu:.1f}%\n  {breakdown(e)}")
        return 0
    fitting, rejected = plan(model, args.seq_len, global_batch, gpu, args.gpus, args.float8)
    print(f"{len(fitting)} layouts fit, {len(rejected)} do not\n")
    print(f"{'layout':<70} {'GiB/GPU':>8} {'step s':>8} {'tok/s/GPU':>10} {'MFU':>6}")
    for e in fitting[: args.top]:
        print(f"{e.layout.describe():<70} {e.memory_total / GIB:8.1f} {e.step_time:8.3f} "
              f"{e.tokens_per_second_per_gpu:10,.0f} {100 * e.mfu:5.1f}%")
    print()
    print("\n".join(explain(fitting, rejected)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
