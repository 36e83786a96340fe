"""Choose a layout before spending GPU hours: memory per GPU and step time of every candidate.

    python scripts/plan.py --model 70B --gpu H100 --gpus 256 --seq-len 8192 --global-batch 512
    python scripts/plan.py --model 405B --gpu H200 --gpus 512 --float8 --top 10
    python scripts/plan.py --dims 12288,96,96,8 --vocab 50304 --gpu H100 --gpus 1024 --seq-len 2048 --global-batch 1536
    python scripts/plan.py --model 8B --gpu H100 --gpus 8 --layout dp_shard=8,ac=op   # one layout, estimated
    python scripts/plan.py --model deepseek_v3_671B --gpu H100 --gpus 1024 --seq-len 4096 --global-batch 8192
    python scripts/plan.py --model llama4_17bx128e --gpu GB200 --gpus 256 --global-batch 1024
    python scripts/plan.py --model qwen3_8B --gpu H100 --gpus 8 --seq-len 4096 --global-batch 64

Ranks the layouts that fit by estimated step time and explains the winner against the nearest
alternatives (see titanlite/planner/cost_model.py for the model and its constants; docs/planner.md for how
its predictions compare with published runs).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields, replace

from pathlib import Path

from titanlite.hardware import GPUS, find_gpu
from titanlite.models import FAMILIES
from titanlite.models.common.args import ModelArgs
from titanlite.planner import FITTED, GIB, Layout, breakdown, estimate, explain, fit_constants, plan, published_runs, run_command
from titanlite.planner.command import stage_split

REPO = Path(__file__).resolve().parent.parent


# plan.py's model names: (family, flavor) of titanlite's published shapes.
MODELS = {prefix + flavor: (family, flavor)
          for family, prefix in (("llama3", ""), ("qwen3", "qwen3_"), ("moe", ""), ("deepseek_v3", "deepseek_v3_"), ("llama4", "llama4_"), ("gpt_oss", "gpt_oss_"))
          for flavor in FAMILIES[family].flavors if "debug" not in flavor}
PUBLISHED = REPO / "docs" / "published_runs.jsonl"


def published_table(runs) -> str:
    """The planner's predictions for the published runs, next to what they measured, and the errors."""
    lines = ["| id | run | layout | predicted GiB/GPU | predicted tok/s/GPU | measured tok/s/GPU | error | |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        e = r.estimate()
        role = f"not counted: {r.excluded}" if r.excluded else "held out" if r.holdout else "fitted"
        lines.append(f"| {r.id} | {r.name} | {r.layout.describe()} | {e.memory_total / GIB:.0f}{'' if e.fits else ' (over)'} | "
                     f"{e.tokens_per_second_per_gpu:,.0f} | {r.tokens_per_second_per_gpu:,.0f} | {100 * r.error:+.1f}% | {role} |")
    counted = [r for r in runs if not r.excluded]
    for label, group in (("all", counted), ("fitted", [r for r in counted if not r.holdout]),
                         ("held out", [r for r in counted if r.holdout])):
        errors = [abs(r.error) for r in group]
        lines.append(f"\n{label}: {len(group)} runs, mean absolute error {100 * sum(errors) / len(errors):.1f}%, "
                     f"worst {100 * max(errors):.1f}%")
    return "\n".join(lines)


def parse_layout(text: str) -> Layout:
    kinds = {f.name: f.type for f in fields(Layout)}
    values = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key not in kinds:
            raise SystemExit(f"plan.py: --layout key '{key}' unknown; use {', '.join(kinds)}")
        values[key] = value if key == "ac" else (value.lower() == "true" if kinds[key] in ("bool", bool) else int(value))
    return Layout(**values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="8B")
    parser.add_argument("--dims", help="dim,layers,heads,kv_heads instead of --model (ffn = Llama's rule)")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--gpu", default="H100", help=f"one of {', '.join(g.name for g in GPUS)}")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (run_train.sh's NGPU)")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--global-batch", type=int, default=0, help="sequences per step (default: 2 per GPU)")
    parser.add_argument("--float8", action=argparse.BooleanOptionalAction, default=None,
                        help="only float8 (--float8) or only bf16 (--no-float8) layouts; default both")
    parser.add_argument("--optimizer", choices=("AdamW", "Muon"), default="AdamW",
                        help="Muon keeps one buffer per hidden matrix's parameter, AdamW two")
    parser.add_argument("--layout", help="estimate one layout, e.g. dp_shard=8,tp=2,ac=op,microbatch=1")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--published", action="store_true", help="predictions for the published runs (docs/planner.md)")
    parser.add_argument("--fit", action="store_true",
                        help="fit the planner's constants to the published runs not held out; print them and the errors")
    parser.add_argument("--restarts", type=int, default=0,
                        help="with --fit: also descend from this many seeded perturbed starts, keeping the best")
    parser.add_argument("--runs", type=Path, default=PUBLISHED, help="the published runs (JSON lines)")
    args = parser.parse_args()
    if args.published or args.fit:
        runs = published_runs(args.runs)
        if args.fit:
            fitted = fit_constants([r for r in runs if not r.excluded and not r.holdout], restarts=args.restarts)
            print("fitted (set these in titanlite/planner/cost_model.py):")
            for name in FITTED:
                value = fitted[name]
                print(f"  {name} = {({k: round(v, 3) for k, v in value.items()} if isinstance(value, dict) else round(value, 3))}")
        print(published_table(runs))
        return 0
    gpu = find_gpu(args.gpu)
    if gpu is None:
        print(f"plan.py: --gpu '{args.gpu}' unknown; use one of {', '.join(g.name for g in GPUS)}", file=sys.stderr)
        return 2
    if args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:
        print(f"plan.py: --gpus {args.gpus} is not whole nodes of --gpus-per-node {args.gpus_per_node}", file=sys.stderr)
        return 2
    if args.dims:
        dim, layers, heads, kv = map(int, args.dims.split(","))
        model = ModelArgs(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv, vocab_size=args.vocab)
        # Trained as Llama 3 8B's flavor (ModelArgs' defaults: its FFN rule) with these shapes.
        name, flavor, overrides = "llama3", "8B", (f"dim={dim}", f"n_heads={heads}", f"n_kv_heads={kv}")
    else:
        (name, flavor), overrides, layers = MODELS[args.model], (), 0
        model = FAMILIES[name].flavors[flavor]
    global_batch = args.global_batch or 2 * args.gpus

    def command(layout: Layout) -> str:
        nodes = f"on each of the {layout.gpus // args.gpus_per_node} nodes, with NODE_RANK and RDZV_ENDPOINT=host:port set" \
            if layout.gpus > args.gpus_per_node else "on this node"
        vocab = f"; the vocabulary is the flavor's {FAMILIES[name].flavors[flavor].vocab_size}, not --vocab" \
            if args.dims and args.vocab != FAMILIES[name].flavors[flavor].vocab_size else ""
        return (f"\nrun it ({nodes}{vocab}):\n"
                + run_command(layout, model, name, flavor, args.seq_len, global_batch, args.gpus_per_node, overrides, layers))

    print(f"{args.model if not args.dims else args.dims}: {model.num_params() / 1e9:.1f}B params; {args.gpus} x {gpu.name} "
          f"({gpu.hbm_bytes / GIB:.0f} GiB); seq {args.seq_len}, global batch {global_batch} sequences")
    if args.layout:
        layout = replace(parse_layout(args.layout), muon=args.optimizer == "Muon")
        if layout.gpus != args.gpus:
            print(f"plan.py: --layout uses {layout.gpus} GPUs, not --gpus {args.gpus}", file=sys.stderr)
            return 2
        e = estimate(model, args.seq_len, global_batch, gpu, layout)
        print(f"{layout.describe()}: {'fits' if e.fits else 'DOES NOT FIT'}; {e.tokens_per_second_per_gpu:,.0f} tokens/s per GPU, "
              f"MFU {100 * e.mfu:.1f}%\n  {breakdown(e)}")
        if layout.vp > 2 and not stage_split(model.n_layers, layout.pp * layout.vp):
            print(f"plan.py: titanlite cannot cut {model.n_layers} blocks into {layout.pp * layout.vp} stages "
                  "(pipeline_parallel_layers_per_stage and first/last_stage_less_layers); choose another vp", file=sys.stderr)
            return 2
        print(command(layout))
        return 0
    fitting, rejected = plan(model, args.seq_len, global_batch, gpu, args.gpus, args.float8, muon=args.optimizer == "Muon")
    print(f"{len(fitting)} layouts fit, {len(rejected)} do not\n")
    print(f"{'layout':<70} {'GiB/GPU':>8} {'step s':>8} {'tok/s/GPU':>10} {'MFU':>6}")
    for e in fitting[: args.top]:
        print(f"{e.layout.describe():<70} {e.memory_total / GIB:8.1f} {e.step_time:8.3f} "
              f"{e.tokens_per_second_per_gpu:10,.0f} {100 * e.mfu:5.1f}%")
    print()
    print("\n".join(explain(fitting, rejected, model, args.seq_len)))
    if fitting:
        print(command(fitting[0].layout))
    return 0


if __name__ == "__main__":
    sys.exit(main())
