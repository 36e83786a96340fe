"""Context parallel's attention for sliding-window layers (gpt-oss): a query sees keys at most
`window - 1` positions back, so each cp rank needs only the last window - 1 tokens of the chunk before
each of its own, and no more than that travels.

The sequence is cut into cp chunks (rank r holds chunk r), or under head-tail load balancing into
2 cp chunks (rank r holds r and 2cp-1-r, parallel/context.py). Each rank sends the tail of each chunk
it holds to the rank holding the next chunk (unless it holds that too), and receives the tail of the
chunk before each of its own: keys, values, document ids and positions. Its queries then attend over
its own keys and the tails, masked by (document, position, window) as without context parallel, so
the result is exact under document masks too. Backward returns each tail's key/value gradients to
the rank that sent it. Where a chunk is shorter than window - 1 tokens the caller runs the full ring.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from titanlite.models.common.attention import DocumentMask, sink_attention


TAIL_TOKENS_RECEIVED = [0]  # per sequence, summed over calls: the tests check no more than the window needs travels


def chunk_holder(chunk: int, ranks: int, load_balance: bool) -> tuple[int, int]:
    """(cp rank, local slot) holding a chunk of the sequence."""
    if not load_balance or chunk < ranks:
        return chunk, 0
    return 2 * ranks - 1 - chunk, 1


def neighbours(rank: int, ranks: int, load_balance: bool) -> tuple[list, list]:
    """(sends, receives): (local slot, peer rank) pairs of the tails this rank sends on and receives."""
    slots = 2 if load_balance else 1
    chunks = [rank, 2 * ranks - 1 - rank][:slots]
    sends, receives = [], []
    for slot, chunk in enumerate(chunks):
        if chunk + 1 < slots * ranks and (peer := chunk_holder(chunk + 1, ranks, load_balance)[0]) != rank:
            sends.append((slot, peer))
        if chunk > 0 and (peer := chunk_holder(chunk - 1, ranks, load_balance)[0]) != rank:
            receives.append((slot, peer))
    return sends, receives


def fits(seq_len: int, window: int, ranks: int, load_balance: bool) -> bool:
    """Whether each local chunk holds at least window - 1 tokens (then only the one before it is seen)."""
    slots = 2 if load_balance else 1
    return seq_len % slots == 0 and seq_len // slots >= window - 1


def _swap(pieces: list[torch.Tensor], sends: list, receives: list, group, empty) -> list[torch.Tensor]:
    """Sends pieces[i] to sends[i]'s peer; returns one buffer (`empty()`, filled) per receive."""
    received = [empty() for _ in receives]
    ops = [dist.P2POp(dist.isend, piece.contiguous(), dist.get_global_rank(group, peer), group)
           for piece, (_, peer) in zip(pieces, sends)]
    ops += [dist.P2POp(dist.irecv, buffer, dist.get_global_rank(group, peer), group) for buffer, (_, peer) in zip(received, receives)]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return received


def _tail(t: torch.Tensor, slot: int, chunk_len: int, tail: int) -> torch.Tensor:
    """The last `tail` tokens (last dim but one) of a local chunk."""
    return t[..., (slot + 1) * chunk_len - tail:(slot + 1) * chunk_len, :]


class _Tails(torch.autograd.Function):
    """Of stacked keys and values (2, b, kv_heads, s, d): the tails of this rank's chunks go to the next
    chunks' holders; returns the tails received, along the sequence. Backward sends their gradients home."""

    @staticmethod
    def forward(ctx, kv: torch.Tensor, sends, receives, group, chunk_len: int, tail: int):
        ctx.sends, ctx.receives, ctx.group, ctx.chunk_len, ctx.tail, ctx.shape = sends, receives, group, chunk_len, tail, kv.shape
        shape = (*kv.shape[:3], tail, kv.shape[4])
        received = _swap([_tail(kv, slot, chunk_len, tail) for slot, _ in sends], sends, receives, group, lambda: kv.new_empty(shape))
        return torch.cat(received, dim=3) if received else kv.new_empty(*kv.shape[:3], 0, kv.shape[4])

    @staticmethod
    def backward(ctx, grad):
        shape = (*ctx.shape[:3], ctx.tail, ctx.shape[4])
        # The gradients go back the way their tails came: receives become sends.
        back = _swap(list(grad.split(ctx.tail, dim=3)), ctx.receives, ctx.sends, ctx.group, lambda: grad.new_empty(shape))
        grad_kv = grad.new_zeros(ctx.shape)
        for (slot, _), piece in zip(ctx.sends, back):
            _tail(grad_kv, slot, ctx.chunk_len, ctx.tail).add_(piece)
        return grad_kv, None, None, None, None, None


def window_attention(q, k, v, mask: DocumentMask, sinks: torch.Tensor | None, group, load_balance: bool) -> torch.Tensor:
    """This rank's queries (b, heads, s, d) over its own keys and the tails before its chunks."""
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    sends, receives = neighbours(rank, ranks, load_balance)
    tail, chunk_len = mask.window - 1, q.shape[2] // (2 if load_balance else 1)
    layout = torch.stack([mask.document_ids, mask.positions]).unsqueeze(-1)  # (2, b, s, 1): the sequence next to last
    layout_shape = (*layout.shape[:2], tail, 1)
    layouts = _swap([_tail(layout, slot, chunk_len, tail) for slot, _ in sends], sends, receives, group,
                    lambda: layout.new_empty(layout_shape))
    kv_layout = torch.cat([layout, *layouts], dim=2).squeeze(-1)
    TAIL_TOKENS_RECEIVED[0] += len(layouts) * tail
    kv = torch.cat([torch.stack([k, v]), _Tails.apply(torch.stack([k, v]), sends, receives, group, chunk_len, tail)], dim=3)
    allowed = mask.allowed(kv_layout[0], kv_layout[1])
    if sinks is not None:
        return sink_attention(q, kv[0], kv[1], allowed, sinks)
    repeats = q.shape[1] // k.shape[1]
    keys, values = (t.repeat_interleave(repeats, dim=1) for t in (kv[0], kv[1]))
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed)

