"""Tensor parallel (+ sequence parallel, loss parallel): a plain dict of stock ParallelStyles per block.

With sequence parallel, activations between blocks are sharded along the sequence (Shard(1)):
norms run on their shard, and each attention/FFN all-gathers its input and reduce-scatters its
output. With loss parallel, the logits stay sharded over the vocabulary (Shard(-1)) and the cross
entropy is computed without gathering them (`torch.distributed.tensor.parallel.loss_parallel`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titanlite.float8 import Float8Linear, Float8PrepareModuleInput

# The projections that read each sub-module's gathered input.
INPUT_PROJECTIONS = {"attention": ("wq", "wk", "wv"), "feed_forward": ("w1", "w3")}


def block_plan(sequence_parallel: bool, float8_inputs: frozenset[str] = frozenset()) -> dict:
    """The TP plan of one TransformerBlock: q/k/v and w1/w3 column-wise, wo and w2 row-wise. Sequence
    parallel's gathers before the sub-modules in `float8_inputs` move float8 bytes."""
    between_blocks = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=between_blocks),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=between_blocks),
    }
    if sequence_parallel:
        plan |= {
            "attention_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            # The sequence shard is gathered before the projections; the RoPE table passes untouched.
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        }
        plan |= {name: Float8PrepareModuleInput() for name in float8_inputs}
    return plan


def float8_gathered_inputs(block: nn.Module, float8_recipe: str | None) -> frozenset[str]:
    """Sub-modules whose input can be gathered in float8: every projection reading it is a tensorwise
    float8 linear (a filtered or ineligible one needs the high-precision input)."""
    if float8_recipe != "tensorwise":
        return frozenset()
    return frozenset(
        name for name, projections in INPUT_PROJECTIONS.items()
        if all(isinstance(getattr(getattr(block, name), p), Float8Linear) for p in projections)
    )


def model_plan(model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> dict:
    """The plan of the embedding, final norm and output (those present: a pipeline stage may lack them)."""
    between_blocks = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between_blocks),
        "norm": SequenceParallel() if sequence_parallel else None,
        "output": ColwiseParallel(
            input_layouts=between_blocks,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,  # loss parallel needs the DTensor logits
        ),
    }
    return {name: style for name, style in plan.items() if style is not None and getattr(model, name) is not None}


def apply_tp(
    model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool, float8_recipe: str | None = None
) -> None:
    parallelize_module(model, tp_mesh, model_plan(model, sequence_parallel, loss_parallel))
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(sequence_parallel, float8_gathered_inputs(block, float8_recipe)))
