"""FSDP2 (`fully_shard`) per block, per module of the family's head (Llama: the embedding), its tail
as one unit (Llama: final norm + output) and the root; in forward each unit starts the next one's
all-gather.

One mesh dim shards (FSDP), two dims replicate-and-shard (HSDP); a replicate dim with shard size 1
is plain data parallel (DDP). Split routed experts (expert parallel, expert TP) are a unit of
their own on `expert_mesh` (the routing ranks that hold the same experts), inside their block's
unit, or no unit where that mesh is one rank and FSDP would neither cast nor offload them; under
tensor parallel a MoE layer is one on `moe_mesh` (the data ranks and tp, whose ranks routed other
tokens).
The loss is divided by the global count of valid tokens, so FSDP's
own averaging over ranks is turned off (gradient divide factor 1): gradients are summed. On CPU
the sum is an all-to-all of the gradient slices and a local add (`AllToAllReduceScatter`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.tensor import DTensor, Shard


def apply_fsdp(
    model: nn.Module,
    plan,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
    reshard_output_after_forward: bool,
    cpu_offload: bool = False,
    expert_mesh: DeviceMesh | None = None,
    moe_mesh: DeviceMesh | None = None,
) -> None:
    shard = dict(
        mesh=dp_mesh,
        # Inputs keep their dtype (TorchTitan's setting): the hidden state is already in param_dtype from the
        # embedding, and the RoPE rows each block is given stay fp32 instead of rounding to bf16's 8 bits.
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False),
        offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    )
    expert_params = {p for experts in plan.experts(model) for p in experts.parameters()}
    # Experts that no other routing rank holds (expert mesh of one rank) have nothing to gather or sum:
    # FSDP leaves them alone (wrapped, it copies them in and out of its buffers every pass). Not where
    # FSDP casts them to param_dtype (each MoE layer's own cast would then live until its backward,
    # FSDP's is freed after each block's forward) or offloads them (they would stay on the CPU).
    alone = (
        expert_mesh is not None and expert_mesh.size() == 1 and not cpu_offload
        and all(p.dtype == param_dtype for p in expert_params)
    )
    shard["ignored_params"] = expert_params if alone else None
    head, tail = _present(model, plan.head), _present(model, plan.tail)
    tied = shares_a_parameter(head, tail)
    if tied:  # tied embeddings: the head joins the tail's unit, gathered from the first forward on
        head, tail = [], head + tail
    for module in head:
        fully_shard(module, reshard_after_forward=reshard_after_forward, **shard)
    inner = []  # units inside blocks: split experts, MoE layers under TP
    for module in [*getattr(model, plan.blocks).values(), *tail]:  # MoE layers sit in blocks (and a tail's blocks)
        for mesh, units in ((None if alone else expert_mesh, plan.experts), (moe_mesh, plan.moe_layers)):
            if mesh is not None:
                for unit in units(module):
                    placement = experts_placement(expert_params, mesh)
                    fully_shard(unit, reshard_after_forward=reshard_after_forward, shard_placement_fn=placement, **(shard | {"mesh": mesh}))
                    inner.append(unit)
    elsewhere = [getattr(parent, name) for parent, name in plan.blocks_elsewhere(model)]  # in the tail (MTP's)
    blocks = [*getattr(model, plan.blocks).values(), *elsewhere]
    nested = {}  # block -> the units inside it
    for unit in inner:
        nested.setdefault(next(b for b in blocks if any(m is unit for m in b.modules())), []).append(unit)
    for block in blocks:
        placement = experts_placement(expert_params, dp_mesh)
        fully_shard(block, reshard_after_forward=reshard_after_forward, shard_placement_fn=placement, **shard)
    # The tail (the output) is used again right at the start of backward: by default keep it gathered.
    if tail:
        fully_shard(tail, reshard_after_forward=reshard_output_after_forward, **shard)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **shard)
    # Each unit starts the next one's all-gather as soon as its own is in: otherwise that gather would
    # start at the next unit's forward. On a GPU the CPU runs ahead of the kernels and it still overlaps;
    # on a CPU the thread that computes a block is the one that would start the gather, so nothing would.
    # A block's own units (experts) come along with it: otherwise they gather at their own forward,
    # right behind expert parallel's host read of the split sizes.
    tail_unit = [tail[0]] if tail else []
    units = [*head, *(tail_unit if tied else []), *getattr(model, plan.blocks).values(), *([] if tied else tail_unit), *elsewhere]
    for i, unit in enumerate(units):
        ahead = nested.get(unit, []) if i == 0 else []  # a first unit's own: no unit before it starts them
        if i + 1 < len(units):
            ahead = ahead + [units[i + 1], *nested.get(units[i + 1], [])]
        if ahead:
            unit.set_modules_to_forward_prefetch(ahead)
    gloo_reduce_scatter = AllToAllReduceScatter() if dist.get_backend(dp_mesh.get_group(-1)) == "gloo" else None
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain SUM (no pre-multiplied sum): same result, and gloo has no PREMUL_SUM.
            module.set_force_sum_reduction_for_comms(True)
            if gloo_reduce_scatter:
                module.set_custom_reduce_scatter(gloo_reduce_scatter)


class AllToAllReduceScatter(ReduceScatter):
    """A summing reduce-scatter for gloo, which runs `reduce_scatter` as a whole all-reduce and keeps
    one slice: each rank sends every other rank its slice and adds what it receives, half the bytes
    (2 ranks, 0.8M and 4.2M floats: 7.9 and 37 ms against 16 and 90 ms). What it receives is a second
    buffer the size of the unit's whole gradient, alive during the reduction. Another op, or an
    asynchronous call, goes to gloo's own."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        if op != dist.ReduceOp.SUM or async_op:
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        received = torch.empty(group.size(), output_tensor.numel(), dtype=input_tensor.dtype, device=input_tensor.device)
        dist.all_to_all_single(received, input_tensor.view(group.size(), -1), group=group)
        torch.sum(received, dim=0, out=output_tensor)


def experts_placement(expert_params: set, mesh: DeviceMesh):
    """FSDP's shard dim for a unit's parameters: dim 0, but for routed experts with fewer experts
    (dim 0) than ranks to shard them over, dim 1 (TorchTitan's rule) where the ranks divide it and
    expert TP has not split it: dim 0 would pad every rank to a whole expert (at 128 experts on 256
    ranks, twice the memory and all-gather bytes)."""
    ranks = mesh.size(mesh.ndim - 1)  # the shard dim (HSDP: the second)

    def placement(param: nn.Parameter) -> Shard:
        local = param.to_local() if isinstance(param, DTensor) else param
        taken = {pl.dim for pl in getattr(param, "placements", ()) if isinstance(pl, Shard)}
        if param in expert_params and local.shape[0] < ranks and 1 not in taken and local.shape[1] % ranks == 0:
            return Shard(1)  # FSDP2 shards dim 1 evenly only
        return Shard(0)

    return placement


def shares_a_parameter(modules: list[nn.Module], others: list[nn.Module]) -> bool:
    mine = {id(p) for m in modules for p in m.parameters()}
    return any(id(p) in mine for m in others for p in m.parameters())


def _present(model: nn.Module, names) -> list[nn.Module]:
    """The named modules this model holds (a pipeline stage has only some of them)."""
    return [m for m in (getattr(model, name) for name in names) if m is not None]
