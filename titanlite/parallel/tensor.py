"""Tensor parallel (+ sequence parallel, loss parallel): the family's plans, plain dicts of stock
ParallelStyles, applied to the model (its head and tail) and to each block.

With loss parallel the logits stay sharded over the vocabulary and the cross entropy is computed
without gathering them (`torch.distributed.tensor.parallel.loss_parallel`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module


def apply_tp(
    model: nn.Module, plan, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool, float8_recipe: str | None = None
) -> None:
    parallelize_module(model, tp_mesh, plan.tp_plan(model, sequence_parallel, loss_parallel))
    for block in getattr(model, plan.blocks).values():
        parallelize_module(block, tp_mesh, plan.block_tp_plan(block, sequence_parallel, float8_recipe))
