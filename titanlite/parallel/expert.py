"""Expert parallel: the routed experts of each MoE layer split over the `ep` ranks (a view that
borrows dp_shard x cp, and tp unless the experts are split by tp; parallel/dims.py), and the tokens
travel to the rank that holds their expert. Expert tensor parallel splits each expert's hidden dim
over tp as well.

`ExpertParallel` is a ParallelStyle for the family's expert modules. Their weights become DTensors
sharded over experts (Shard(0) on `ep`; with ETP also Shard(hidden) on `tp`), so checkpoints hold
the full tensors and load on any EP degree. Around each forward:
  dispatch  each rank sends its tokens' per-expert counts (all-to-all), then the tokens themselves
            (all-to-all with those variable splits), and groups what it received by local expert;
  combine   the outputs go back the same way, in reverse.
Both all-to-alls are differentiable (backward is the reverse exchange), and they are plain
torch.distributed collectives, so they run on gloo. The split sizes must reach the host: dispatch
costs one device-to-host copy per layer (two with expert TP), as in TorchTitan and Megatron.
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
    outputs in the same order, with weights of shape (experts, ...).

    On a mesh with an "ep" dim the experts are split over it (Shard(0)) and tokens travel to their
    expert's rank. On one with a "tp" dim each expert's hidden dim is split over it (`hidden_dims`:
    parameter name -> that dim): every tp rank then runs its slice of the local experts on the
    tokens of all tp ranks (gathered by all-to-all, since each tp rank routed its own sequence
    shard), and the partial outputs go back to their tp rank, which sums them.
    """

    def __init__(self, hidden_dims: dict[str, int] | None = None):
        super().__init__()
        self.hidden_dims = hidden_dims or {}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        names = device_mesh.mesh_dim_names
        self.ep = device_mesh["ep"] if "ep" in names else None
        self.tp = device_mesh["tp"] if "tp" in names else None
        return distribute_module(module, device_mesh, self._shard, self._dispatch, self._combine)

    def _shard(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            placements = ([Shard(0)] if self.ep else []) + ([Shard(self.hidden_dims[param_name])] if self.tp else [])
            sharded = nn.Parameter(distribute_tensor(param, mesh, placements, src_data_rank=None))
            module.register_parameter(param_name, sharded)

    def _dispatch(self, module: nn.Module, inputs, mesh: DeviceMesh):
        tokens, counts = inputs
        ep_state = tp_state = None
        if self.ep:
            tokens, counts, ep_state = exchange_over_ep(tokens, counts, self.ep.get_group(), self.ep.size())
        if self.tp:
            tokens, counts, tp_state = gather_over_tp(tokens, counts, self.tp.get_group(), self.tp.size())
        module._ep_state = (ep_state, tp_state)
        return tokens, counts

    def _combine(self, module: nn.Module, outputs: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        ep_state, tp_state = module._ep_state
        if tp_state:
            order, receive, rows, group, ranks = tp_state
            outputs = _AllToAll.apply(by_source(outputs, order), [rows] * ranks, receive, group).view(ranks, rows, -1).sum(dim=0)
        if ep_state:
            order, receive, send, group = ep_state
            outputs = _AllToAll.apply(by_source(outputs, order), send, receive, group)
        return outputs


def by_source(outputs: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Undo dispatch's regrouping: rows back in the order they arrived in (by source rank)."""
    return torch.empty_like(outputs).index_copy(0, order, outputs)


def exchange_over_ep(tokens: torch.Tensor, counts: torch.Tensor, group, ranks: int):
    """Each token to the rank holding its expert: (tokens by local expert, counts per local expert, state)."""
    # received[src, e]: tokens rank src sends to this rank's local expert e.
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    received = received.view(ranks, -1)
    sizes = torch.cat([counts.view(ranks, -1).sum(dim=1), received.sum(dim=1)]).tolist()  # one host sync
    send, receive = sizes[:ranks], sizes[ranks:]
    arrived = _AllToAll.apply(tokens, receive, send, group)
    # Arrived by (source rank, local expert); the experts want them by (local expert, source rank).
    order = segment_order(received, sum(receive))
    return arrived[order], received.sum(dim=0), (order, receive, send, group)


def gather_over_tp(tokens: torch.Tensor, counts: torch.Tensor, group, ranks: int):
    """Every tp rank's tokens for the local experts, grouped by expert (each rank sends all of its own
    to every rank; backward sums the gradients its copies get back)."""
    everyone = [torch.empty_like(counts) for _ in range(ranks)]
    dist.all_gather(everyone, counts, group=group)
    everyone = torch.stack(everyone)  # (tp source, local expert)
    receive, rows = everyone.sum(dim=1).tolist(), tokens.shape[0]
    arrived = _AllToAll.apply(tokens.repeat(ranks, 1), receive, [rows] * ranks, group)
    order = segment_order(everyone, sum(receive))
    return arrived[order], everyone.sum(dim=0), (order, receive, rows, group, ranks)


def apply_ep(model: nn.Module, plan, mesh: DeviceMesh) -> None:
    """`mesh`: ("ep",), ("tp",) or ("ep", "tp"), as ExpertParallel says."""
    for experts in plan.experts(model):
        parallelize_module(experts, mesh, ExpertParallel(plan.expert_hidden_dims))
