"""DeepSeek-V3's Hugging Face mapping: DeepseekV3ForCausalLM's names and config.json.

MLA's RoPE parts are stored interleaved (config.json's rope_interleave), the layout titanlite
rotates, so no weight is permuted. Routed experts are one (experts, out, in) tensor per projection
here and one Linear weight per expert there (the Hub's layout, which transformers merges on load);
the expert bias is DeepSeek's e_score_correction_bias. DeepSeek's released weights are float8 with
one scale per 128x128 block: import multiplies them out (titanlite/checkpoint/hf.py's dequantized).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch

from titanlite.errors import ConfigError
from titanlite.checkpoint.hf import SHARD_BYTES, dequantized, hf_tensors, read_hf_config, write_shards
from titanlite.models.common.args import SET_ELSEWHERE
from titanlite.models.deepseek_v3.args import DeepSeekV3Args, check_hf_exportable
from titanlite.models.llama3 import hf as llama3_hf
from titanlite.models.moe.hf import EXPERT_NAMES, HF_EXPERT_NAMES

LAYER_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.expert_bias": "mlp.gate.e_score_correction_bias",
} | {
    f"feed_forward.{ours}{part}.weight": f"mlp.{theirs}{proj}.weight"
    for ours, theirs in (("", ""), ("shared_experts.", "shared_experts."))
    for part, proj in EXPERT_NAMES.items()
}
HF_LAYER_NAMES = {v: k for k, v in LAYER_NAMES.items()}
EXPERTS = re.compile(r"^(.+)\.feed_forward\.experts\.(w[123])$")
HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
BLOCK = re.compile(r"^(layers\.\d+|mtp\.\d+\.block)\.(.+)$")
# A multi-token prediction depth is stored as the layer after the model's (DeepSeek-V3's layer 61),
# with its own names for the joining parts and the final norm, and copies of the embedding and head.
MTP_NAMES = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
             "norm.weight": "shared_head.norm.weight"}
HF_MTP_NAMES = {v: k for k, v in MTP_NAMES.items()}
MTP_PART = re.compile(r"^mtp\.(\d+)\.(enorm\.weight|hnorm\.weight|eh_proj\.weight|norm\.weight)$")
SHARED_COPIES = {"tok_embeddings.weight": "embed_tokens.weight", "output.weight": "shared_head.head.weight"}


def hf_layer(prefix: str, n_layers: int) -> int:
    """The Hugging Face layer of a block's name prefix: layers.i -> i, mtp.k.block -> n_layers + k."""
    kind, index = prefix.split(".")[:2]
    return int(index) + (n_layers if kind == "mtp" else 0)


def our_prefix(layer: int, n_layers: int) -> str:
    return f"layers.{layer}" if layer < n_layers else f"mtp.{layer - n_layers}.block"


def to_hf_tensors(name: str, w: torch.Tensor, args: DeepSeekV3Args) -> list[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of one titanlite tensor: one per expert for routed experts, and the
    embedding and output head also as each MTP layer's copies."""
    n = args.n_layers
    if name in llama3_hf.TOP_NAMES:
        copies = [(f"model.layers.{n + k}.{SHARED_COPIES[name]}", w.clone()) for k in range(args.mtp_depth) if name in SHARED_COPIES]
        return [(llama3_hf.TOP_NAMES[name], w), *copies]
    if match := MTP_PART.match(name):
        return [(f"model.layers.{n + int(match.group(1))}.{MTP_NAMES[match.group(2)]}", w)]
    if match := EXPERTS.match(name):
        layer, projection = hf_layer(match.group(1), n), EXPERT_NAMES[match.group(2)]
        return [(f"model.layers.{layer}.mlp.experts.{e}.{projection}.weight", w[e]) for e in range(w.shape[0])]
    prefix, rest = BLOCK.match(name).groups()
    return [(f"model.layers.{hf_layer(prefix, n)}.{LAYER_NAMES[rest]}", w)]


def hf_config(args: DeepSeekV3Args, dtype: torch.dtype) -> dict:
    check_hf_exportable(args)
    rope_scaling, positions = None, args.max_seq_len
    if args.yarn_on:
        positions = int(args.yarn_original_seq_len * args.yarn_factor)
        rope_scaling = {
            "type": "yarn", "factor": args.yarn_factor, "original_max_position_embeddings": args.yarn_original_seq_len,
            "beta_fast": args.yarn_beta_fast, "beta_slow": args.yarn_beta_slow, "mscale": args.yarn_mscale,
            "mscale_all_dim": args.yarn_mscale_all_dim,
        }
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": args.vocab_size, "hidden_size": args.dim, "intermediate_size": args.ffn_hidden_dim,
        "moe_intermediate_size": args.moe_hidden_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_heads,
        "n_shared_experts": args.num_shared_experts, "n_routed_experts": args.num_experts,
        "routed_scaling_factor": args.route_scale, "kv_lora_rank": args.kv_lora_rank,
        "q_lora_rank": args.q_lora_rank or None, "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim, "qk_nope_head_dim": args.qk_nope_head_dim, "n_group": args.n_group,
        "topk_group": args.topk_group, "num_experts_per_tok": args.top_k, "first_k_dense_replace": args.n_dense_layers,
        "norm_topk_prob": args.route_norm, "hidden_act": "silu", "max_position_embeddings": positions,
        "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta, "rope_scaling": rope_scaling,
        "rope_interleave": True, "attention_bias": False, "tie_word_embeddings": False,
        "num_nextn_predict_layers": args.mtp_depth, "torch_dtype": str(dtype).removeprefix("torch."),
    }


# ---- the adapter the checkpointer calls (ParallelPlan.hf) ----


def save_hf(read, sizes: dict[str, int], args: DeepSeekV3Args, folder: Path, dtype: torch.dtype, shard_bytes: int = SHARD_BYTES) -> None:
    write_shards(read, sizes, folder, dtype, lambda name, w: to_hf_tensors(name, w, args), hf_config(args, dtype), shard_bytes)


# config.json's keys -> (the args field they set, the value transformers' DeepseekV3Config takes where a file
# leaves the key out). intermediate_size is the dense blocks' SwiGLU (args.ffn_hidden_dim).
HF_FIELDS = {
    "hidden_size": ("dim", 7168), "num_hidden_layers": ("n_layers", 61), "num_attention_heads": ("n_heads", 128),
    "vocab_size": ("vocab_size", 129280), "intermediate_size": ("dense_hidden_dim", 18432),
    "moe_intermediate_size": ("moe_hidden_dim", 2048), "n_routed_experts": ("num_experts", 256),
    "n_shared_experts": ("num_shared_experts", 1), "num_experts_per_tok": ("top_k", 8),
    "first_k_dense_replace": ("n_dense_layers", 3), "kv_lora_rank": ("kv_lora_rank", 512), "q_lora_rank": ("q_lora_rank", 1536),
    "qk_rope_head_dim": ("qk_rope_head_dim", 64), "qk_nope_head_dim": ("qk_nope_head_dim", 128),
    "v_head_dim": ("v_head_dim", 128), "n_group": ("n_group", 8), "topk_group": ("topk_group", 4),
    "routed_scaling_factor": ("route_scale", 2.5), "norm_topk_prob": ("route_norm", True), "rms_norm_eps": ("norm_eps", 1e-6),
    "rope_interleave": ("rope_interleave", True),
}
YARN_FIELDS = {"original_max_position_embeddings": "yarn_original_seq_len", "beta_fast": "yarn_beta_fast",
               "beta_slow": "yarn_beta_slow", "mscale_all_dim": "yarn_mscale_all_dim", "mscale": "yarn_mscale"}


def check_hf_shapes(config: dict, args: DeepSeekV3Args, folder: Path) -> None:
    """ConfigError naming the first value of config.json (transformers' default where it leaves a key out)
    that transformers would run differently from the model being trained: shapes, routing, RoPE, YaRN."""
    ours = {field: getattr(args, field) for field, _ in HF_FIELDS.values() if hasattr(args, field)}
    ours |= {"dense_hidden_dim": args.ffn_hidden_dim, "rope_interleave": True}  # titanlite rotates interleaved pairs only

    def check(key: str, field: str, found, value, absent: bool) -> None:
        if found != value:
            fix = f"set {SET_ELSEWHERE[field]} to match" if field in SET_ELSEWHERE else f"set model.flavor_overrides {field}={found}"
            if field == "rope_interleave":  # the layout DeepSeek's weights are in; the other would need them permuted
                fix, field = "use the checkpoint saved with rope_interleave=true (DeepSeek's own)", ""
            note = " (absent: transformers' default)" if absent else ""
            raise ConfigError(
                f"Hugging Face checkpoint '{folder}' has {key}={found}{note}, the model being trained "
                f"{field + '=' if field else ''}{value}; {fix}, or choose the model.flavor it was made for"
            )

    for key, (field, default) in HF_FIELDS.items():
        absent = key not in config
        found = default if absent else 0 if key == "q_lora_rank" and config[key] is None else config[key]  # null: no query latent
        check(key, field, found, ours[field], absent)
    check("num_key_value_heads", "n_kv_heads", config.get("num_key_value_heads") or config["num_attention_heads"], args.n_kv_heads, False)
    # DeepSeek's own key; transformers' DeepseekV3 routes by sigmoid whatever it says.
    check("scoring_func", "score_func", config.get("scoring_func", "sigmoid"), args.score_func, "scoring_func" not in config)
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    theta = config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta"))
    check("rope_theta", "rope_theta", 10000.0 if theta is None else theta, args.rope_theta, theta is None)
    check_yarn(rope, config, args, folder, check)


def check_yarn(rope: dict, config: dict, args: DeepSeekV3Args, folder: Path, check) -> None:
    """YaRN's parameters as transformers reads them (modeling_rope_utils' _compute_yarn_parameters)."""
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind not in ("default", "yarn"):
        raise ConfigError(
            f"Hugging Face checkpoint '{folder}' has rope_scaling type {kind}, which titanlite's DeepSeek-V3 does not apply "
            "(it has plain RoPE, or DeepSeek's YaRN); use a checkpoint with DeepSeek's rope_scaling"
        )
    for key in ("attention_factor", "truncate"):
        if rope.get(key) not in (None, True):
            raise ConfigError(
                f"Hugging Face checkpoint '{folder}' has rope_scaling.{key}={rope[key]}, which titanlite's YaRN does not take "
                "(its cos/sin scale comes from mscale / mscale_all_dim, its ramp's ends are rounded out); remove it"
            )
    original = rope.get("original_max_position_embeddings") or config.get("max_position_embeddings", 4096)
    factor = (rope.get("factor") or config.get("max_position_embeddings", 4096) / original) if kind == "yarn" else 1.0
    check("rope_scaling.factor", "yarn_factor", factor, args.yarn_factor if args.yarn_on else 1.0, "factor" not in rope)
    if not args.yarn_on:
        return
    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if all_dim and not mscale:
        raise ConfigError(
            f"Hugging Face checkpoint '{folder}' has mscale_all_dim={all_dim} in rope_scaling without mscale, which transformers "
            "reads as YaRN's default scale on cos/sin, and titanlite's YaRN cannot express; add DeepSeek's mscale to rope_scaling"
        )
    # transformers takes mscale only beside mscale_all_dim: without it, cos/sin get YaRN's default (mscale 1), the softmax none.
    found = {"original_max_position_embeddings": original, "beta_fast": rope.get("beta_fast") or 32,
             "beta_slow": rope.get("beta_slow") or 1, "mscale_all_dim": all_dim or 0.0, "mscale": mscale if all_dim else 1.0}
    for key, field in YARN_FIELDS.items():
        check(f"rope_scaling.{key}", field, found[key], getattr(args, field), not rope.get(key))


def iter_hf(folder: Path, read: Callable = hf_tensors):
    """(titanlite name, tensor) of each weight, one tensor in memory at a time (routed experts: one
    projection of one layer, gathered from its experts' weights; float8 weights multiplied out). MTP
    layers, where the file has them, load into the model's MTP modules (their copies of the shared
    embedding and head are skipped)."""
    config, _, _ = read_hf_config(folder)
    n_layers, experts = config["num_hidden_layers"], config.get("n_routed_experts")
    gathering: dict[str, dict[int, torch.Tensor]] = {}
    for key, tensor in dequantized(read(folder), folder):
        if key in llama3_hf.HF_TOP_NAMES:
            yield llama3_hf.HF_TOP_NAMES[key], tensor
            continue
        match = llama3_hf.HF_LAYER.match(key)
        if not match:
            continue  # buffers titanlite has none of
        layer, rest = int(match.group(1)), match.group(2)
        prefix = our_prefix(layer, n_layers)
        if expert := HF_EXPERT.match(rest):
            index, projection = expert.groups()
            name = f"{prefix}.feed_forward.experts.{HF_EXPERT_NAMES[projection]}"
            gathered = gathering.setdefault(name, {})
            gathered[int(index)] = tensor
            if len(gathered) == experts:
                yield name, torch.stack([gathered[e] for e in range(experts)])
                del gathering[name]
        elif layer >= n_layers and rest in HF_MTP_NAMES:
            yield f"mtp.{layer - n_layers}.{HF_MTP_NAMES[rest]}", tensor
        elif rest in HF_LAYER_NAMES:
            yield f"{prefix}.{HF_LAYER_NAMES[rest]}", tensor


# Weights a Hugging Face file may lack: DeepseekV3ForCausalLM has no MTP (DeepSeek's release does).
OPTIONAL = ("mtp.",)
