"""The training loss: cross entropy summed over tokens (the trainer divides by the global token count).

Every label counts: the loader packs full windows, so there is no padding and no ignored label.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed over tokens. In eager training on whole logits, `SummedCrossEntropy`; vocabulary-sharded
    logits (loss parallel), compiled losses (inductor fuses the plain one) and evaluation take
    F.cross_entropy."""
    logits, labels = logits.flatten(0, 1), labels.flatten(0, 1)
    if isinstance(logits, DTensor) or torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return F.cross_entropy(logits.float(), labels, reduction="sum")
    return SummedCrossEntropy.apply(logits, labels)


class SummedCrossEntropy(torch.autograd.Function):
    """-sum(log_softmax(logits)[label]), with the gradient, softmax(logits) - onehot(label), made in
    forward in the log-softmax's own (tokens, vocab) fp32 buffer, which backward scales in place. F.cross_entropy keeps
    the log-softmax for backward, then builds a zeroed one-hot gradient and the input's gradient:
    two more such buffers at the peak, and two more passes over them. At Llama 3's 128K vocabulary and
    8K tokens a microbatch, each is 4 GiB."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        grad = torch.log_softmax(logits.float(), dim=-1)
        rows = torch.arange(len(labels), device=labels.device)
        loss = -grad[rows, labels].sum()
        grad.exp_()[rows, labels] -= 1
        ctx.save_for_backward(grad)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad.mul_(grad_loss).to(ctx.dtype), None
