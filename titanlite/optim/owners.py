"""Where Muon's Newton-Schulz runs: each sharded matrix gathered whole on one owner rank of its
shard group, orthogonalized there, its pieces sent back (as Dion's distributed Muon and Essential
AI's layer sharding do); each matrix, largest first, goes to the rank with the least work so far.
The whole step then costs one gather and one scatter of each matrix, and each rank orthogonalizes
1/W of them.

A parameter may be cut along several mesh dims (FSDP x TP, EP x FSDP, HSDP's shard dim in each
replica group): the gather undoes the cuts one mesh dim at a time, the last cut first (FSDP's
`_StridedShard` over TP or EP cuts the piece the later dims cut, so it comes last), each step
gathering on the rank whose coordinate on that dim is the owner's; the scatter redoes them in
order. A mesh dim of one rank cuts nothing. A plain tensor, or a cut this file does not undo, is
gathered whole by every rank (`every_rank`, Moonlight's Algorithm 1), which is also the way
`optimizer.ns_distribution = "every_rank"` asks for everywhere.

Pieces travel in the Newton-Schulz dtype when it is the smaller one: converting first is what
Newton-Schulz does anyway, so the result is the same bits.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard


def every_rank(p: torch.Tensor, update: torch.Tensor, orthogonal: Callable, travel: torch.dtype) -> torch.Tensor:
    """This rank's piece of the orthogonalized whole, the whole gathered on every rank."""
    if not isinstance(p, DTensor):
        return orthogonal(update).to(update.dtype)
    mine = update.to(travel)
    full = DTensor.from_local(mine, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False).full_tensor()
    replicated = DTensor.from_local(orthogonal(full).to(update.dtype), p.device_mesh, [Replicate()] * p.device_mesh.ndim, run_check=False)
    return replicated.redistribute(p.device_mesh, p.placements).to_local()


def cuts(p: torch.Tensor) -> list[tuple[int, int]] | None:
    """Each (mesh dim, tensor dim) that cuts `p` into torch.chunk's pieces, in the order they cut
    the whole; None for a plain tensor or a placement this file does not undo."""
    if not isinstance(p, DTensor):
        return None
    mesh, plain, strided = p.device_mesh, [], []
    for m, placement in enumerate(p.placements):
        if isinstance(placement, Replicate) or mesh.size(m) == 1:
            continue
        if type(placement) is Shard:
            plain.append((m, placement.dim))
        elif isinstance(placement, _StridedShard):
            strided.append((m, placement.dim, placement.split_factor))
        else:
            return None
    for m, dim, split in strided:  # FSDP over TP or EP: it cuts each piece the later dims cut
        later = [n for n, d in plain if d == dim and n > m]
        if len(strided) > 1 or any(d == dim and n < m for n, d in plain) or split != math.prod(mesh.size(n) for n in later):
            return None
    return plain + [(m, dim) for m, dim, _ in strided] or None


def local_piece(p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `whole`, a tensor shaped as `p` and to be placed as it is (a view where it can)."""
    if not isinstance(p, DTensor):
        return whole
    plan = cuts(p)
    if plan is None:  # replicated, or a placement the cuts do not undo: DTensor's own split, from the whole at hand
        return distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None).to_local()
    me = p.device_mesh.get_coordinate()
    for m, dim in plan:
        sizes = piece_sizes(whole.shape[dim], p.device_mesh.size(m))
        whole = whole.narrow(dim, sum(sizes[:me[m]]), sizes[me[m]])
    return whole


def piece_sizes(n: int, ranks: int) -> list[int]:
    """torch.chunk's sizes, which DTensor's Shard uses: ceil(n / ranks) each, the last ones short or empty."""
    size = -(-n // ranks)
    return [max(0, min(size, n - r * size)) for r in range(ranks)]


def padded(piece: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`piece` grown along `dim` to `size` (collectives take equal sizes)."""
    shape = list(piece.shape)
    shape[dim] = size - piece.shape[dim]
    return torch.cat([piece, piece.new_zeros(shape)], dim=dim).contiguous() if shape[dim] else piece.contiguous()


@dataclass
class Matrix:
    """One parameter on its way to its owner and back: `shapes[j]` is its shape after the first j
    cuts (this rank's piece), `current` what this rank holds of it now (None once it has handed it on)."""
    index: int
    mesh: object
    cuts: list[tuple[int, int]]
    owner: dict[int, int]
    me: list[int]
    shapes: list[list[int]]
    current: torch.Tensor | None

    def takes_part(self, j: int) -> bool:
        """Whether this rank is in step j (undoing cut j): its coordinates on the later cuts' dims are the owner's."""
        return all(self.me[m] == self.owner[m] for m, _ in self.cuts[j + 1:])

    def sizes(self, j: int) -> list[int]:
        m, dim = self.cuts[j]
        return piece_sizes(self.shapes[j][dim], self.mesh.size(m))


def orthogonal_pieces(params: list[torch.Tensor], updates: list[torch.Tensor], orthogonals: list[Callable],
                      owners: bool, ns_dtype: torch.dtype) -> list[torch.Tensor]:
    """This rank's piece of each parameter's orthogonalized update (`orthogonals[i]` maps parameter i's
    whole update to its orthogonalized whole), in the update's dtype.
    Collective: every rank of each parameter's mesh calls it alike."""
    results: list[torch.Tensor | None] = [None] * len(params)
    load = defaultdict(float)  # the work dealt so far to each rank of each group of ranks sharing matrices
    matrices = []
    for i in sorted(range(len(params)), key=lambda i: -cost(params[i])):  # the largest first: the load evens out
        p, update = params[i], updates[i]
        travel = min(ns_dtype, update.dtype, key=lambda d: d.itemsize)
        plan = cuts(p) if owners else None
        if plan is None:
            results[i] = every_rank(p, update, orthogonals[i], travel)
            continue
        mesh, me = p.device_mesh, p.device_mesh.get_coordinate()
        dims = [m for m, _ in plan]
        shapes = [list(p.shape)]
        for m, dim in plan:
            shapes.append(list(shapes[-1]))
            shapes[-1][dim] = piece_sizes(shapes[-2][dim], mesh.size(m))[me[m]]
        group = tuple(mesh.mesh[tuple(slice(None) if n in dims else me[n] for n in range(mesh.ndim))].flatten().tolist())
        owner = min(itertools.product(*(range(mesh.size(m)) for m in dims)), key=lambda o: (load[group, o], o))
        load[group, owner] += cost(p)
        matrices.append(Matrix(i, mesh, plan, dict(zip(dims, owner)), me, shapes, update.to(travel)))
    steps = max((len(x.cuts) for x in matrices), default=0)
    for back in range(steps):  # gather: undo the last cut first
        works = []
        for x in matrices:
            j = len(x.cuts) - 1 - back
            if j < 0 or not x.takes_part(j):
                continue
            m, dim = x.cuts[j]
            sizes, mine = x.sizes(j), x.me[m] == x.owner[m]
            piece = padded(x.current, dim, sizes[0])
            pieces = [torch.empty_like(piece) for _ in sizes] if mine else None
            works.append((x, dim, sizes, pieces, dist.gather(piece, pieces, group=x.mesh.get_group(m), group_dst=x.owner[m], async_op=True)))
        for x, dim, sizes, pieces, work in works:
            work.wait()
            x.current = torch.cat([b.narrow(dim, 0, n) for b, n in zip(pieces, sizes)], dim=dim) if pieces else None
    for x in matrices:
        if x.current is not None:  # the owner: it holds the whole
            x.current = orthogonals[x.index](x.current).to(updates[x.index].dtype)
    for j in range(steps):  # scatter: redo the cuts in order
        works = []
        for x in matrices:
            if j >= len(x.cuts) or not x.takes_part(j):
                continue
            m, dim = x.cuts[j]
            sizes = x.sizes(j)
            sends = None
            if x.me[m] == x.owner[m]:
                starts = [sum(sizes[:r]) for r in range(len(sizes))]
                sends = [padded(x.current.narrow(dim, s, n), dim, sizes[0]) for s, n in zip(starts, sizes)]
            shape = list(x.shapes[j])
            shape[dim] = sizes[0]
            out = updates[x.index].new_empty(shape)
            works.append((x, dim, sizes[x.me[m]], out, dist.scatter(out, sends, group=x.mesh.get_group(m), group_src=x.owner[m], async_op=True)))
        for x, dim, size, out, work in works:
            work.wait()
            x.current = out.narrow(dim, 0, size)
    for x in matrices:
        results[x.index] = x.current
    return results


def cost(p: torch.Tensor) -> float:
    """Newton-Schulz's work on p, up to a constant: rows x cols x min(rows, cols) per matrix."""
    rows, cols = p.shape[-2:]
    return math.prod(p.shape[:-2]) * rows * cols * min(rows, cols)
