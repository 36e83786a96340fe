"""Tensor parallel (+ sequence parallel, loss parallel): the family's plans, plain dicts of stock
ParallelStyles, applied to the model (its head and tail) and to each block.

With loss parallel the logits stay sharded over the vocabulary and the cross entropy is computed
without gathering them (`torch.distributed.tensor.parallel.loss_parallel`). Projections fused into one
matmul (a family's FusedLinear) take `FusedColwiseParallel` below; the output layer, which may be
given the labels and return their loss (the chunked loss), `OutputColwiseParallel`.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, parallelize_module


def apply_tp(
    model: nn.Module, plan, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool, float8_recipe: str | None = None
) -> None:
    parallelize_module(model, tp_mesh, plan.tp_plan(model, sequence_parallel, loss_parallel))
    for block in getattr(model, plan.blocks).values():
        parallelize_module(block, tp_mesh, plan.block_tp_plan(block, sequence_parallel, float8_recipe))


class FusedColwiseParallel(ParallelStyle):
    """Column-wise parallel for a FusedLinear, which is given the weights of several projections that
    their own ColwiseParallel split by rows. This rank's rows are whole heads of q, k and v, so
    it multiplies its input by all of them in one local matmul and
    gets its heads of each projection. The input arrives replicated: gathered by sequence parallel
    (a DTensor), or the same plain tensor on every rank. Its gradient leaves as a partial sum over
    the ranks' rows, which the gather's backward reduce-scatters, or an all-reduce sums."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=self._local_operands)

    @staticmethod
    def _local_operands(module: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> tuple:
        x, *weights = inputs
        return (shared_by_heads(x, device_mesh), *(w.to_local() for w in weights))


def shared_by_heads(x, device_mesh: DeviceMesh):
    """`x`, the same on every tp rank, as the local tensor that each rank's heads read; its gradient
    (a partial sum over the ranks' heads) is summed over them in backward."""
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
    return x.redistribute(device_mesh, [Replicate()]).to_local(grad_placements=[Partial()])


class SharedByHeads(ParallelStyle):
    """For a module (an identity) whose input every tp rank holds whole and uses for its own heads
    (MLA's RoPE key part, which all heads share): backward sums the ranks' gradients, as Megatron's
    copy to the tensor-parallel region does."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=lambda m, inputs, mesh: (shared_by_heads(inputs[0], mesh),))


class OutputColwiseParallel(ColwiseParallel):
    """ColwiseParallel for the output layer, which may also be given the labels (the chunked loss,
    loss.py's linear_cross_entropy): they pass through as they are (every tp rank holds the same
    tokens), and the loss it then returns, a plain tensor equal on every rank, leaves untouched.
    (ColwiseParallel hands the module its first input alone.)"""

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        x = ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)
        return (x, *inputs[1:])

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if not isinstance(outputs, DTensor):
            return outputs
        return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)


class ShardedHeads(ParallelStyle):
    """For a module whose parameters hold one entry per attention head along dim 0 (gpt-oss's sinks):
    each tp rank keeps its heads' entries, as column-wise q/k/v keep their heads' rows. The module
    reads its local shard itself; inputs and outputs pass untouched."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard(name, mod, mesh):
            for param_name, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(param_name, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)], src_data_rank=None)))

        return distribute_module(module, device_mesh, shard)
