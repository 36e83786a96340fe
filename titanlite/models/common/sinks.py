"""Attention sinks (gpt-oss): one learned logit per query head joins every softmax as a column with no
value, so a query may give part of its attention to nothing.

With the kernel's log-sum-exp L of a query's logits, the sink s only rescales its output:
softmax over [logits, s] weighs each key by exp(logit - L') with L' = logaddexp(L, s), so

    out' = out * exp(L - L') = out * sigmoid(L - s).

`rescaled_by_sinks` applies that where the kernel's log-sum-exp carries a gradient (FlexAttention,
titanlite's document ring). CPU SDPA's flash kernel returns L without one; for it, `cpu_sink_attention`
is exact in backward too: the kernel's own backward, given out' and L', computes the gradients of
attention with the sink (each key's probability is exp(logit - L'), and D = rowsum(grad * out')),
and the sink's gradient is -sum(exp(s - L') * D) over the head's queries.
"""

from __future__ import annotations

import torch


def rescaled_by_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """out (b, heads, s, d) and its log-sum-exp (b, heads, s) with each head's sink logit joined in."""
    keep = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))
    return (out.float() * keep.unsqueeze(-1)).to(out.dtype)


def cpu_sink_attention(q, k, v, allowed: torch.Tensor | None, sinks: torch.Tensor) -> torch.Tensor:
    """Attention of q (b, heads, s, d) over k, v (b, kv_heads, s', d; GQA in the kernel) with the sinks
    joined in: causal (`allowed` None) or where `allowed` (b, 1, s, s') is true."""
    bias = None
    if allowed is not None:  # the kernel takes an additive mask of q's dtype
        bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
    return _CpuSinkAttention.apply(q, k, v, bias, sinks)


class _CpuSinkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, sinks):
        causal = bias is None
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias)
        with_sink = torch.logaddexp(lse, sinks.float().view(1, -1, 1))
        out = rescaled_by_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, bias, sinks, out, with_sink)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, bias, sinks, out, with_sink = ctx.saved_tensors
        grad = grad.contiguous()
        grad_q, grad_k, grad_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, with_sink, 0.0, bias is None, attn_mask=bias
        )
        row_dot = (grad.float() * out.float()).sum(-1)  # D of each query
        sink_share = torch.exp(sinks.float().view(1, -1, 1) - with_sink)
        grad_sinks = -(sink_share * row_dot).sum(dim=(0, 2)).to(sinks.dtype)
        return grad_q, grad_k, grad_v, None, grad_sinks
