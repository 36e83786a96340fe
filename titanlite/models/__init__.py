"""Model registry: [model] name -> ModelFamily; + flavor -> ModelArgs -> nn.Module.

One folder per family (llama3/, qwen3/, moe/, deepseek_v3/, llama4/, gpt_oss/), each registering a ModelFamily; layers they share sit in
common/. Torch-free: the config and run_train.sh's checks read the families' flavors and checks.
"""

from __future__ import annotations

from dataclasses import replace

from titanlite.errors import ConfigError
from titanlite.models import deepseek_v3, gpt_oss, llama3, llama4, moe, qwen3
from titanlite.models.common.args import ModelArgs, MoEArgs, with_overrides
from titanlite.models.family import ModelFamily

FAMILIES = {family.name: family for family in (llama3.FAMILY, qwen3.FAMILY, moe.FAMILY, deepseek_v3.FAMILY, llama4.FAMILY, gpt_oss.FAMILY)}


def family_of_hf_model(model_type: str | None, folder) -> ModelFamily:
    """The family whose Hugging Face mapping reads a config.json's `model_type`."""
    for family in FAMILIES.values():
        if family.hf_model_type and family.hf_model_type == model_type:
            return family
    known = ", ".join(f.hf_model_type for f in FAMILIES.values() if f.hf_model_type)
    raise ConfigError(
        f"Hugging Face checkpoint '{folder}' has model_type={model_type!r}, which no titanlite family maps; "
        f"use a model of one of: {known}"
    )


def model_args(name: str, flavor: str, vocab_size: int, seq_len: int, n_layers: int = 0, model_config=None) -> ModelArgs:
    """The flavor's shapes, with the tokenizer's vocab where the flavor leaves it open, a RoPE table
    as long as the training sequence, `n_layers` blocks when > 0, and the [model] section's attention,
    projection and MoE settings where set."""
    args = FAMILIES[name].flavors[flavor].with_vocab(vocab_size)
    args = replace(args, max_seq_len=seq_len, n_layers=n_layers or args.n_layers)
    if model_config is None:
        return args
    m = model_config
    args = with_overrides(args, m.flavor_overrides)
    args = replace(
        args,
        attn_mask_type=m.attn_mask_type or args.attn_mask_type,
        attn_type=m.attn_type or args.attn_type,
        fused_projections=m.fused_projections,
    )
    if isinstance(args, MoEArgs):
        args = replace(
            args,
            use_grouped_mm=m.moe_grouped_mm,
            load_balance_coeff=args.load_balance_coeff if m.moe_load_balance_coeff is None else m.moe_load_balance_coeff,
            aux_loss_coeff=args.aux_loss_coeff if m.moe_aux_loss_coeff is None else m.moe_aux_loss_coeff,
            aux_loss_type=m.moe_aux_loss_type or args.aux_loss_type,
        )
    return args


def build_model(name: str, args: ModelArgs):
    """Build on the meta device: no memory is spent until the parallelized model is materialized."""
    import torch

    with torch.device("meta"):
        return FAMILIES[name].plan.build(args)
