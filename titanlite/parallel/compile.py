"""torch.compile per transformer block: every block has the same code, so one compiled graph is
reused by all of them (compile time does not grow with depth), and FSDP's per-block hooks stay
outside the graphs. Applied after activation checkpointing (the compiled graph includes the
checkpoint and its recompute) and before FSDP.

With tensor parallelism the family's units are smaller (Llama: a block's `attention` and
`feed_forward`), since a whole
compiled TP block fails in backward in torch 2.13 (its compiled backward returns a plain tensor
as the gradient of its DTensor input, and the eager redistribute in front of the block fails on
it: "'Tensor' object has no attribute '_local_tensor'"), with or without sequence parallel,
loss parallel and fullgraph. The two halves compile and train exactly like eager.

Graphs that hold collectives (TP's, CP's ring) skip torch's on-disk AOTAutograd cache: in torch
2.13 a graph loaded from it by a later process gave wrong losses (1.6 off after one step) or
failed with "Could not resolve the process group registered under the name ...": the cached
graph names process groups of the process that wrote it.
"""

from __future__ import annotations

from collections import Counter

import torch._functorch.config
from torch import nn


def apply_compile(model: nn.Module, plan, tp_enabled: bool, collectives_in_graph: bool, backend: str = "inductor") -> None:
    """Compile the family's units of each block in place (`Module.compile`), so parameter names and
    checkpoints do not change."""
    if collectives_in_graph:
        torch._functorch.config.enable_autograd_cache = False
    blocks = [*getattr(model, plan.blocks).values(), *(getattr(parent, name) for parent, name in plan.blocks_elsewhere(model))]
    for block in blocks:
        for unit in plan.compile_units(block, tp_enabled):
            unit.compile(backend=backend, fullgraph=True)


def compiled_units_line(parts: list[nn.Module]) -> str:
    """The log's line of what torch.compile wraps, by class (a block whole, or its pieces)."""
    units = Counter(type(getattr(m, "_checkpoint_wrapped_module", m)).__name__
                    for part in parts for m in part.modules() if getattr(m, "_compiled_call_impl", None) is not None)
    return "compiled units: " + ", ".join(f"{n} {name}" for name, n in units.items())
