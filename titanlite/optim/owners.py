"""Where Muon's Newton-Schulz runs: each sharded matrix gathered whole on one owner rank of its
shard group, orthogonalized there, its pieces sent back (as Dion's distributed Muon and Essential
AI's layer sharding do); each matrix, largest first, goes to the rank with the least work so far. The whole step then costs one gather and
one scatter of each matrix, and each rank orthogonalizes 1/W of them.

This layout-specific part is the only one: a parameter sharded along one mesh dim (FSDP's, TP's,
EP's; HSDP's shard dim, each replica group alone) takes the owners' way; one sharded along two
(FSDP x TP, EP x FSDP) or a plain tensor is gathered whole by every rank (`every_rank`, Moonlight's
Algorithm 1), which is also the way `optimizer.ns_distribution = "every_rank"` asks for everywhere.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard


def every_rank(p: torch.Tensor, update: torch.Tensor, orthogonal: Callable) -> torch.Tensor:
    """This rank's piece of the orthogonalized whole, the whole gathered on every rank."""
    if not isinstance(p, DTensor):
        return orthogonal(update)
    full = DTensor.from_local(update, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False).full_tensor()
    replicated = DTensor.from_local(orthogonal(full), p.device_mesh, [Replicate()] * p.device_mesh.ndim, run_check=False)
    return replicated.redistribute(p.device_mesh, p.placements).to_local()


def shard_dim(p: torch.Tensor) -> int | None:
    """The one mesh dim `p` is sharded along (plainly: torch.chunk's pieces), or None."""
    if not isinstance(p, DTensor):
        return None
    sharded = [i for i, placement in enumerate(p.placements) if not isinstance(placement, Replicate)]
    if len(sharded) != 1 or type(p.placements[sharded[0]]) is not Shard:
        return None
    return sharded[0]


def piece_sizes(n: int, ranks: int) -> list[int]:
    """torch.chunk's sizes, which DTensor's Shard uses: ceil(n / ranks) each, the last ones short or empty."""
    size = -(-n // ranks)
    return [max(0, min(size, n - r * size)) for r in range(ranks)]


def padded(piece: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`piece` grown along `dim` to `size` (collectives take equal sizes)."""
    shape = list(piece.shape)
    shape[dim] = size - piece.shape[dim]
    return torch.cat([piece, piece.new_zeros(shape)], dim=dim).contiguous() if shape[dim] else piece.contiguous()


def orthogonal_pieces(params: list[torch.Tensor], updates: list[torch.Tensor], orthogonals: list[Callable],
                      owners: bool) -> list[torch.Tensor]:
    """This rank's piece of each parameter's orthogonalized update (`orthogonals[i]` maps parameter i's
    whole update to its orthogonalized whole). Collective: every rank of each parameter's mesh calls
    it alike."""
    results: list[torch.Tensor | None] = [None] * len(params)
    load = defaultdict(float)  # the work dealt to each rank of each shard group so far
    gathered = []
    order = sorted(range(len(params)), key=lambda i: -cost(params[i]))  # the largest first: the load evens out
    for i in order:
        p, mesh_dim = params[i], shard_dim(params[i]) if owners else None
        if mesh_dim is None:
            results[i] = every_rank(p, updates[i], orthogonals[i])
            continue
        mesh, dim = p.device_mesh, p.placements[mesh_dim].dim
        group, ranks, me = mesh.get_group(mesh_dim), mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
        owner = min(range(ranks), key=lambda r: (load[(group, r)], r))
        load[(group, owner)] += cost(p)
        sizes = piece_sizes(p.shape[dim], ranks)
        piece = padded(updates[i], dim, sizes[0])
        pieces = [torch.empty_like(piece) for _ in range(ranks)] if me == owner else None
        work = dist.gather(piece, pieces, group=group, group_dst=owner, async_op=True)
        gathered.append((i, dim, group, owner, me, sizes, piece, pieces, work))
    scattered = []
    for i, dim, group, owner, me, sizes, piece, pieces, work in gathered:
        work.wait()
        out = torch.empty_like(piece)
        sends = None
        if me == owner:
            whole = torch.cat([b.narrow(dim, 0, n) for b, n in zip(pieces, sizes)], dim=dim)
            result = orthogonals[i](whole).to(piece.dtype)
            starts = [sum(sizes[:r]) for r in range(len(sizes))]
            sends = [padded(result.narrow(dim, s, n), dim, sizes[0]) for s, n in zip(starts, sizes)]
        scattered.append((i, dim, sizes[me], out, dist.scatter(out, sends, group=group, group_src=owner, async_op=True)))
    for i, dim, size, out, work in scattered:
        work.wait()
        results[i] = out.narrow(dim, 0, size)
    return results


def cost(p: torch.Tensor) -> float:
    """Newton-Schulz's work on p, up to a constant: rows x cols x min(rows, cols) per matrix."""
    rows, cols = p.shape[-2:]
    return math.prod(p.shape[:-2]) * rows * cols * min(rows, cols)
