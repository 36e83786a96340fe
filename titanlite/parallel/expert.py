"""Expert parallel: the routed experts of each MoE layer split over the `ep` ranks (a view that
borrows dp_shard x cp, and tp unless the experts are split by tp; parallel/dims.py), and the tokens
travel to the rank that holds their expert. Expert tensor parallel splits each expert's hidden dim
over tp as well.

`ExpertParallel` is a ParallelStyle for the family's expert modules. Their weights become DTensors
sharded over experts (Shard(0) on `ep`; with ETP also Shard(hidden) on `tp`), so checkpoints hold
the full tensors and load on any EP degree. Around each forward:
  dispatch  each rank sends its tokens' per-expert counts (all-to-all), then the tokens themselves
            (all-to-all with those variable splits; the layer's shared experts run while they
            travel), and groups what it received by local expert;
  combine   the outputs go back the same way, in reverse.
With expert TP the tp ranks then all-gather their tokens and reduce-scatter the partial outputs.
Every exchange is differentiable (backward is the reverse exchange), and they are plain
torch.distributed collectives, so they run on gloo. The split sizes must reach the host: dispatch
costs one device-to-host read per layer (expert TP's sizes included), as in TorchTitan and Megatron.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from titanlite.parallel.activation_checkpoint import ForwardReplay


class _AllToAll(torch.autograd.Function):
    """Rows of `x` in `send` blocks to each rank of `group`; `receive` rows come back. Backward sends
    the gradients the other way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, receive: list[int], send: list[int], group, pending: list | None = None) -> torch.Tensor:
        """`pending`: return at once and append the exchange's Work, whose wait() fills the output."""
        ctx.receive, ctx.send, ctx.group = receive, send, group
        out = x.new_empty(sum(receive), *x.shape[1:])
        work = dist.all_to_all_single(out, x.contiguous(), receive, send, group=group, async_op=pending is not None)
        if pending is not None:
            pending.append(work)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.receive, group=ctx.group)
        return out, None, None, None, None


class InFlight:
    """Collectives launched and not yet waited for (true until `wait`)."""

    def __init__(self):
        self.works = []

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works.clear()

    def __bool__(self) -> bool:
        return bool(self.works)


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
    parameter name -> that dim): the tp ranks all-gather their tokens for the local experts (each
    routed its own sequence shard), every tp rank runs its slice of the experts on all of them,
    and a reduce-scatter sums the partial outputs, each tp rank keeping its own tokens'. The
    token counts of both exchanges reach the host in one read.
    """

    def __init__(self, hidden_dims: dict[str, int] | None = None):
        super().__init__()
        self.hidden_dims = hidden_dims or {}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        names = device_mesh.mesh_dim_names
        module.forward_replay = ForwardReplay()  # activation checkpointing's recompute exchanges nothing
        self.ep = device_mesh["ep"] if "ep" in names else None
        self.tp = device_mesh["tp"] if "tp" in names else None
        return distribute_module(module, device_mesh, self._shard, self._dispatch, self._combine)

    def _shard(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            placements = ([Shard(0)] if self.ep else []) + ([Shard(self.hidden_dims[param_name])] if self.tp else [])
            sharded = nn.Parameter(distribute_tensor(param, mesh, placements, src_data_rank=None))
            module.register_parameter(param_name, sharded)

    def _dispatch(self, module: nn.Module, inputs, mesh: DeviceMesh):
        tokens, counts, *meanwhile = inputs
        replay = module.forward_replay
        replay.begin()
        ep_ranks = self.ep.size() if self.ep else 1
        # received[src, e]: tokens EP rank src sends to this rank's local expert e.
        received = replay(lambda: exchange_counts(counts, self.ep.get_group(), ep_ranks)) if self.ep else counts.view(1, -1)
        # tp_counts[t, e]: tokens tp rank t holds (after EP) for local expert e.
        local_counts = received.sum(dim=0)
        tp_counts = replay(lambda: gather_counts(local_counts, self.tp.get_group(), self.tp.size())) if self.tp else None
        size_tensor = torch.cat([counts.view(ep_ranks, -1).sum(dim=1), received.sum(dim=1)] + ([tp_counts.sum(dim=1)] if self.tp else []))
        sizes = replay(lambda: size_tensor.tolist())  # the one host read: every buffer size of both exchanges
        send, receive, tp_rows = sizes[:ep_ranks], sizes[ep_ranks:2 * ep_ranks], sizes[2 * ep_ranks:]
        ep_state = tp_state = None
        if self.ep:
            # The tokens' exchange runs while the layer's other work (shared experts) does.
            in_flight = module.tokens_in_flight = InFlight()
            arrived = replay(lambda: _AllToAll.apply(tokens, receive, send, self.ep.get_group(), in_flight.works), bulky=True)
            if meanwhile and meanwhile[0] is not None:
                meanwhile[0]()
            in_flight.wait()
            # Arrived by (source rank, local expert); the experts want them by (local expert, source rank).
            ep_order = segment_order(received, sum(receive))
            tokens, counts, ep_state = arrived[ep_order], received.sum(dim=0), (ep_order, receive, send)
        if self.tp:
            gathered = replay(lambda: _GatherRows.apply(tokens, tp_rows, self.tp.get_group()), bulky=True)
            tp_order = segment_order(tp_counts, sum(tp_rows))
            tokens, counts, tp_state = gathered[tp_order], tp_counts.sum(dim=0), (tp_order, tp_rows)
        module._ep_state = (ep_state, tp_state)
        return tokens, counts

    def _combine(self, module: nn.Module, outputs: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        ep_state, tp_state = module._ep_state
        replay = module.forward_replay
        if tp_state:
            tp_order, tp_rows = tp_state
            partials = by_source(outputs, tp_order)
            outputs = replay(lambda: _SumRowsScatter.apply(partials, tp_rows, self.tp.get_group()), bulky=True)
        if ep_state:
            ep_order, receive, send = ep_state
            by_rank = by_source(outputs, ep_order)
            outputs = replay(lambda: _AllToAll.apply(by_rank, send, receive, self.ep.get_group()), bulky=True)
        return outputs


def by_source(outputs: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Undo dispatch's regrouping: rows back in the order they arrived in (by source rank)."""
    return torch.empty_like(outputs).index_copy(0, order, outputs)


def exchange_counts(counts: torch.Tensor, group, ranks: int) -> torch.Tensor:
    """(source EP rank, local expert): how many tokens each rank sends to each of this rank's experts."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    return received.view(ranks, -1)


def gather_counts(counts: torch.Tensor, group, ranks: int) -> torch.Tensor:
    """(tp rank, local expert): every tp rank's token counts for the local experts."""
    everyone = counts.new_empty(ranks * counts.numel())
    dist.all_gather_into_tensor(everyone, counts.contiguous(), group=group)
    return everyone.view(ranks, -1)


class _GatherRows(torch.autograd.Function):
    """Every rank's rows (`sizes[r]` on rank r), concatenated in rank order (an all-gather). Backward:
    each rank's block of the gradient, summed over the ranks (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
        ctx.sizes, ctx.group = sizes, group
        return _gather(rows, sizes, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _sum_scatter(grad, ctx.sizes, ctx.group), None, None


class _SumRowsScatter(torch.autograd.Function):
    """The reverse: rows in rank blocks (`sizes`), summed over the ranks, each keeping its own block.
    Backward: the all-gather."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
        ctx.sizes, ctx.group = sizes, group
        return _sum_scatter(rows, sizes, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather(grad, ctx.sizes, ctx.group), None, None


def _padded(rows: torch.Tensor, length: int) -> torch.Tensor:
    return torch.cat([rows, rows.new_zeros(length - rows.shape[0], *rows.shape[1:])]) if length > rows.shape[0] else rows


# Blocks of unequal sizes travel padded to the largest: the collectives take equal blocks.
def _gather(rows: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    longest = max(sizes)
    out = rows.new_empty(len(sizes) * longest, *rows.shape[1:])
    dist.all_gather_into_tensor(out, _padded(rows, longest).contiguous(), group=group)
    return torch.cat([block[:n] for block, n in zip(out.split(longest), sizes)])


def _sum_scatter(rows: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    longest = max(sizes)
    blocks = torch.cat([_padded(block, longest) for block in rows.split(sizes)])
    out = rows.new_empty(longest, *rows.shape[1:])
    dist.reduce_scatter_tensor(out, blocks.contiguous(), group=group)
    return out[: sizes[dist.get_rank(group)]]


def apply_ep(model: nn.Module, plan, mesh: DeviceMesh) -> None:
    """`mesh`: ("ep",), ("tp",) or ("ep", "tp"), as ExpertParallel says."""
    for experts in plan.experts(model):
        parallelize_module(experts, mesh, ExpertParallel(plan.expert_hidden_dims))
