"""Hugging Face Llama format <-> titanlite names: safetensors + config.json, loadable by transformers.

titanlite (like Meta's Llama) rotates consecutive pairs of each head for RoPE; Hugging Face's
LlamaForCausalLM rotates the two halves. The q and k projections are permuted accordingly.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from titanlite.models.args import ModelArgs

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
}
TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def pairs_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def halves_to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def rotary_heads(name: str, n_heads: int, n_kv_heads: int) -> int | None:
    """Heads of a projection whose output RoPE rotates (q and k), whose rows the two layouts order differently."""
    return {"attention.wq.weight": n_heads, "attention.wk.weight": n_kv_heads}.get(name)


def to_hf(state: dict, n_heads: int, n_kv_heads: int) -> dict:
    out = {}
    for name, w in state.items():
        if name in TOP_NAMES:
            out[TOP_NAMES[name]] = w
            continue
        layer, rest = LAYER.match(name).groups()
        if heads := rotary_heads(rest, n_heads, n_kv_heads):
            w = pairs_to_halves(w, heads)
        out[f"model.layers.{layer}.{LAYER_NAMES[rest]}"] = w
    return out


def from_hf(state: dict, n_heads: int, n_kv_heads: int) -> dict:
    top = {v: k for k, v in TOP_NAMES.items()}
    layer_names = {v: k for k, v in LAYER_NAMES.items()}
    out = {}
    for name, w in state.items():
        if name in top:
            out[top[name]] = w
            continue
        match = HF_LAYER.match(name)
        if not match or match.group(2) not in layer_names:
            continue  # e.g. rotary inv_freq buffers of old exports
        layer, rest = match.group(1), layer_names[match.group(2)]
        if heads := rotary_heads(rest, n_heads, n_kv_heads):
            w = halves_to_pairs(w, heads)
        out[f"layers.{layer}.{rest}"] = w
    return out


def hf_config(args: ModelArgs, dtype: torch.dtype) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
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
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if args.rope_scaling:
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    return config


def save_hf(state: dict, args: ModelArgs, folder: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    hf = {k: v.to(dtype).contiguous() for k, v in to_hf(state, args.n_heads, args.n_kv_heads).items()}
    save_file(hf, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_config(args, dtype), indent=2))


def check_hf_shapes(config: dict, args: ModelArgs, folder: Path) -> None:
    """ConfigError naming the first HF config.json value that differs from the model being trained."""
    from titanlite.config import ConfigError

    expected = {
        "hidden_size": args.dim, "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "intermediate_size": args.ffn_hidden_dim, "vocab_size": args.vocab_size,
    }
    for key, value in expected.items():
        found = config.get(key, config["num_attention_heads"] if key == "num_key_value_heads" else None)
        if found != value:
            raise ConfigError(
                f"Hugging Face checkpoint '{folder}' has {key}={found}, the model being trained {value}; choose the "
                "model.flavor (and tokenizer) the checkpoint was made for"
            )


def load_hf(folder: Path) -> tuple[dict, dict]:
    """(titanlite state dict, HF config) from a folder of *.safetensors + config.json."""
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    hf = {}
    for path in sorted(folder.glob("*.safetensors")):
        hf.update(load_file(str(path)))
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    return from_hf(hf, heads, kv_heads), config
