"""Hugging Face format <-> titanlite names: safetensors + config.json, loadable by transformers.
Llama 3 as LlamaForCausalLM; the MoE family's Qwen3-MoE shapes as Qwen3MoeForCausalLM.

titanlite (like Meta's Llama) rotates consecutive pairs of each head for RoPE; Hugging Face's
models rotate the two halves. The q and k projections (and Qwen3's q/k head norms) are permuted
accordingly. Routed experts are one (experts, out, in) tensor per projection here and one
Linear weight per expert there (the Hub's layout, which transformers merges on load).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from titanlite.errors import ConfigError
from titanlite.models.common.args import ModelArgs, MoEArgs
from titanlite.models.moe.args import check_hf_exportable

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
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.router.gate.weight": "mlp.gate.weight",
}
EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
HF_EXPERT_NAMES = {v: k for k, v in EXPERT_NAMES.items()}
EXPERTS = re.compile(r"^feed_forward\.experts\.(w[123])$")
HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
HF_TOP_NAMES = {v: k for k, v in TOP_NAMES.items()}
HF_LAYER_NAMES = {v: k for k, v in LAYER_NAMES.items()}
LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def pairs_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows = w.shape[0]
    return w.view(heads, rows // heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def halves_to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows = w.shape[0]
    return w.view(heads, 2, rows // heads // 2, -1).transpose(1, 2).reshape(w.shape)


def rotary_heads(name: str, n_heads: int, n_kv_heads: int) -> int | None:
    """Heads of a tensor along RoPE's rotated dim (q and k rows, the q/k head norms), which the two
    layouts order differently."""
    return {"attention.wq.weight": n_heads, "attention.wk.weight": n_kv_heads,
            "attention.q_norm.weight": 1, "attention.k_norm.weight": 1}.get(name)


def to_hf_tensors(name: str, w: torch.Tensor, n_heads: int, n_kv_heads: int) -> list[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor in its layout) of one titanlite tensor: one per expert for routed
    experts, none for a zero expert bias (Qwen3-MoE has none)."""
    from titanlite.errors import ConfigError

    if name in TOP_NAMES:
        return [(TOP_NAMES[name], w)]
    layer, rest = LAYER.match(name).groups()
    if rest == "feed_forward.expert_bias":
        if w.any():
            raise ConfigError(
                f"{name} is not zero, and Qwen3MoeForCausalLM has no expert bias: the exported model would route "
                "differently; export a model trained with model.moe_load_balance_coeff=0"
            )
        return []
    if match := EXPERTS.match(rest):
        projection = EXPERT_NAMES[match.group(1)]
        return [(f"model.layers.{layer}.mlp.experts.{e}.{projection}.weight", w[e]) for e in range(w.shape[0])]
    if heads := rotary_heads(rest, n_heads, n_kv_heads):
        w = pairs_to_halves(w, heads)
    return [(f"model.layers.{layer}.{LAYER_NAMES[rest]}", w)]


def from_hf_tensor(name: str, w: torch.Tensor, n_heads: int, n_kv_heads: int) -> tuple[str, torch.Tensor] | None:
    """(titanlite name, tensor in its layout) of one Hugging Face tensor; None for tensors titanlite
    has no parameter for (e.g. rotary inv_freq buffers of old exports). One expert's weight comes
    back as (name of the experts' tensor, (expert index, its slice))."""
    if name in HF_TOP_NAMES:
        return HF_TOP_NAMES[name], w
    match = HF_LAYER.match(name)
    if not match:
        return None
    layer, rest = match.groups()
    if expert := HF_EXPERT.match(rest):
        return f"layers.{layer}.feed_forward.experts.{HF_EXPERT_NAMES[expert.group(2)]}", (int(expert.group(1)), w)
    if rest not in HF_LAYER_NAMES:
        return None
    rest = HF_LAYER_NAMES[rest]
    if heads := rotary_heads(rest, n_heads, n_kv_heads):
        w = halves_to_pairs(w, heads)
    return f"layers.{layer}.{rest}", w


def transformer_config(args: ModelArgs, dtype: torch.dtype) -> dict:
    """The config.json keys Llama and Qwen3-MoE share."""
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
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def hf_config(args: ModelArgs, dtype: torch.dtype) -> dict:
    if isinstance(args, MoEArgs):
        return qwen3_moe_config(args, dtype)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "mlp_bias": False} | transformer_config(args, dtype)
    if args.rope_scaling:
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    return config


def qwen3_moe_config(args: MoEArgs, dtype: torch.dtype) -> dict:
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
    } | transformer_config(args, dtype)


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
        tensors = dict(pair for n, w in read(names).items() for pair in to_hf_tensors(n, w, args.n_heads, args.n_kv_heads))
        save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    if len(shards) > 1:
        total = sum(sizes.values()) * dtype.itemsize
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "config.json").write_text(json.dumps(hf_config(args, dtype), indent=2))


def check_hf_shapes(config: dict, args: ModelArgs, folder: Path) -> None:
    """ConfigError naming the first HF config.json value that differs from the model being trained."""
    from titanlite.errors import ConfigError

    expected = {
        "hidden_size": args.dim, "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "intermediate_size": args.ffn_hidden_dim, "vocab_size": args.vocab_size,
    }
    if isinstance(args, MoEArgs):
        expected |= {
            "num_experts": args.num_experts, "num_experts_per_tok": args.top_k, "moe_intermediate_size": args.moe_hidden_dim,
            "head_dim": args.head_dim, "norm_topk_prob": args.route_norm, "mlp_only_layers": list(range(args.n_dense_layers)),
            "decoder_sparse_step": 1,  # every block from n_dense_layers on is a MoE block
        }
    for key, value in expected.items():
        found = num_experts(config) if key == "num_experts" else config.get(key)
        if found is None:  # keys a config may leave out (or set null)
            found = {"num_key_value_heads": config["num_attention_heads"], "mlp_only_layers": [], "norm_topk_prob": False,
                     "decoder_sparse_step": 1, "head_dim": config["hidden_size"] // config["num_attention_heads"]}.get(key)
        if found != value:
            raise ConfigError(
                f"Hugging Face checkpoint '{folder}' has {key}={found}, the model being trained {value}; choose the "
                "model.flavor (and tokenizer) the checkpoint was made for"
            )


def num_experts(config: dict) -> int:
    """The Hub's Qwen3-MoE configs say num_experts; transformers 5 writes num_local_experts."""
    return config.get("num_experts", config.get("num_local_experts"))


def read_hf_config(folder: Path) -> tuple[dict, int, int]:
    """(config.json, attention heads, kv heads) of a Hugging Face model folder; ConfigError naming the
    file when it is not JSON or lacks the head count."""
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
        heads = config["num_attention_heads"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"Hugging Face config '{path}' cannot be read ({type(e).__name__}: {e}); use the config.json saved with "
            "the weights (it needs num_attention_heads)"
        ) from None
    return config, heads, config.get("num_key_value_heads", heads)


def check_hf_files(folder: Path) -> None:
    """Every safetensors file of a Hugging Face folder opens (safetensors checks its header against the
    file's length: a truncated or foreign file fails here), without reading any tensor."""
    from safetensors import safe_open

    read_hf_config(folder)
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as f:
                f.keys()
        except Exception as e:  # safetensors raises its own SafetensorError, or OSError
            raise ConfigError(
                f"Hugging Face weights '{path}' cannot be read ({e}); the file is damaged or not safetensors: "
                "copy it again from its source"
            ) from None


def iter_hf(folder: Path):
    """(titanlite name, tensor) of each weight in a Hugging Face folder, one tensor in memory at a time
    (routed experts: one projection of one layer, gathered from its experts' weights)."""
    from safetensors import safe_open

    config, heads, kv_heads = read_hf_config(folder)
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                converted = from_hf_tensor(key, f.get_tensor(key), heads, kv_heads)
                if converted is None:
                    continue
                name, value = converted
                if not isinstance(value, tuple):
                    yield name, value
                    continue
                gathered = experts.setdefault(name, {})
                gathered[value[0]] = value[1]
                if len(gathered) == num_experts(config):
                    yield name, torch.stack([gathered[e] for e in range(len(gathered))])
                    del experts[name]
    if num_experts(config):  # Qwen3-MoE routes without a bias: ours starts (and stays, for export) at zero
        dense = set(config.get("mlp_only_layers") or [])
        for layer in range(config["num_hidden_layers"]):
            if layer not in dense:
                yield f"layers.{layer}.feed_forward.expert_bias", torch.zeros(num_experts(config))


def load_hf(folder: Path) -> dict:
    """Every weight of a Hugging Face folder as a titanlite state dict (scripts/convert_hf.py from-hf)."""
    return dict(iter_hf(folder))
