"""Context parallel's attention under document masks: this cp rank's queries over every cp rank's
keys, each KV shard travelling with its tokens' document ids and positions, so the mask of every
(query shard, KV shard) pair is exact whatever the load balancer put where.

The KV shards are all gathered at once (`allgather`) or passed around the ring while each rank
computes (`alltoall`), as `parallelism.context_parallel_rotate_method` says. Scores of each visiting
shard are computed in fp32, in blocks of query rows (at most SCORE_TILE_ELEMENTS at a time), and
merged by their log-sum-exp (flash attention's recurrence). Backward recomputes them shard by shard
from the saved output and log-sum-exp; each shard's key/value gradients go back to the rank that
holds it (a reduce-scatter, or one more hop around the ring). GQA shares each KV head among its
query heads without repeating k and v.

A visiting shard that no local query may see (Llama 4's chunks, or documents, wholly elsewhere) is
not computed on, forward or backward (it still travels on), and counted in ROUNDS. Which shards
those are is found once per call (`rounds_seen`: one read to the host per layer), not per round.

Forward and backward are custom ops: activation checkpointing's per-op policy sees one op (and
keeps its output and log-sum-exp, not its score tiles), and torch.compile graphs hold the op, not
its collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from titanlite.models.common.attention import DocumentMask

SCORE_TILE_ELEMENTS = 2**26  # fp32 scores held at once: 256 MiB


@torch.library.custom_op("titanlite::document_ring", mutates_args=())
def document_ring(
    q: Tensor, k: Tensor, v: Tensor, document_ids: Tensor, positions: Tensor, group_name: str, rotate_method: str,
    window: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """q (b, heads, s, d); k, v (b, kv_heads, s, d); document ids and positions (b, s) of this rank's
    tokens; `window`: DocumentMask's sliding window (0: none). Returns the attention output (like q),
    its log-sum-exp (b, heads, s, fp32; differentiable: attention sinks rescale by it), and which
    rounds' KV shards its queries see (`rounds_seen`; kept for backward)."""
    group = _resolve_process_group(group_name)
    local = DocumentMask(document_ids, positions, window=window)
    seen = rounds_seen(local, group)
    q5, scale = _grouped(q, k.shape[1]), q.shape[-1] ** -0.5
    out = lse = None
    # The own shard comes first, and each query sees at least itself there: lse is finite from then on.
    rounds = _visits([torch.stack([k, v]), torch.stack([document_ids, positions])], group, rotate_method)
    for (kv, layout), run in zip(rounds, _counted(seen, "forward")):
        if not run:
            continue
        allowed = local.allowed(layout[0], layout[1]).unsqueeze(1)  # (b, 1, 1, sq, sk)
        shard_out, shard_lse = _attend(q5, kv[0], kv[1], allowed, scale)
        if out is None:
            out, lse = shard_out, shard_lse
            continue
        merged = torch.logaddexp(lse, shard_lse)
        out = out * torch.exp(lse - merged)[..., None] + shard_out * torch.exp(shard_lse - merged)[..., None]
        lse = merged
    return out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2), seen


@document_ring.register_fake
def _(q, k, v, document_ids, positions, group_name, rotate_method, window=0):
    cp = dist.get_world_size(_resolve_process_group(group_name))
    # Contiguous, as the real ones.
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32), torch.empty(cp, dtype=torch.bool)


@torch.library.custom_op("titanlite::document_ring_backward", mutates_args=())
def document_ring_backward(
    grad_out: Tensor, grad_lse: Tensor, q: Tensor, k: Tensor, v: Tensor, document_ids: Tensor, positions: Tensor,
    seen: Tensor, out: Tensor, lse: Tensor, group_name: str, rotate_method: str, window: int,
) -> tuple[Tensor, Tensor, Tensor]:
    group = _resolve_process_group(group_name)
    n, kv_heads = dist.get_world_size(group), k.shape[1]
    local = DocumentMask(document_ids, positions, window=window)
    q5, grad5, scale = _grouped(q, kv_heads), _grouped(grad_out, kv_heads), q.shape[-1] ** -0.5
    lse = lse.view(q5.shape[:-1])
    # Softmax's backward term per query row; the log-sum-exp's own gradient g adds g * p to each score's.
    row_dot = (grad5 * _grouped(out, kv_heads)).sum(-1, keepdim=True) - grad_lse.view(q5.shape[:-1]).unsqueeze(-1)
    grad_q = q5.new_zeros(q5.shape)  # contiguous (q5 may be a strided view of q), as the fake output says
    by_shard = []  # allgather: each visiting shard's key/value gradients
    travelling = None  # alltoall: the gradients of the shard now here, summed over the ranks it visited
    rounds = _visits([torch.stack([k, v]), torch.stack([document_ids, positions])], group, rotate_method)
    for (kv, layout), run in zip(rounds, _counted(seen, "backward")):
        if run:
            allowed = local.allowed(layout[0], layout[1]).unsqueeze(1)
            grad_kv = _gradients(q5, grad5, row_dot, lse, kv[0], kv[1], allowed, scale, grad_q)
        else:
            grad_kv = kv.new_zeros(kv.shape, dtype=torch.float32)  # still sent home: the sums keep their order
        if rotate_method == "allgather":
            by_shard.append(grad_kv)
        else:
            travelling = grad_kv if travelling is None else pass_on(travelling, group) + grad_kv
    if rotate_method == "allgather":
        rank = dist.get_rank(group)
        ordered = torch.cat([by_shard[(rank - i) % n] for i in range(n)])  # by the rank holding each shard
        grad_kv = ordered.new_empty(by_shard[0].shape)
        dist.reduce_scatter_tensor(grad_kv, ordered, group=group)
    else:
        grad_kv = pass_on(travelling, group) if n > 1 else travelling  # the last shard's sums go home
    # Copies: a custom op's outputs may not be views of one another.
    return grad_q.flatten(1, 2).to(q.dtype), grad_kv[0].to(k.dtype, copy=True), grad_kv[1].to(v.dtype, copy=True)


@document_ring_backward.register_fake
def _(grad_out, grad_lse, q, k, v, document_ids, positions, seen, out, lse, group_name, rotate_method, window):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, document_ids, positions, ctx.group_name, ctx.rotate_method, ctx.window = inputs
    out, lse, seen = output
    ctx.save_for_backward(q, k, v, document_ids, positions, seen, out, lse)


def _backward(ctx, grad_out, grad_lse, _grad_seen):
    saved = ctx.saved_tensors
    grad_lse = torch.zeros_like(saved[-1]) if grad_lse is None else grad_lse
    grads = document_ring_backward(grad_out, grad_lse, *saved, ctx.group_name, ctx.rotate_method, ctx.window)
    return *grads, None, None, None, None, None


document_ring.register_autograd(_backward, setup_context=_setup_context)


# Rounds run and skipped, by pass: a KV shard that no query here may see (all in other documents or
# chunks) is not computed on; it still travels on to the ranks that need it.
ROUNDS = {(direction, outcome): 0 for direction in ("forward", "backward") for outcome in ("run", "skipped")}


def _counted(seen: Tensor, direction: str) -> list[bool]:
    runs = seen.tolist()  # on the host already
    for run in runs:
        ROUNDS[direction, "run" if run else "skipped"] += 1
    return runs


def rounds_seen(local: DocumentMask, group) -> Tensor:
    """(cp,) booleans on the host: whether any of this rank's queries sees a key of round j's KV shard
    (cp rank (rank - j) mod cp). The layouts are gathered and the answer read to the host once per
    call, not per round; backward reuses it."""
    layouts = _visits([torch.stack([local.document_ids, local.positions])], group, "allgather")
    seen = torch.stack([local.allowed(layout[0][0], layout[0][1]).any() for layout in layouts])
    return seen.cpu()


def _visits(local: list[Tensor], group, rotate_method: str):
    """Yields, for j = 0 .. cp-1, the tensors of the shard of cp rank (rank - j) mod cp: all gathered
    at once (allgather), or each passed on to the next rank while this one computes (alltoall).
    (Plain c10d collectives: the custom op hides them from torch.compile.)"""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if rotate_method == "allgather":
        gathered = []
        for t in local:
            out = t.new_empty((n * t.shape[0], *t.shape[1:]))
            dist.all_gather_into_tensor(out, t.contiguous(), group=group)
            gathered.append(out.chunk(n))
        for j in range(n):
            yield [g[(rank - j) % n] for g in gathered]
        return
    for j in range(n):
        transfer = _Pass(local, group) if j < n - 1 else None
        yield local
        if transfer is not None:
            local = transfer.wait()


class _Pass:
    """Sends tensors to the next cp rank and receives the previous rank's, asynchronously; the
    tensors sent stay referenced here until wait()."""

    def __init__(self, tensors: list[Tensor], group):
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        following, previous = dist.get_global_rank(group, (rank + 1) % n), dist.get_global_rank(group, (rank - 1) % n)
        self.sent = [t.contiguous() for t in tensors]
        self.received = [torch.empty_like(t) for t in self.sent]
        ops = [dist.P2POp(dist.isend, t, following, group) for t in self.sent]
        ops += [dist.P2POp(dist.irecv, t, previous, group) for t in self.received]
        self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> list[Tensor]:
        for work in self.works:
            work.wait()
        return self.received


def pass_on(t: Tensor, group) -> Tensor:
    """Send `t` to the next cp rank; returns the previous rank's."""
    return _Pass([t], group).wait()[0]


def _grouped(t: Tensor, kv_heads: int) -> Tensor:
    """(b, heads, s, d) -> fp32 (b, kv_heads, heads per kv head, s, d): query head i reads kv head
    i // (heads / kv_heads), as repeat_interleave pairs them."""
    b, heads, s, d = t.shape
    return t.float().view(b, kv_heads, heads // kv_heads, s, d)


def _row_blocks(q5: Tensor, keys: int) -> list[slice]:
    """Slices of the query rows whose scores against `keys` keys fit in SCORE_TILE_ELEMENTS."""
    b, groups, per_group, rows, _ = q5.shape
    step = max(1, SCORE_TILE_ELEMENTS // (b * groups * per_group * keys))
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


def _masked_scores(q_rows: Tensor, k: Tensor, visible: Tensor) -> Tensor:
    """Scores of some (pre-scaled) query rows against a KV shard; -inf where masked."""
    return (q_rows @ k.transpose(-1, -2)).masked_fill_(~visible, float("-inf"))


def _attend(q5: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Output and log-sum-exp of the grouped queries over one KV shard (a row that sees nothing of
    it: output 0, log-sum-exp -inf)."""
    kf, vf, q5 = k.float().unsqueeze(2), v.float().unsqueeze(2), q5 * scale
    out, lse = q5.new_empty(q5.shape[:-1] + vf.shape[-1:]), q5.new_empty(q5.shape[:-1])
    for rows in _row_blocks(q5, kf.shape[-2]):
        scores = _masked_scores(q5[..., rows, :], kf, allowed[..., rows, :])
        row_max = scores.amax(dim=-1, keepdim=True).nan_to_num_(neginf=0.0)  # 0 on a row that sees nothing
        weights = scores.sub_(row_max).exp_()
        total = weights.sum(dim=-1, keepdim=True)  # >= 1 on a row that sees something, 0 on one that does not
        out[..., rows, :] = (weights @ vf) / total.clamp(min=1.0)
        lse[..., rows] = (row_max + total.log()).squeeze(-1)
    return out, lse


def _gradients(q5, grad5, row_dot, lse, k, v, allowed, scale: float, grad_q: Tensor) -> Tensor:
    """Adds the queries' gradient from one KV shard to `grad_q`; returns that shard's stacked key and
    value gradients (b, kv_heads, sk, d) summed over its query heads. `lse` is the whole attention's
    (finite: each query sees itself), so the probabilities need no renormalizing."""
    kf, vf, scaled = k.float().unsqueeze(2), v.float().unsqueeze(2), q5 * scale
    grad_k, grad_v = torch.zeros_like(kf[:, :, 0]), torch.zeros_like(vf[:, :, 0])
    for rows in _row_blocks(q5, kf.shape[-2]):
        probs = _masked_scores(scaled[..., rows, :], kf, allowed[..., rows, :]).sub_(lse[..., rows, None]).exp_()
        grad_scores = (grad5[..., rows, :] @ vf.transpose(-1, -2)).sub_(row_dot[..., rows, :]).mul_(probs)
        grad_q[..., rows, :] += grad_scores @ kf * scale
        grad_k += (grad_scores.transpose(-1, -2) @ q5[..., rows, :]).sum(2) * scale
        grad_v += (probs.transpose(-1, -2) @ grad5[..., rows, :]).sum(2)
    return torch.stack([grad_k, grad_v])
