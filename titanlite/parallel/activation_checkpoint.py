"""Activation checkpointing: recompute activations in backward instead of keeping them.

  full                    every transformer block keeps only its input and reruns its forward
  selective, option 'op'  per-op policy: keep the outputs of matmuls (a MoE's grouped ones too) and
                          attention (expensive to recompute), recompute the cheap elementwise ops and norms
  selective, option 'k'   fully checkpoint every k-th block (layer ids 0, k, 2k, ...)
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titanlite.parallel.document_ring import document_ring

aten = torch.ops.aten
SAVED_OPS = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten._grouped_mm.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.higher_order.flex_attention,  # block_causal on CUDA (models/common/attention.py), in compiled blocks
    document_ring._opoverload,  # block_causal under context parallel: its output, not its score tiles
}


def _keep_matmuls_and_attention(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: nn.Module, plan, ac) -> None:
    """Wrap the model's blocks in place (the family's `blocks`, keyed by layer id, and its blocks
    elsewhere; names gain `_checkpoint_wrapped_module.`), as [activation_checkpoint] says; its
    preserve_rng_state, determinism_check, debug and early_stop go to torch.utils.checkpoint as they are."""
    option = ac.selective_ac_option
    checkpoint_options = dict(
        preserve_rng_state=ac.preserve_rng_state, determinism_check=ac.determinism_check, debug=ac.debug,
        early_stop=ac.early_stop,
    )
    blocks = getattr(model, plan.blocks)
    for parent, name in [(blocks, key) for key in blocks] + plan.blocks_elsewhere(model):
        block = getattr(parent, name)
        layer_id = int(name) if name.isdigit() else block.layer_id
        if ac.mode == "full" or (ac.mode == "selective" and option.isdigit() and layer_id % int(option) == 0):
            setattr(parent, name, checkpoint_wrapper(block, **checkpoint_options))
        elif ac.mode == "selective" and option == "op":
            policy = partial(create_selective_checkpoint_contexts, _keep_matmuls_and_attention)
            setattr(parent, name, checkpoint_wrapper(block, context_fn=policy, **checkpoint_options))
