"""Several bias-free projections of one input as one matmul, their parameters kept apart; the output
projection, which can return a loss without building the logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from titanlite.loss import counted_labels


class FusedLinear(nn.Module):
    """Bias-free linears that read the same input, as one matmul: `forward(x, *weights)` returns one
    output per weight. It holds no parameters: each weight stays in its own nn.Linear under its own
    name, so checkpoints, FSDP units and the Hugging Face conversion see the separate projections.
    Under tensor parallel it is given each projection's rows of this rank (parallel/tensor.py)."""

    def forward(self, x: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Without autograd (evaluation) nothing is saved: the plain concatenation (compile traces no
        # autograd.Function there).
        linear = _ConcatenatedLinear.apply if torch.is_grad_enabled() else lambda x, *w: F.linear(x, torch.cat(w))
        return linear(x, *weights).split([w.shape[0] for w in weights], dim=-1)


class _ConcatenatedLinear(torch.autograd.Function):
    """x @ cat(weights)^T. Backward keeps the weights themselves (the parameters, as separate linears
    would), not their concatenation, and concatenates them again: under FSDP a copy saved for backward
    would hold every block's gathered weights through the forward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, *weights)
        return F.linear(x, torch.cat(weights))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, *weights = ctx.saved_tensors
        grad_x = grad @ torch.cat(weights) if ctx.needs_input_grad[0] else None
        grad_weight = grad.flatten(0, -2).t() @ x.flatten(0, -2)
        return grad_x, *grad_weight.split([w.shape[0] for w in weights])


class OutputProjection(nn.Linear):
    """The output layer (hidden -> vocabulary logits). Given the labels too, it returns their summed
    cross entropy instead, computed `loss_chunks` pieces of tokens at a time so that the whole logits
    never exist (LinearCrossEntropy; the trainer sets `loss_chunks`)."""

    loss_chunks = 1

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return super().forward(x)
        return LinearCrossEntropy.apply(x, self.weight, labels, self.loss_chunks, torch.is_grad_enabled())


class LinearCrossEntropy(torch.autograd.Function):
    """The summed cross entropy of `hidden @ weight.T` without the whole logits (OutputProjection
    with a loss's labels): the tokens in `chunks` pieces, each piece's
    logits, loss and gradients (softmax - onehot, then into the hidden state and the weight) made in
    forward and dropped; backward scales the gradients it kept. The peak holds one piece's logits
    and the weight's fp32 gradient instead of all the logits and theirs (at 128K vocabulary and 8K
    tokens a microbatch: 4 GiB each)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunks: int, with_grad: bool) -> torch.Tensor:
        h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        grad_h = torch.empty_like(h) if with_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if with_grad else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for rows in torch.arange(len(y), device=y.device).chunk(chunks):
            h_c = h[rows]
            counted, y_c = counted_labels(y[rows], masked=True)  # MTP's labels past the window do not count
            grad = torch.log_softmax(F.linear(h_c, weight).float(), dim=-1)
            picked = torch.arange(len(y_c), device=y.device)
            loss -= (grad[picked, y_c] * counted).sum()
            if with_grad:
                grad.exp_()[picked, y_c] -= 1
                grad.mul_(counted.unsqueeze(1))
                grad = grad.to(weight.dtype)  # the matmuls in the weight's dtype (bf16 on GPUs), summed in fp32
                grad_h[rows] = (grad @ weight).to(h.dtype)
                grad_w += grad.t() @ h_c.to(weight.dtype)
        if with_grad:
            ctx.save_for_backward(grad_h.view_as(hidden), grad_w)
            ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h.mul_(grad_loss.to(grad_h.dtype)), grad_w.mul_(grad_loss).to(ctx.weight_dtype), None, None, None


def plain_linears(*modules: nn.Module) -> bool:
    """Fused matmuls take plain nn.Linear weights; a converted linear (float8) runs its own matmul."""
    return all(type(m) is nn.Linear for m in modules)
