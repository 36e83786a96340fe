"""The training loss: cross entropy summed over tokens (the trainer divides by the global token count).

Every label of the model's own prediction counts: the loader packs full windows, so there is no
padding. Multi-token prediction's labels run past the window's end for its last positions: those
are IGNORED (`masked=True` leaves them out of the sum and the gradient).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor, Shard

IGNORED = -100  # a label that does not count (F.cross_entropy's default ignore_index)


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, masked: bool = False) -> torch.Tensor:
    """Summed over tokens (`masked`: those whose label is not IGNORED). In eager training,
    `SummedCrossEntropy` on whole logits and `VocabParallelCrossEntropy` on logits split over the
    vocabulary (loss parallel); compiled losses (inductor fuses the plain one), evaluation and other
    layouts take F.cross_entropy."""
    logits, labels = logits.flatten(0, 1), labels.flatten(0, 1)
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return F.cross_entropy(logits.float(), labels, reduction="sum", ignore_index=IGNORED)
    if not isinstance(logits, DTensor):
        return SummedCrossEntropy.apply(logits, labels, masked)
    if logits.device_mesh.ndim == 1 and logits.placements == (Shard(1),):
        mesh = logits.device_mesh
        # Shard splits like torch.chunk: every rank but the last holds ceil(vocab / ranks) entries.
        first = mesh.get_local_rank() * -(-logits.shape[-1] // mesh.size())
        return VocabParallelCrossEntropy.apply(logits.to_local(), labels, mesh.get_group(), first, masked)
    return F.cross_entropy(logits.float(), labels, reduction="sum", ignore_index=IGNORED)


class SummedCrossEntropy(torch.autograd.Function):
    """-sum(log_softmax(logits)[label]), with the gradient, softmax(logits) - onehot(label), made in
    forward in the log-softmax's own (tokens, vocab) fp32 buffer, which backward scales in place.
    F.cross_entropy keeps the log-softmax for backward, then builds a zeroed one-hot gradient and the
    input's gradient: two more such buffers at the peak, and two more passes over them. At Llama 3's
    128K vocabulary and 8K tokens a microbatch, each is 4 GiB."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, masked: bool = False) -> torch.Tensor:
        grad = torch.log_softmax(logits.float(), dim=-1)
        rows = torch.arange(len(labels), device=labels.device)
        counted, labels = counted_labels(labels, masked)
        loss = -(grad[rows, labels] * counted).sum()
        grad.exp_()[rows, labels] -= counted
        if masked:
            grad.mul_(counted.unsqueeze(-1))
        keep_logits_gradient(ctx, grad, logits.dtype)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        return scaled_logits_gradient(ctx, grad_loss)


def counted_labels(labels: torch.Tensor, masked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(1.0 where a label counts, else 0; the labels with IGNORED ones replaced by a valid index)."""
    if not masked:
        return torch.ones((), device=labels.device), labels
    counted = labels != IGNORED
    return counted.float(), labels.masked_fill(~counted, 0)


def keep_logits_gradient(ctx, grad: torch.Tensor, dtype: torch.dtype) -> None:
    ctx.save_for_backward(grad)
    ctx.dtype = dtype


def scaled_logits_gradient(ctx, grad_loss: torch.Tensor) -> tuple:
    """The logits' gradient made in forward, times the loss's gradient, in place, in the logits' dtype;
    no gradient for the other inputs (labels, group, ...)."""
    (grad,) = ctx.saved_tensors
    return (grad.mul_(grad_loss).to(ctx.dtype),) + (None,) * (len(ctx.needs_input_grad) - 1)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Loss parallel: each rank holds the logits of a slice of the vocabulary, starting at `first`.
    It takes its slice's log-sum-exp per token and the label's logit where the label is in its slice
    (0 elsewhere); one all-gather of both gives every rank the whole log-sum-exp and the loss. Its
    slice's gradient, softmax - onehot, is made in forward in the log-softmax's buffer, as in
    SummedCrossEntropy. (torch's loss_parallel takes three collectives and keeps more buffers.)"""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, group, first: int, masked: bool = False) -> torch.Tensor:
        x = logits.float()
        grad = torch.log_softmax(x, dim=-1)
        rows = torch.arange(len(labels), device=labels.device)
        counted, labels = counted_labels(labels, masked)
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
        keep_logits_gradient(ctx, grad, logits.dtype)
        return loss

    backward = staticmethod(SummedCrossEntropy.backward)  # the same: the gradient was made in forward

