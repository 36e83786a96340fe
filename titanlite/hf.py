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

SHARD_BYTES = 5 * 2**30  # the shard size transformers writes by default (5 GB)

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
HF_TOP_NAMES = {v: k for k, v in TOP_NAMES.items()}
HF_LAYER_NAMES = {v: k for k, v in LAYER_NAMES.items()}
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


def to_hf_tensor(name: str, w: torch.Tensor, n_heads: int, n_kv_heads: int) -> tuple[str, torch.Tensor]:
    """(Hugging Face name, tensor in its layout) of one titanlite parameter."""
    if name in TOP_NAMES:
        return TOP_NAMES[name], w
    layer, rest = LAYER.match(name).groups()
    if heads := rotary_heads(rest, n_heads, n_kv_heads):
        w = pairs_to_halves(w, heads)
    return f"model.layers.{layer}.{LAYER_NAMES[rest]}", w


def from_hf_tensor(name: str, w: torch.Tensor, n_heads: int, n_kv_heads: int) -> tuple[str, torch.Tensor] | None:
    """(titanlite name, tensor in its layout) of one Hugging Face tensor; None for tensors titanlite
    has no parameter for (e.g. rotary inv_freq buffers of old exports)."""
    if name in HF_TOP_NAMES:
        return HF_TOP_NAMES[name], w
    match = HF_LAYER.match(name)
    if not match or match.group(2) not in HF_LAYER_NAMES:
        return None
    layer, rest = match.group(1), HF_LAYER_NAMES[match.group(2)]
    if heads := rotary_heads(rest, n_heads, n_kv_heads):
        w = halves_to_pairs(w, heads)
    return f"layers.{layer}.{rest}", w


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


def save_hf(read, sizes: dict[str, int], args: ModelArgs, folder: Path, dtype: torch.dtype, shard_bytes: int = SHARD_BYTES) -> None:
    """Write weights as Hugging Face safetensors + config.json: one model.safetensors, or shards of at
    most `shard_bytes` with model.safetensors.index.json (as transformers writes them). `sizes` maps
    each titanlite name to its element count; `read(names)` returns those tensors, so only one
    shard's tensors are in memory at a time."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    shards, size = [[]], 0
    for name, numel in sizes.items():
        nbytes = numel * dtype.itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map = {}
    for i, names in enumerate(shards, 1):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = dict(to_hf_tensor(n, w, args.n_heads, args.n_kv_heads) for n, w in read(names).items())
        save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    if len(shards) > 1:
        total = sum(sizes.values()) * dtype.itemsize
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
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


def read_hf_config(folder: Path) -> tuple[dict, int, int]:
    """(config.json, attention heads, kv heads) of a Hugging Face model folder."""
    config = json.loads((folder / "config.json").read_text())
    heads = config["num_attention_heads"]
    return config, heads, config.get("num_key_value_heads", heads)


def iter_hf(folder: Path):
    """(titanlite name, tensor) of each weight in a Hugging Face folder, one tensor in memory at a time."""
    from safetensors import safe_open

    _, heads, kv_heads = read_hf_config(folder)
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if converted := from_hf_tensor(key, f.get_tensor(key), heads, kv_heads):
                    yield converted


def load_hf(folder: Path) -> dict:
    """Every weight of a Hugging Face folder as a titanlite state dict (scripts/convert_hf.py from-hf)."""
    return dict(iter_hf(folder))
