"""Llama 3's Hugging Face mapping: LlamaForCausalLM's names, config.json and RoPE layout.

titanlite (like Meta's Llama) rotates consecutive pairs of each head for RoPE; Hugging Face's
models rotate the two halves. The q and k projections (and the q/k head norms, where a model has
them) are permuted accordingly. The files themselves: titanlite/checkpoint/hf.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch

from titanlite.checkpoint.hf import SHARD_BYTES, check_config_values, hf_tensors, read_hf_config, write_shards
from titanlite.models.common.args import ModelArgs

LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
HF_LAYER_NAMES = {v: k for k, v in LAYER_NAMES.items()}
TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
HF_TOP_NAMES = {v: k for k, v in TOP_NAMES.items()}
LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def pairs_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows = w.shape[0]
    return w.view(heads, rows // heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def halves_to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows = w.shape[0]
    return w.view(heads, 2, rows // heads // 2, -1).transpose(1, 2).reshape(w.shape)


def rotary_heads(name: str, n_heads: int, n_kv_heads: int) -> int | None:
    """Heads of a tensor along RoPE's rotated dim (q and k rows and their biases, the q/k head norms),
    which the two layouts order differently."""
    return {"attention.wq.weight": n_heads, "attention.wk.weight": n_kv_heads, "attention.wq.bias": n_heads,
            "attention.wk.bias": n_kv_heads, "attention.q_norm.weight": 1, "attention.k_norm.weight": 1}.get(name)


def to_hf_tensors(name: str, w: torch.Tensor, args: ModelArgs, layer_names: dict = LAYER_NAMES) -> list[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor in its layout) of one titanlite tensor; a tied output none (the
    embedding is saved, and transformers ties lm_head to it)."""
    if name == "output.weight" and args.tie_embeddings:
        return []
    if name in TOP_NAMES:
        return [(TOP_NAMES[name], w)]
    layer, rest = LAYER.match(name).groups()
    if heads := rotary_heads(rest, args.n_heads, args.n_kv_heads):
        w = pairs_to_halves(w, heads)
    return [(f"model.layers.{layer}.{layer_names[rest]}", w)]


def from_hf_tensor(name: str, w: torch.Tensor, n_heads: int, n_kv_heads: int,
                   hf_layer_names: dict = HF_LAYER_NAMES) -> tuple[str, torch.Tensor] | None:
    """(titanlite name, tensor in its layout) of one Hugging Face tensor; None for tensors titanlite
    has no parameter for (e.g. rotary inv_freq buffers of old exports)."""
    if name in HF_TOP_NAMES:
        return HF_TOP_NAMES[name], w
    match = HF_LAYER.match(name)
    if not match or match.group(2) not in hf_layer_names:
        return None
    layer, rest = match.group(1), hf_layer_names[match.group(2)]
    if heads := rotary_heads(rest, n_heads, n_kv_heads):
        w = halves_to_pairs(w, heads)
    return f"layers.{layer}.{rest}", w


def transformer_config(args: ModelArgs, dtype: torch.dtype) -> dict:
    """The config.json keys of a Llama-layout decoder (Qwen3-MoE's too)."""
    return {
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": args.tie_embeddings,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def hf_config(args: ModelArgs, dtype: torch.dtype) -> dict:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "mlp_bias": False} | transformer_config(args, dtype)
    if args.rope_scaling:
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": args.rope_scaling_factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": args.rope_high_freq_factor,
            "original_max_position_embeddings": 8192,
        }
    return config


def expected_config(args: ModelArgs, config: dict) -> dict:
    """config.json key -> (the model's value, what the key means when a config leaves it out)."""
    return {
        "hidden_size": (args.dim, None), "num_hidden_layers": (args.n_layers, None),
        "num_attention_heads": (args.n_heads, None), "num_key_value_heads": (args.n_kv_heads, config["num_attention_heads"]),
        "intermediate_size": (args.ffn_hidden_dim, None), "vocab_size": (args.vocab_size, None),
        "tie_word_embeddings": (args.tie_embeddings, False),
    }


# ---- the adapter the checkpointer calls (ParallelPlan.hf) ----


def save_hf(read, sizes: dict[str, int], args: ModelArgs, folder: Path, dtype: torch.dtype, shard_bytes: int = SHARD_BYTES) -> None:
    """Write weights as Hugging Face safetensors + config.json (titanlite/checkpoint/hf.py's write_shards)."""
    write_shards(read, sizes, folder, dtype, lambda name, w: to_hf_tensors(name, w, args), hf_config(args, dtype), shard_bytes)


def check_hf_shapes(config: dict, args: ModelArgs, folder: Path) -> None:
    """ConfigError naming the first config.json value that differs from the model being trained."""
    check_config_values(config, expected_config(args, config), folder)


def iter_hf(folder: Path, read: Callable = hf_tensors):
    """(titanlite name, tensor) of each weight in a Hugging Face folder, one tensor in memory at a time."""
    _, heads, kv_heads = read_hf_config(folder)
    for key, tensor in read(folder):
        if converted := from_hf_tensor(key, tensor, heads, kv_heads):
            yield converted
