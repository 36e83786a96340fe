"""Activation checkpointing: recompute activations in backward instead of keeping them.

  full                    every transformer block keeps only its input and reruns its forward
  selective, option 'op'  per-op policy: keep the outputs of matmuls and attention (expensive to
                          recompute), recompute the cheap elementwise ops and norms
  selective, option 'k'   fully checkpoint every k-th block (layer ids 0, k, 2k, ...)
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

aten = torch.ops.aten
SAVED_OPS = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _keep_matmuls_and_attention(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: nn.Module, mode: str, selective_option: str) -> None:
    """Wrap the model's transformer blocks in place (names gain `_checkpoint_wrapped_module.`)."""
    for key, block in model.layers.items():
        if mode == "full" or (mode == "selective" and selective_option.isdigit() and int(key) % int(selective_option) == 0):
            model.layers[key] = checkpoint_wrapper(block, preserve_rng_state=False)
        elif mode == "selective" and selective_option == "op":
            policy = partial(create_selective_checkpoint_contexts, _keep_matmuls_and_attention)
            model.layers[key] = checkpoint_wrapper(block, context_fn=policy, preserve_rng_state=False)
