"""Several projections of one input as one matmul, their parameters kept apart; the output
projection, which can return a loss without building the logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.loss import linear_cross_entropy


class FusedLinear(nn.Module):
    """Linears that read the same input, as one matmul: `forward(x, *weights, *biases)` (the biases:
    none, or one per weight) returns one output per weight. It holds no parameters: each weight stays
    in its own nn.Linear under its own name, so checkpoints, FSDP units and the Hugging Face
    conversion see the separate projections. Under tensor parallel it is given each projection's rows
    of this rank (parallel/tensor.py)."""

    def forward(self, x: torch.Tensor, *operands: torch.Tensor) -> tuple[torch.Tensor, ...]:
        weights = [w for w in operands if w.dim() == 2]
        # Without autograd (evaluation) nothing is saved: the plain concatenation (compile traces no
        # autograd.Function there).
        if torch.is_grad_enabled():
            out = _ConcatenatedLinear.apply(x, *operands)
        else:
            out = F.linear(x, torch.cat(weights), torch.cat(operands[len(weights):]) if len(operands) > len(weights) else None)
        return out.split([w.shape[0] for w in weights], dim=-1)


class _ConcatenatedLinear(torch.autograd.Function):
    """x @ cat(weights)^T (+ cat(biases)). Backward keeps the weights themselves (the parameters, as
    separate linears would), not their concatenation, and concatenates them again: under FSDP a copy
    saved for backward would hold every block's gathered weights through the forward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, *operands: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, *operands)
        weights = [w for w in operands if w.dim() == 2]
        ctx.biased = len(operands) > len(weights)
        return F.linear(x, torch.cat(weights), torch.cat(operands[len(weights):]) if ctx.biased else None)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, *operands = ctx.saved_tensors
        weights = operands[: len(operands) // 2] if ctx.biased else operands
        sizes = [w.shape[0] for w in weights]
        grad_x = grad @ torch.cat(weights) if ctx.needs_input_grad[0] else None
        grad_weight = grad.flatten(0, -2).t() @ x.flatten(0, -2)
        grad_bias = grad.flatten(0, -2).sum(0).split(sizes) if ctx.biased else ()
        return grad_x, *grad_weight.split(sizes), *grad_bias


class OutputProjection(nn.Linear):
    """The output layer (hidden -> vocabulary logits). Given the labels too, it returns their summed
    cross entropy instead, computed `loss_chunks` pieces of tokens at a time so that the whole logits
    never exist (loss.py's LinearCrossEntropy; the trainer sets `loss_chunks`, and `compiled_loss`
    where compile.components has the loss)."""

    loss_chunks, compiled_loss = 1, False

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return super().forward(x)
        return linear_cross_entropy(x, self.weight, labels, self.loss_chunks, self.compiled_loss)


def plain_linears(*modules: nn.Module) -> bool:
    """Fused matmuls take plain nn.Linear weights (and biases); a converted linear (float8) runs its own matmul."""
    return all(type(m) is nn.Linear for m in modules)
