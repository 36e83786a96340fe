"""gpt-oss's Hugging Face mapping (GptOssForCausalLM): Llama 3's names and RoPE layout
(models/llama3/hf.py; the q/k biases permuted with their rows), the sinks, the router (with its
bias), and the experts.

transformers holds each layer's experts as `gate_up_proj` (experts, dim, 2 x hidden), the gate and
up columns interleaved (gate at even columns), and `down_proj` (experts, hidden, dim), with biases
beside them; titanlite as w1/w3 (experts, hidden, dim) and w2 (experts, dim, hidden). The released
checkpoints store both weights in MXFP4 (`*_blocks`: 32 four-bit values per block in 16 bytes, low
nibble first; `*_scales`: one power-of-two exponent per block, biased by 127), laid out (experts,
out, in): import dequantizes them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch

from titanlite.checkpoint.hf import SHARD_BYTES, check_config_values, no_expert_bias, hf_tensors, read_hf_config, write_shards
from titanlite.errors import ConfigError
from titanlite.models.gpt_oss.args import GptOssArgs, check_hf_exportable
from titanlite.models.llama3 import hf as llama3_hf

LAYER_NAMES = llama3_hf.LAYER_NAMES | {
    f"attention.{ours}.bias": f"self_attn.{theirs}.bias" for ours, theirs in
    (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj"))
} | {
    "attention.sinks.weight": "self_attn.sinks",
    "feed_forward.router.gate.weight": "mlp.router.weight",
    "feed_forward.router.gate.bias": "mlp.router.bias",
}
HF_LAYER_NAMES = {v: k for k, v in LAYER_NAMES.items()}
EXPERTS = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(w[123])(_bias)?$")
HF_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
EXPERT_BIAS = re.compile(r"^layers\.\d+\.feed_forward\.expert_bias$")
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(..., rows, groups, 16) uint8 blocks and (..., rows, groups) uint8 exponents -> (..., rows,
    groups * 32) float32."""
    table = torch.tensor(FP4_VALUES)
    values = torch.stack([table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]], dim=-1).flatten(-2)
    return torch.ldexp(values, scales.long().unsqueeze(-1) - 127).flatten(-2)


def to_hf_tensors(name: str, w: torch.Tensor, args: GptOssArgs) -> list[tuple[str, torch.Tensor]]:
    if EXPERT_BIAS.match(name):
        return no_expert_bias(name, w, "GptOssForCausalLM")
    if match := EXPERTS.match(name):
        layer, projection, bias = match.groups()
        prefix = f"model.layers.{layer}.mlp.experts"
        if projection == "w2":
            return [(f"{prefix}.down_proj_bias", w)] if bias else [(f"{prefix}.down_proj", w.transpose(1, 2))]
        return []  # w1 and w3 leave together, interleaved, with w3 (below)
    return llama3_hf.to_hf_tensors(name, w, args, LAYER_NAMES)


def interleaved(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """(experts, n, ...) twice -> (experts, 2n, ...): gate at even rows, up at odd ones."""
    return torch.stack([gate, up], dim=2).flatten(1, 2)


def save_hf(read, sizes: dict[str, int], args: GptOssArgs, folder: Path, dtype: torch.dtype, shard_bytes: int = SHARD_BYTES) -> None:
    """Write weights as Hugging Face safetensors + config.json; each layer's w1 and w3 (and their
    biases) are read together into gate_up_proj."""

    def converted(name: str, w: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        match = EXPERTS.match(name)
        if not match or match.group(2) != "w3":
            return to_hf_tensors(name, w, args)
        layer, _, bias = match.groups()
        gate_name = name.replace(".w3", ".w1")
        gate = read([gate_name])[gate_name]
        prefix = f"model.layers.{layer}.mlp.experts.gate_up_proj"
        return [(f"{prefix}_bias", interleaved(gate, w))] if bias else [(prefix, interleaved(gate, w).transpose(1, 2))]

    write_shards(read, sizes, folder, dtype, converted, hf_config(args, dtype), shard_bytes)


def hf_config(args: GptOssArgs, dtype: torch.dtype) -> dict:
    check_hf_exportable(args)
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "hidden_size": args.dim, "intermediate_size": args.moe_hidden_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "max_position_embeddings": args.max_seq_len,
        "num_local_experts": args.num_experts, "num_experts_per_tok": args.top_k, "sliding_window": args.sliding_window,
        "layer_types": ["sliding_attention" if args.is_sliding(i) else "full_attention" for i in range(args.n_layers)],
        "swiglu_limit": args.swiglu_limit, "swiglu_alpha": args.swiglu_alpha, "attention_bias": True,
        "tie_word_embeddings": False, "router_aux_loss_coef": args.aux_loss_coeff, "hidden_act": "silu",
        "rope_parameters": {
            "rope_type": "yarn", "rope_theta": args.rope_theta, "factor": args.yarn_factor, "beta_fast": args.yarn_beta_fast,
            "beta_slow": args.yarn_beta_slow, "truncate": False, "original_max_position_embeddings": args.yarn_original_seq_len,
        },
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def check_hf_shapes(config: dict, args: GptOssArgs, folder: Path) -> None:
    """ConfigError naming the first config.json value that differs from the model being trained."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    layer_types = ["sliding_attention" if args.is_sliding(i) else "full_attention" for i in range(args.n_layers)]
    expected = llama3_hf.expected_config(args, config) | {
        "intermediate_size": (args.moe_hidden_dim, None), "head_dim": (args.head_dim, None),
        "num_local_experts": (args.num_experts, None), "num_experts_per_tok": (args.top_k, None),
        "sliding_window": (args.sliding_window, None), "layer_types": (layer_types, layer_types),
        "swiglu_limit": (args.swiglu_limit, 7.0), "swiglu_alpha": (args.swiglu_alpha, 1.702), "attention_bias": (True, True),
        "rope_theta": (args.rope_theta, None), "rope yarn factor": (args.yarn_factor, None),
        "rope original_max_position_embeddings": (args.yarn_original_seq_len, None),
        "rope beta_fast": (args.yarn_beta_fast, 32.0), "rope beta_slow": (args.yarn_beta_slow, 1.0), "rope truncate": (False, True),
    }
    found = config | {f"rope {key}": rope.get(key) for key in ("original_max_position_embeddings", "beta_fast", "beta_slow", "truncate")}
    found |= {"rope yarn factor": rope.get("factor"), "rope_theta": rope.get("rope_theta", config.get("rope_theta"))}
    check_config_values(found, expected, folder)


def iter_hf(folder: Path, read: Callable = hf_tensors):
    """(titanlite name, tensor) of each weight, one layer's expert tensor (or MXFP4 pair) at a time,
    and a zero expert bias per block (gpt-oss routes without one)."""
    config, heads, kv_heads = read_hf_config(folder)
    packed: dict[str, torch.Tensor] = {}
    for key, tensor in read(folder):
        if match := HF_EXPERTS.match(key):
            layer, projection, suffix = match.groups()
            if suffix in ("_blocks", "_scales"):  # MXFP4: both halves, then (experts, out, in)
                base = key.removesuffix(suffix)
                packed[key] = tensor
                if f"{base}_blocks" not in packed or f"{base}_scales" not in packed:
                    continue
                tensor = dequantize_mxfp4(packed.pop(f"{base}_blocks"), packed.pop(f"{base}_scales"))
            elif suffix is None:
                tensor = tensor.transpose(1, 2)  # transformers' (experts, in, out)
            yield from _experts(layer, projection, tensor, suffix == "_bias")
        elif converted := llama3_hf.from_hf_tensor(key, tensor, heads, kv_heads, HF_LAYER_NAMES):
            yield converted
    if packed:
        raise ConfigError(
            f"Hugging Face checkpoint '{folder}' has {next(iter(packed))} without its other half; use the complete "
            "checkpoint (MXFP4 weights come as _blocks and _scales)"
        )
    for layer in range(config["num_hidden_layers"]):
        yield f"layers.{layer}.feed_forward.expert_bias", torch.zeros(config["num_local_experts"])


def _experts(layer: str, projection: str, w: torch.Tensor, bias: bool):
    """Our expert tensors of one HF projection: weights (experts, out, in), biases (experts, out)."""
    prefix, suffix = f"layers.{layer}.feed_forward.experts", "_bias" if bias else ""
    if projection == "down_proj":
        yield f"{prefix}.w2{suffix}", w
        return
    pairs = w.unflatten(1, (-1, 2))  # dim 1 holds gate and up interleaved
    yield f"{prefix}.w1{suffix}", pairs.select(2, 0).contiguous()
    yield f"{prefix}.w3{suffix}", pairs.select(2, 1).contiguous()
