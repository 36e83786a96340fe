"""The MoE family's Hugging Face mapping: its Qwen3-MoE flavors as Qwen3MoeForCausalLM.

Llama 3's names and RoPE layout (models/llama3/hf.py) plus the router and the routed experts, which
are one (experts, out, in) tensor per projection here and one Linear weight per expert there (the
Hub's layout, which transformers merges on load). Dense blocks are Qwen3-MoE's `mlp_only_layers`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch

from titanlite.checkpoint.hf import SHARD_BYTES, check_config_values, no_expert_bias, hf_tensors, read_hf_config, write_shards
from titanlite.models.common.args import MoEArgs
from titanlite.models.llama3 import hf as llama3_hf
from titanlite.models.moe.args import check_hf_exportable
from titanlite.models.qwen3 import hf as qwen3_hf

LAYER_NAMES = llama3_hf.LAYER_NAMES | {"feed_forward.router.gate.weight": "mlp.gate.weight"}
HF_LAYER_NAMES = {v: k for k, v in LAYER_NAMES.items()}
EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
HF_EXPERT_NAMES = {v: k for k, v in EXPERT_NAMES.items()}
EXPERTS = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(w[123])$")
HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
EXPERT_BIAS = re.compile(r"^layers\.\d+\.feed_forward\.expert_bias$")


def to_hf_tensors(name: str, w: torch.Tensor, args: MoEArgs) -> list[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor in its layout) of one titanlite tensor: one per expert for routed
    experts, none for a zero expert bias (Qwen3-MoE has none)."""
    if EXPERT_BIAS.match(name):
        return no_expert_bias(name, w, "Qwen3MoeForCausalLM")
    if match := EXPERTS.match(name):
        layer, projection = match.group(1), EXPERT_NAMES[match.group(2)]
        return [(f"model.layers.{layer}.mlp.experts.{e}.{projection}.weight", w[e]) for e in range(w.shape[0])]
    return llama3_hf.to_hf_tensors(name, w, args, LAYER_NAMES)


def num_experts(config: dict) -> int | None:
    """The Hub's Qwen3-MoE configs say num_experts; transformers 5 writes num_local_experts."""
    return config.get("num_experts", config.get("num_local_experts"))


def hf_config(args: MoEArgs, dtype: torch.dtype) -> dict:
    """Qwen3MoeForCausalLM's config of a MoE flavor of its architecture (dense blocks as mlp_only_layers)."""
    check_hf_exportable(args)
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": args.moe_hidden_dim,
        "num_experts": args.num_experts,
        "num_experts_per_tok": args.top_k,
        "norm_topk_prob": args.route_norm,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(args.n_dense_layers)),
    } | qwen3_hf.transformer_config(args, dtype)


# ---- the adapter the checkpointer calls (ParallelPlan.hf) ----


def save_hf(read, sizes: dict[str, int], args: MoEArgs, folder: Path, dtype: torch.dtype, shard_bytes: int = SHARD_BYTES) -> None:
    """Write weights as Hugging Face safetensors + config.json (titanlite/checkpoint/hf.py's write_shards)."""
    write_shards(read, sizes, folder, dtype, lambda name, w: to_hf_tensors(name, w, args), hf_config(args, dtype), shard_bytes)


def check_hf_shapes(config: dict, args: MoEArgs, folder: Path) -> None:
    """ConfigError naming the first config.json value that differs from the model being trained."""
    expected = qwen3_hf.expected_config(args, config) | {
        "num_experts": (args.num_experts, None), "num_experts_per_tok": (args.top_k, None),
        "moe_intermediate_size": (args.moe_hidden_dim, None),
        "norm_topk_prob": (args.route_norm, False), "mlp_only_layers": (list(range(args.n_dense_layers)), []),
        "decoder_sparse_step": (1, 1),  # every block from n_dense_layers on is a MoE block
    }
    check_config_values(config | {"num_experts": num_experts(config)}, expected, folder)


def iter_hf(folder: Path, read: Callable = hf_tensors):
    """(titanlite name, tensor) of each weight, one tensor in memory at a time (routed experts: one
    projection of one layer, gathered from its experts' weights), and a zero expert bias per MoE
    block: Qwen3-MoE routes without one (ours starts, and for export stays, at zero)."""
    config, heads, kv_heads = read_hf_config(folder)
    gathering: dict[str, dict[int, torch.Tensor]] = {}
    for key, tensor in read(folder):
        if expert := HF_EXPERT.match(key):
            layer, index, projection = expert.groups()
            name = f"layers.{layer}.feed_forward.experts.{HF_EXPERT_NAMES[projection]}"
            gathered = gathering.setdefault(name, {})
            gathered[int(index)] = tensor
            if len(gathered) == num_experts(config):
                yield name, torch.stack([gathered[e] for e in range(len(gathered))])
                del gathering[name]
        elif converted := llama3_hf.from_hf_tensor(key, tensor, heads, kv_heads, HF_LAYER_NAMES):
            yield converted
    if num_experts(config):
        dense = set(config.get("mlp_only_layers") or [])
        for layer in range(config["num_hidden_layers"]):
            if layer not in dense:
                yield f"layers.{layer}.feed_forward.expert_bias", torch.zeros(num_experts(config))
