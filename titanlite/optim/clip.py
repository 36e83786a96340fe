"""Gradients before the step: partial sums reduced once, the total norm over any mesh, clipping."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor, Replicate


@torch.no_grad()
def reduce_partial_grads(params) -> None:
    """Sum gradients that are still pending sums over a mesh dim (`Partial`), once, in one all-reduce
    per mesh, placement and dtype. Under tensor parallel without FSDP, sequence-parallel norm weights are
    replicated and their gradients arrive Partial over tp; left so, the grad norm and the optimizer
    step would each all-reduce them."""
    pending = defaultdict(list)
    for p in params:
        if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):
            pending[(p.grad.device_mesh, p.grad.placements, p.grad.dtype)].append(p)
    for (mesh, placements, _), group in pending.items():
        summed_placements = [Replicate() if pl.is_partial() else pl for pl in placements]
        locals_ = [p.grad.to_local() for p in group]
        flat = DTensor.from_local(torch.cat([g.flatten() for g in locals_]), mesh, placements, run_check=False)
        summed = flat.redistribute(mesh, summed_placements).to_local()
        for p, local, piece in zip(group, locals_, summed.split([g.numel() for g in locals_])):
            p.grad = DTensor.from_local(piece.view_as(local), mesh, summed_placements, run_check=False)


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, pp_group=None) -> torch.Tensor:
    """Total L2 norm of all gradients, correct whatever the layout, then clip to max_norm (if > 0).

    DTensor gradients (FSDP/TP/EP shards) give partial norms that `full_tensor()` reduces over their
    mesh; plain-tensor gradients are whole on every rank and count once. Under pipeline parallel
    each stage holds different parameters, so squared norms are summed over the pp group too.
    """
    groups = by_mesh(params)
    total_sq = torch.zeros((), device=next(iter(groups.values()))[0].grad.device if groups else "cpu")
    for mesh, group in groups.items():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        total_sq += (norm.full_tensor() if mesh is not None else norm).float() ** 2
    if pp_group is not None:
        torch.distributed.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    clip_to(params, max_norm, total)
    return total


def clip_to(params, max_norm: float, total: torch.Tensor) -> None:
    """Scale the gradients, whose total norm is `total`, to a total norm of at most max_norm (if > 0)."""
    if max_norm > 0:
        for group in by_mesh(params).values():  # foreach kernels take each mesh's DTensors (and plain tensors) apart
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)


def by_mesh(params) -> dict:
    """The parameters with gradients, one group per mesh (expert-parallel experts live on another mesh
    than the rest); plain tensors apart."""
    groups = defaultdict(list)
    for p in params:
        if p.grad is not None:
            groups[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p)
    return groups
