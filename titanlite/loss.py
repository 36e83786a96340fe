"""The training loss: cross entropy summed over tokens (the trainer divides by the global token count).

Every label of the model's own prediction counts: the loader packs full windows, so there is no
padding. Multi-token prediction's labels run past the window's end for its last positions: those
are IGNORED (`masked=True` leaves them out of the sum and the gradient).

Under loss parallel (TP) each rank holds a slice of the vocabulary, of the logits or of the output
weight, and the loss takes one all-gather of two numbers per token (`loss_and_logits_gradient`).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

IGNORED = -100  # a label that does not count (F.cross_entropy's default ignore_index)


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, masked: bool = False) -> torch.Tensor:
    """Summed over tokens (`masked`: those whose label is not IGNORED). In eager training,
    `SummedCrossEntropy` on whole logits or on logits split over the vocabulary (loss parallel);
    compiled losses (inductor fuses the plain one), evaluation and other layouts take F.cross_entropy."""
    logits, labels = logits.flatten(0, 1), labels.flatten(0, 1)
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return F.cross_entropy(logits.float(), labels, reduction="sum", ignore_index=IGNORED)
    if not isinstance(logits, DTensor):
        return SummedCrossEntropy.apply(logits, labels, masked, None, None)
    if logits.device_mesh.ndim == 1 and logits.placements == (Shard(1),):
        return SummedCrossEntropy.apply(logits.to_local(), labels, masked, *vocab_slice(logits))
    return F.cross_entropy(logits.float(), labels, reduction="sum", ignore_index=IGNORED)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunks: int,
                         compiled: bool = False) -> torch.Tensor:
    """The summed cross entropy of `hidden @ weight.T` without the whole logits (LinearCrossEntropy),
    each piece's work `compiled` or not. Under loss parallel the weight is this rank's rows of the
    vocabulary (a DTensor) and the hidden state every token's (replicated): each rank's slice adds its
    part of the hidden state's gradient (its pieces run eagerly: their all-gather stays out of graphs)."""
    first = group = None
    if isinstance(weight, DTensor):
        assert weight.placements == (Shard(0),) and hidden.placements == (Replicate(),), (weight.placements, hidden.placements)
        first, group = vocab_slice(weight)
        weight, hidden = weight.to_local(), hidden.to_local(grad_placements=[Partial()])
    piece = compiled_piece() if compiled and first is None else loss_of_piece
    return LinearCrossEntropy.apply(hidden, weight, labels, chunks, torch.is_grad_enabled(), first, group, piece)


def loss_of_piece(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, with_grad: bool, first, group):
    """One piece of tokens: (its summed loss, the gradients of its hidden states and of the weight),
    the matmuls in the weight's dtype (bf16 on GPUs); None for the gradients without `with_grad`."""
    loss, grad = loss_and_logits_gradient(F.linear(h, weight), labels, True, first, group)
    if not with_grad:
        return loss, None, None
    grad = grad.to(weight.dtype)
    return loss, (grad @ weight).to(h.dtype), grad.t() @ h.to(weight.dtype)


@functools.cache
def compiled_piece():
    """loss_of_piece compiled once per process (inductor fuses the log-softmax, the exp and the one-hot
    subtraction around the two matmuls; the eager piece was 11% slower on an H200)."""
    return torch.compile(loss_of_piece, dynamic=False)


def vocab_slice(t: DTensor) -> tuple[int, dist.ProcessGroup]:
    """(the first id of this rank's slice of `t`, split over the vocabulary on a 1-d mesh; the group)."""
    mesh, (shard,) = t.device_mesh, t.placements
    # Shard splits like torch.chunk: every rank but the last holds ceil(vocab / ranks) entries.
    first = mesh.get_local_rank() * -(-t.shape[shard.dim] // mesh.size())
    return first, mesh.get_group()


def counted_labels(labels: torch.Tensor, masked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(1.0 where a label counts, else 0; the labels with IGNORED ones replaced by a valid index)."""
    if not masked:
        return torch.ones((), device=labels.device), labels
    counted = labels != IGNORED
    return counted.float(), labels.masked_fill(~counted, 0)


def loss_and_logits_gradient(
    logits: torch.Tensor, labels: torch.Tensor, masked: bool, first: int | None, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed loss of (tokens, vocab) logits and their gradient, softmax - onehot, made in the fp32
    log-softmax's own buffer. With `first`, the logits are this rank's slice of the vocabulary from id
    `first` (loss parallel): it takes its slice's log-sum-exp per token and the label's logit where the
    label is in its slice (0 elsewhere); one all-gather of both over `group` gives every rank the whole
    log-sum-exp and the loss (torch's loss_parallel takes three collectives and keeps more buffers)."""
    x = logits.float()
    grad = torch.log_softmax(x, dim=-1)
    rows = torch.arange(len(labels), device=labels.device)
    counted, labels = counted_labels(labels, masked)
    if first is None:
        loss = -(grad[rows, labels] * counted).sum()
        grad.exp_()[rows, labels] -= 1
    else:
        local = labels - first
        mine = (local >= 0) & (local < x.shape[-1])
        local = local.clamp(0, x.shape[-1] - 1)
        slice_lse = x[:, 0] - grad[:, 0]
        parts = torch.stack([slice_lse, (grad[rows, local] + slice_lse) * mine])
        gathered = parts.new_empty((dist.get_world_size(group) * 2, len(labels)))
        dist.all_gather_into_tensor(gathered, parts, group=group)
        gathered = gathered.view(-1, 2, len(labels))
        lse = torch.logsumexp(gathered[:, 0], dim=0)
        loss = ((lse - gathered[:, 1].sum(dim=0)) * counted).sum()
        grad.sub_((lse - slice_lse).unsqueeze(-1)).exp_()[rows, local] -= mine.to(grad.dtype)
    if masked:
        grad.mul_(counted.unsqueeze(-1))
    return loss, grad


class SummedCrossEntropy(torch.autograd.Function):
    """The summed cross entropy of logits (whole, or this rank's vocabulary slice), with their gradient
    made in forward (`loss_and_logits_gradient`), which backward scales in place. F.cross_entropy keeps
    the log-softmax for backward, then builds a zeroed one-hot gradient and the input's gradient: two
    more (tokens, vocab) buffers at the peak, and two more passes over them. At Llama 3's 128K
    vocabulary and 8K tokens a microbatch, each is 4 GiB."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, masked: bool, first, group) -> torch.Tensor:
        loss, grad = loss_and_logits_gradient(logits, labels, masked, first, group)
        ctx.save_for_backward(grad)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad.mul_(grad_loss).to(ctx.dtype), None, None, None, None


class LinearCrossEntropy(torch.autograd.Function):
    """The summed cross entropy of `hidden @ weight.T` without the whole logits: the tokens in `chunks`
    pieces, each piece's logits, loss and gradients (softmax - onehot, then into the hidden state and
    the weight) made in forward and dropped; backward scales the gradients it kept. The peak holds one
    piece's logits and the weight's fp32 gradient instead of all the logits and theirs (at 128K
    vocabulary and 8K tokens a microbatch: 4 GiB each). IGNORED labels count for nothing."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunks: int, with_grad: bool, first, group, piece=loss_of_piece) -> torch.Tensor:
        h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        grad_h = torch.empty_like(h) if with_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if with_grad else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for rows in torch.arange(len(y), device=y.device).chunk(chunks):
            piece_loss, piece_grad_h, piece_grad_w = piece(h[rows], weight, y[rows], with_grad, first, group)
            loss += piece_loss
            if with_grad:
                grad_h[rows] = piece_grad_h
                grad_w += piece_grad_w  # summed in fp32
        if with_grad:
            ctx.save_for_backward(grad_h.view_as(hidden), grad_w)
            ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h.mul_(grad_loss.to(grad_h.dtype)), grad_w.mul_(grad_loss).to(ctx.weight_dtype), None, None, None, None, None, None
