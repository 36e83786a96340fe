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
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from titanlite.models.common.attention import DocumentMask, sink_attention


TAIL_TOKENS_RECEIVED = [0]  # per sequence, summed over calls: the tests check no more than the window needs travels


def slots(load_balance: bool) -> int:
    """Chunks a rank holds: two under head-tail balancing, else one."""
    return 2 if load_balance else 1


def chunk_holder(chunk: int, ranks: int, load_balance: bool) -> tuple[int, int]:
    """(cp rank, local slot) holding a chunk of the sequence."""
    if not load_balance or chunk < ranks:
        return chunk, 0
    return 2 * ranks - 1 - chunk, 1


def neighbours(rank: int, ranks: int, load_balance: bool) -> tuple[list, list]:
    """(sends, receives): (local slot, peer rank) pairs of the tails this rank sends on and receives."""
    chunks = [rank, 2 * ranks - 1 - rank][:slots(load_balance)]
    sends, receives = [], []
    for slot, chunk in enumerate(chunks):
        if chunk + 1 < slots(load_balance) * ranks and (peer := chunk_holder(chunk + 1, ranks, load_balance)[0]) != rank:
            sends.append((slot, peer))
        if chunk > 0 and (peer := chunk_holder(chunk - 1, ranks, load_balance)[0]) != rank:
            receives.append((slot, peer))
    return sends, receives


def fits(seq_len: int, window: int, ranks: int, load_balance: bool) -> bool:
    """Whether each local chunk holds at least window - 1 tokens (then only the one before it is seen)."""
    return seq_len % slots(load_balance) == 0 and seq_len // slots(load_balance) >= window - 1


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


def _links(group_name: str, load_balance: bool):
    group = _resolve_process_group(group_name)
    return group, *neighbours(dist.get_rank(group), dist.get_world_size(group), load_balance)


# Custom ops, as the document ring's: torch.compile graphs hold the op, not its point-to-point sends.
@torch.library.custom_op("titanlite::window_tails", mutates_args=())
def window_tails(kv: Tensor, layout: Tensor, group_name: str, load_balance: bool, tail: int) -> tuple[Tensor, Tensor]:
    """Stacked keys and values (2, b, kv_heads, s, d) and document ids and positions (2, b, s, 1) of
    this rank's chunks: their last `tail` tokens go to the next chunks' holders. Returns the tails
    received (along the sequence, in slot order)."""
    group, sends, receives = _links(group_name, load_balance)
    chunk_len = kv.shape[3] // slots(load_balance)
    TAIL_TOKENS_RECEIVED[0] += len(receives) * tail
    received = []
    for t in (kv, layout):
        shape = (*t.shape[:-2], tail, t.shape[-1])
        pieces = _swap([_tail(t, slot, chunk_len, tail) for slot, _ in sends], sends, receives, group, lambda: t.new_empty(shape))
        received.append(torch.cat(pieces, dim=-2) if pieces else t.new_empty(*t.shape[:-2], 0, t.shape[-1]))
    return received[0], received[1]


@window_tails.register_fake
def _(kv, layout, group_name, load_balance, tail):
    _, _, receives = _links(group_name, load_balance)
    length = len(receives) * tail
    return kv.new_empty(*kv.shape[:3], length, kv.shape[4]), layout.new_empty(*layout.shape[:2], length, layout.shape[3])


@torch.library.custom_op("titanlite::window_tails_backward", mutates_args=())
def window_tails_backward(grad: Tensor, seq_len: int, group_name: str, load_balance: bool, tail: int) -> Tensor:
    """The received tails' key/value gradients go back to the ranks that sent them; returns this
    rank's keys' and values' gradients from the tails it sent (zero elsewhere)."""
    group, sends, receives = _links(group_name, load_balance)
    chunk_len = seq_len // slots(load_balance)
    shape = (*grad.shape[:3], tail, grad.shape[4])
    back = _swap(list(grad.split(tail, dim=3)), receives, sends, group, lambda: grad.new_empty(shape))
    grad_kv = grad.new_zeros(*grad.shape[:3], seq_len, grad.shape[4])
    for (slot, _), piece in zip(sends, back):
        _tail(grad_kv, slot, chunk_len, tail).add_(piece)
    return grad_kv


@window_tails_backward.register_fake
def _(grad, seq_len, group_name, load_balance, tail):
    return grad.new_empty(*grad.shape[:3], seq_len, grad.shape[4])


def _setup_context(ctx, inputs, output):
    kv, _, ctx.group_name, ctx.load_balance, ctx.tail = inputs
    ctx.seq_len = kv.shape[3]


def _backward(ctx, grad_kv, _grad_layout):
    return window_tails_backward(grad_kv, ctx.seq_len, ctx.group_name, ctx.load_balance, ctx.tail), None, None, None, None


window_tails.register_autograd(_backward, setup_context=_setup_context)


def window_attention(q, k, v, mask: DocumentMask, sinks: torch.Tensor, group, load_balance: bool) -> torch.Tensor:
    """This rank's queries (b, heads, s, d) over its own keys and the tails before its chunks."""
    kv, layout = torch.stack([k, v]), torch.stack([mask.document_ids, mask.positions]).unsqueeze(-1)
    kv_tails, layout_tails = window_tails(kv, layout, group.group_name, load_balance, mask.window - 1)
    keys = torch.cat([kv, kv_tails], dim=3)
    kv_layout = torch.cat([layout, layout_tails], dim=2).squeeze(-1)
    return sink_attention(q, keys[0], keys[1], mask.allowed(kv_layout[0], kv_layout[1]), sinks)
