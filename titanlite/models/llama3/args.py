"""Llama 3's flavors (Meta's published shapes and TorchTitan's debug presets) and its checks."""

from __future__ import annotations

from dataclasses import replace

from titanlite.errors import ConfigError
from titanlite.models.common.args import ModelArgs, check_heads, check_overridden, check_shapes, check_tied

# Meta's published shapes (Llama 3.1); debugmodel follows TorchTitan's, with the tokenizer's vocab.
LLAMA3_FLAVORS = {
    "debugmodel": ModelArgs(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=16, vocab_size=0, multiple_of=256, ffn_dim_multiplier=None
    ),
    # The debug model with grouped-query attention (4 query heads per kv head), as the big flavors have.
    "debugmodel_gqa": ModelArgs(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=4, vocab_size=0, multiple_of=256, ffn_dim_multiplier=None
    ),
    "8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, multiple_of=1024, ffn_dim_multiplier=1.3),
    "70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, multiple_of=4096, ffn_dim_multiplier=1.3),
    "405B": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, multiple_of=4096, ffn_dim_multiplier=1.2),
}


def _block_causal(flavor: str, attn_type: str) -> ModelArgs:
    return replace(LLAMA3_FLAVORS[flavor], attn_mask_type="block_causal", attn_type=attn_type)


# TorchTitan's document-masked presets: the same shapes, block-causal attention on its kernels.
LLAMA3_FLAVORS |= {
    "debugmodel_flex_attn": _block_causal("debugmodel", "flex"),
    "debugmodel_varlen_attn": _block_causal("debugmodel", "varlen"),
    "8B_flex": _block_causal("8B", "flex"),
    "8B_varlen": _block_causal("8B", "varlen"),
}


def check_llama3(args: ModelArgs, dims) -> None:
    """No experts to split; tensor parallel splits attention by heads: both head counts must divide
    by tp. `dims`: the layout (titanlite.parallel.dims.ParallelDims)."""
    for key, degree in (("expert_parallel_degree", dims.ep), ("expert_tensor_parallel_degree", dims.etp)):
        if degree > 1:
            raise ConfigError(
                f"parallelism.{key}={degree} splits the experts of a MoE model, and this model has none; "
                "set it to 1, or choose model.name='moe'"
            )
    check_heads(args, dims.tp)
    check_tied(args, dims)


EXPERT_KEYS = ("moe_grouped_mm", "moe_load_balance_coeff", "moe_aux_loss_coeff", "moe_aux_loss_type")


def check_config(model, args: ModelArgs) -> None:
    """The shapes (`args`: the flavor's, as model.flavor_overrides changes them), and the [model] keys
    of experts stay at their defaults (`model`: the config's Model section)."""
    check_overridden(model, args, check_shapes)
    defaults = type(model)()
    for name in EXPERT_KEYS:
        value = getattr(model, name)
        if value != getattr(defaults, name):
            raise ConfigError(
                f"model.{name}={value!r} applies to MoE models, and model.name='{model.name}' has no experts; "
                "remove it, or choose model.name='moe'"
            )
