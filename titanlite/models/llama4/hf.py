"""Llama 4's Hugging Face mapping: Llama4ForCausalLM's names and config.json (the text model).

Llama 4 rotates consecutive pairs of each head (its apply_rotary_emb views them as complex numbers),
as titanlite does, so unlike Llama 3's mapping no q/k row is permuted. Routed experts are one tensor
per projection on both sides, stored there as (experts, in, out) with gate and up side by side in
one gate_up_proj (gate first); transformers loads them as stored (it has no weight conversion for
llama4). Llama 4 routes without an expert bias: export refuses a nonzero one, import gives zeros.
The files themselves: titanlite/checkpoint/hf.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch

from titanlite.checkpoint.hf import SHARD_BYTES, check_config_values, no_expert_bias, hf_tensors, read_hf_config, write_shards
from titanlite.models.llama3 import hf as llama3_hf
from titanlite.models.llama4.args import Llama4Args, check_hf_exportable
from titanlite.models.moe.hf import EXPERT_NAMES

LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.router.gate.weight": "feed_forward.router.weight",
} | {
    f"feed_forward.{ours}{part}.weight": f"feed_forward.{theirs}{proj}.weight"
    for ours, theirs in (("", ""), ("shared_experts.", "shared_expert."))  # the dense SwiGLU, the shared expert
    for part, proj in EXPERT_NAMES.items()
}
HF_LAYER_NAMES = {v: k for k, v in LAYER_NAMES.items()}
# Routed experts as the shard writer sees them: w1 and w3 joined into `gate_up` (one tensor there).
EXPERTS = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(gate_up|w2)$")
EXPERT_PROJECTIONS = {"gate_up": "gate_up_proj", "w2": "down_proj"}
EXPERT_BIAS = re.compile(r"^layers\.\d+\.feed_forward\.expert_bias$")


def to_hf_tensors(name: str, w: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor in its layout) of one titanlite tensor (routed experts: joined
    already, see joined_gate_up); none for a zero expert bias."""
    if EXPERT_BIAS.match(name):
        return no_expert_bias(name, w, "Llama4ForCausalLM")
    if name in llama3_hf.TOP_NAMES:
        return [(llama3_hf.TOP_NAMES[name], w)]
    if match := EXPERTS.match(name):
        layer, part = match.groups()
        return [(f"model.layers.{layer}.feed_forward.experts.{EXPERT_PROJECTIONS[part]}", w.transpose(1, 2))]
    layer, rest = llama3_hf.LAYER.match(name).groups()
    return [(f"model.layers.{layer}.{LAYER_NAMES[rest]}", w)]


def joined_gate_up(read, sizes: dict[str, int]):
    """(read, sizes) as the shard writer takes them, with each MoE block's routed w1 and w3 one entry,
    `...experts.gate_up` (experts, 2 * hidden, dim), so that a shard reads the two together."""
    def w1_w3(name: str) -> tuple[str, str]:
        base = name.removesuffix(".gate_up")
        return f"{base}.w1", f"{base}.w3"

    joined_sizes = {}
    for name, numel in sizes.items():
        if name.endswith(".experts.w1"):
            base = name.removesuffix(".w1")
            joined_sizes[f"{base}.gate_up"] = numel + sizes[f"{base}.w3"]
        elif not name.endswith(".experts.w3"):
            joined_sizes[name] = numel

    def read_joined(names: list[str]) -> dict[str, torch.Tensor]:
        gate_ups = [name for name in names if name.endswith(".experts.gate_up")]
        tensors = read([n for n in names if n not in gate_ups] + [w for name in gate_ups for w in w1_w3(name)])
        for name in gate_ups:
            w1, w3 = w1_w3(name)
            tensors[name] = torch.cat([tensors.pop(w1), tensors.pop(w3)], dim=1)
        return tensors

    return read_joined, joined_sizes


def config_json(args: Llama4Args, dtype: torch.dtype) -> dict:
    """Llama4ForCausalLM's config of the model. RoPE as Meta's release writes it (rope_theta and
    rope_scaling, which transformers 5 reads into rope_parameters); the MoE and NoPE blocks both as
    intervals and as the lists transformers derives from them."""
    n = args.n_layers
    rope_scaling = None
    if args.rope_scaling:  # titanlite's Llama 3.1 scaling: low_freq_factor 1, original context 8192 (common/rope.py)
        rope_scaling = {
            "rope_type": "llama3", "factor": args.rope_scaling_factor, "low_freq_factor": 1.0,
            "high_freq_factor": args.rope_high_freq_factor, "original_max_position_embeddings": 8192,
        }
    return {
        "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text",
        "hidden_size": args.dim, "intermediate_size": args.moe_hidden_dim, "intermediate_size_mlp": args.ffn_hidden_dim,
        "num_hidden_layers": n, "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim, "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta, "rope_scaling": rope_scaling,
        "num_local_experts": args.num_experts, "num_experts_per_tok": args.top_k,
        "interleave_moe_layer_step": args.interleave_moe_layer_step, "moe_layers": [i for i in range(n) if args.is_moe(i)],
        "no_rope_layer_interval": args.nope_layer_interval, "no_rope_layers": [int(args.uses_rope(i)) for i in range(n)],
        "attention_chunk_size": args.attention_chunk_size, "use_qk_norm": args.use_qk_norm,
        "attn_temperature_tuning": args.attn_temperature_tuning, "floor_scale": int(args.floor_scale),
        "attn_scale": args.attn_scale, "max_position_embeddings": args.max_seq_len, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch."),
    }


# transformers' Llama4TextConfig defaults, for keys a config.json leaves out.
DEFAULTS = {
    "head_dim": 128, "rms_norm_eps": 1e-5, "num_local_experts": 16, "num_experts_per_tok": 1, "use_qk_norm": True,
    "attention_chunk_size": 8192, "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
    "interleave_moe_layer_step": 1, "no_rope_layer_interval": 4,
}
SHAPES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size", "intermediate_size_mlp")


def as_transformers_reads(config: dict) -> dict:
    """What the model transformers builds from a config.json does, key by key: its defaults for keys left
    out, the MoE and NoPE layers from their intervals where the file lists none, RoPE from either
    format (rope_parameters, or Meta's rope_theta and rope_scaling)."""
    values = {key: config.get(key) for key in SHAPES}
    values |= {key: config[key] if key in config else default for key, default in DEFAULTS.items()}
    values["num_key_value_heads"] = config.get("num_key_value_heads") or config.get("num_attention_heads")
    values["attn_temperature_tuning"] = bool(values["attn_temperature_tuning"])  # early Scout exports say 4
    n = config.get("num_hidden_layers") or 0
    step, interval = values.pop("interleave_moe_layer_step"), values.pop("no_rope_layer_interval")  # as the lists
    values["moe_layers"] = list(config["moe_layers"] if config.get("moe_layers") is not None else range(step - 1, n, step))
    uses_rope = (config.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)])[:n]
    values["no_rope_layers"] = list(uses_rope)
    chunked = values["attention_chunk_size"] is not None
    derived_types = ["chunked_attention" if rope and chunked else "full_attention" for rope in uses_rope]
    values["layer_types"] = config.get("layer_types") or derived_types
    rope = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or rope
    values["rope_theta"] = config.get("rope_theta") or rope.get("rope_theta") or 500000.0
    values["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    if values["rope_type"] == "llama3":
        values |= {f"rope_scaling.{key}": scaling.get(key) for key in ("factor", "low_freq_factor", "high_freq_factor")}
        original = scaling.get("original_max_position_embeddings") or config.get("max_position_embeddings")
        values["rope_scaling.original_max_position_embeddings"] = original
    return values


# ---- the adapter the checkpointer calls (ParallelPlan.hf) ----


def save_hf(read, sizes: dict[str, int], args: Llama4Args, folder: Path, dtype: torch.dtype, shard_bytes: int = SHARD_BYTES) -> None:
    """Write weights as Hugging Face safetensors + config.json (titanlite/checkpoint/hf.py's write_shards)."""
    check_hf_exportable(args)
    read, sizes = joined_gate_up(read, sizes)
    write_shards(read, sizes, folder, dtype, to_hf_tensors, config_json(args, dtype), shard_bytes)


def check_hf_shapes(config: dict, args: Llama4Args, folder: Path) -> None:
    """ConfigError naming the first config.json value (as transformers reads it) that differs from the
    model being trained: its shapes, its blocks' kinds, attention, routing and RoPE (not
    max_position_embeddings: a run trains at its own sequence length)."""
    # floor_scale as the model has it: the config's integer would hide a fraction.
    ours = as_transformers_reads(config_json(args, torch.float32)) | {"floor_scale": args.floor_scale}
    check_config_values(as_transformers_reads(config), {key: (value, None) for key, value in ours.items()}, folder)


def iter_hf(folder: Path, read: Callable = hf_tensors):
    """(titanlite name, tensor) of each weight in a Hugging Face folder, one tensor in memory at a time
    (gate_up_proj: its two halves), and a zero expert bias per MoE block."""
    config, _, _ = read_hf_config(folder)
    for key, tensor in read(folder):
        if key in llama3_hf.HF_TOP_NAMES:
            yield llama3_hf.HF_TOP_NAMES[key], tensor
            continue
        match = llama3_hf.HF_LAYER.match(key)
        if not match:
            continue  # buffers titanlite has none of
        layer, rest = match.groups()
        experts = f"layers.{layer}.feed_forward.experts"
        if rest == "feed_forward.experts.gate_up_proj":
            gate, up = tensor.chunk(2, dim=-1)
            yield f"{experts}.w1", gate.transpose(1, 2).contiguous()
            yield f"{experts}.w3", up.transpose(1, 2).contiguous()
        elif rest == "feed_forward.experts.down_proj":
            yield f"{experts}.w2", tensor.transpose(1, 2).contiguous()
        elif rest in HF_LAYER_NAMES:
            yield f"layers.{layer}.{HF_LAYER_NAMES[rest]}", tensor
    values = as_transformers_reads(config)
    for layer in values["moe_layers"]:
        yield f"layers.{layer}.feed_forward.expert_bias", torch.zeros(values["num_local_experts"])
