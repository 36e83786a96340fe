"""Convert checkpoints between titanlite (DCP) and Hugging Face (safetensors + config.json): Llama 3
as LlamaForCausalLM, the MoE family's Qwen3-MoE flavors as Qwen3MoeForCausalLM, DeepSeek-V3 as
DeepseekV3ForCausalLM, Llama 4 as Llama4ForCausalLM (--model llama4 --flavor 17bx16e).

    python scripts/convert_hf.py to-hf outputs/run/checkpoint/step-1000 hf_out --flavor 8B [--dtype bfloat16]
    python scripts/convert_hf.py to-hf outputs/moe/checkpoint/step-1000 hf_out --model moe --flavor qwen3_30b_a3b
    python scripts/convert_hf.py from-hf path/to/Llama-3.1-8B outputs/run/checkpoint/step-0

to-hf writes model.safetensors (or 5 GB shards and an index) and config.json that transformers
loads (copy the tokenizer files next to them yourself). from-hf writes a DCP checkpoint to start a run from:
`--checkpoint.initial_load_path outputs/run/checkpoint/step-0`. One process, CPU, weights only.
"""

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from titanlite.checkpoint.checkpointer import write_hf
from titanlite.checkpoint.reader import read_tensor_metadata
from titanlite.config import ConfigError
from titanlite.models.hf import load_hf
from titanlite.models import FAMILIES


def to_hf(args) -> None:
    found = read_tensor_metadata(args.checkpoint, {"model"})
    metadata = found[1]
    shapes = {k.removeprefix("model."): tuple(m.size) for k, m in metadata.items() if k.startswith("model.")}
    vocab, dim = shapes["tok_embeddings.weight"]
    n_layers = 1 + max(int(k.split(".")[1]) for k in shapes if k.startswith("layers."))
    flavors = FAMILIES[args.model].flavors
    if args.flavor not in flavors:
        raise SystemExit(f"--flavor {args.flavor} is not a flavor of --model {args.model}; choose one of: {', '.join(flavors)}")
    model_args = replace(flavors[args.flavor], vocab_size=vocab, max_seq_len=args.max_seq_len)
    if (model_args.dim, model_args.n_layers) != (dim, n_layers):
        raise SystemExit(f"--flavor {args.flavor} has dim {model_args.dim} x {model_args.n_layers} layers; the checkpoint has {dim} x {n_layers}")
    write_hf(args.checkpoint, args.out, model_args, getattr(torch, args.dtype), FAMILIES[args.model].plan.hf, found=found)
    print(f"wrote {args.out} (safetensors and config.json)")


def from_hf(args) -> None:
    state = load_hf(args.hf_folder)
    dcp.save({"model": {k: v.float() for k, v in state.items()}}, checkpoint_id=str(args.out), no_dist=True)
    print(f"wrote DCP checkpoint {args.out} ({len(state)} tensors); start a run with --checkpoint.initial_load_path {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    out = sub.add_parser("to-hf", help="DCP checkpoint -> Hugging Face folder")
    out.add_argument("checkpoint", type=Path)
    out.add_argument("out", type=Path)
    out.add_argument("--model", default="llama3", choices=sorted(FAMILIES), help="the model family (model.name)")
    out.add_argument("--flavor", default="debugmodel", help="its flavor (model.flavor)")
    out.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    out.add_argument("--max-seq-len", type=int, default=8192)
    back = sub.add_parser("from-hf", help="Hugging Face folder -> DCP checkpoint")
    back.add_argument("hf_folder", type=Path)
    back.add_argument("out", type=Path)
    args = parser.parse_args()
    try:
        to_hf(args) if args.command == "to-hf" else from_hf(args)
    except ConfigError as e:
        print(f"convert_hf: {e}", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
