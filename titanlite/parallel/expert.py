"""Expert parallel: the routed experts of each MoE layer split over the `ep` ranks (a view that
borrows dp_shard x cp, parallel/dims.py), and the tokens travel to the rank that holds their expert.

`ExpertParallel` is a ParallelStyle for the family's expert modules. Their weights become DTensors
sharded over experts (Shard(0) on `ep`), so checkpoints hold the full tensors and load on any EP
degree. Around each forward:
  dispatch  each rank sends its tokens' per-expert counts (all-to-all), then the tokens themselves
            (all-to-all with those variable splits), and groups what it received by local expert;
  combine   the outputs go back the same way, in reverse.
Both all-to-alls are differentiable (backward is the reverse exchange), and they are plain
torch.distributed collectives, so they run on gloo. The split sizes must reach the host: dispatch
costs one device-to-host copy per layer, as in TorchTitan and Megatron.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module


class _AllToAll(torch.autograd.Function):
    """Rows of `x` in `send` blocks to each rank of `group`; `receive` rows come back. Backward sends
    the gradients the other way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, receive: list[int], send: list[int], group) -> torch.Tensor:
        ctx.receive, ctx.send, ctx.group = receive, send, group
        out = x.new_empty(sum(receive), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.receive, group=ctx.group)
        return out, None, None, None


def segment_order(counts: torch.Tensor, total: int) -> torch.Tensor:
    """Rows laid out in segments (a, b) of counts[a, b] rows (`total` in all), in row-major order of
    (a, b): the row permutation that lays the same segments out in (b, a) order."""
    flat = counts.flatten()
    starts = torch.cumsum(flat, 0) - flat
    transposed = counts.t().flatten()
    new_starts = starts.view_as(counts).t().flatten()
    offset_in_segment = torch.arange(total, device=counts.device) - torch.repeat_interleave(
        torch.cumsum(transposed, 0) - transposed, transposed, output_size=total
    )
    return torch.repeat_interleave(new_starts, transposed, output_size=total) + offset_in_segment


class ExpertParallel(ParallelStyle):
    """For a module called as experts(tokens grouped by expert, counts per expert) that returns the
    outputs in the same order, with weights of shape (experts, ...)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._shard_experts, self._dispatch, self._combine)

    @staticmethod
    def _shard_experts(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            sharded = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)], src_data_rank=None))
            module.register_parameter(param_name, sharded)

    @staticmethod
    def _dispatch(module: nn.Module, inputs, mesh: DeviceMesh):
        tokens, counts = inputs
        group, ranks = mesh.get_group(), mesh.size()
        # received[src, e]: tokens rank src sends to this rank's local expert e.
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        received = received.view(ranks, -1)
        send = counts.view(ranks, -1).sum(dim=1).tolist()
        receive = received.sum(dim=1).tolist()
        arrived = _AllToAll.apply(tokens, receive, send, group)
        # Arrived by (source rank, local expert); the experts want them by (local expert, source rank).
        order = segment_order(received, sum(receive))
        module._ep_state = (order, receive, send, group)
        return arrived[order], received.sum(dim=0)

    @staticmethod
    def _combine(module: nn.Module, outputs: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        order, receive, send, group = module._ep_state
        by_source = torch.empty_like(outputs).index_copy(0, order, outputs)
        return _AllToAll.apply(by_source, send, receive, group)


def apply_ep(model: nn.Module, plan, ep_mesh: DeviceMesh) -> None:
    for experts in plan.experts(model):
        parallelize_module(experts, ep_mesh, ExpertParallel())
