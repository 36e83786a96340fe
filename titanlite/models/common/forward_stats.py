"""Statistics a training forward adds to a module's buffer (a MoE layer's token counts and aux loss,
attention's largest logits for QK-clip), taken once per forward: activation checkpointing's
recompute runs inside backward and has added them already (or, in a pipeline stage's shape
inference, runs on activations nothing wrote).

Whether backward is running is a host-side question (`torch._C._current_graph_task_id`) that dynamo
cannot put in a graph, so the check lives inside custom ops that torch.compile traces through.
Where the checkpoint is inside the compiled graph, AOTAutograd keeps the ops (they mutate their
buffer) in the forward graph and never reruns them; where a compiled piece runs inside an eager
checkpoint (attention under TP), backward reruns the piece's graph, and the check skips the ops.
"""

from __future__ import annotations

import torch


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@torch.library.custom_op("titanlite::add_outside_recompute", mutates_args=("total",))
def add_outside_recompute(total: torch.Tensor, value: torch.Tensor) -> None:
    """total += value, except inside backward (the recompute of a checkpointed forward)."""
    if not in_backward():
        total.add_(value)


@torch.library.custom_op("titanlite::max_outside_recompute", mutates_args=("total",))
def max_outside_recompute(total: torch.Tensor, value: torch.Tensor) -> None:
    """total = max(total, value) elementwise, except inside backward."""
    if not in_backward():
        torch.maximum(total, value, out=total)
