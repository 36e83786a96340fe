"""Statistics a training forward adds to a module's buffer (a MoE layer's token counts and aux loss),
taken once per forward: activation checkpointing's recompute runs inside backward and has added
them already.

Whether backward is running is a host-side question (`torch._C._current_graph_task_id`) that dynamo
cannot put in a graph, so the check lives inside a custom op: torch.compile traces a whole block
through it. The op mutates its buffer, so AOTAutograd keeps it in the forward graph and never
recomputes it in backward.
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
