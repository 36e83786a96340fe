"""Llama 3 as a plain nn.Module: RoPE (theta + Llama 3.1 scaling), GQA, SwiGLU, RMSNorm, attention
causal over the window or within each packed document (models/attention.py).

No parallel code lives here. Layers sit in an nn.ModuleDict keyed "0".."n-1" and the embedding,
final norm and output may be None, so a pipeline stage is this model with modules removed and
parameter names (FQNs) stay the same on every layout.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.args import ModelArgs
from titanlite.models.attention import CoreAttention, DocumentMask, build_mask

# Wrappers (activation checkpointing, torch.compile) insert these into parameter names.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_fqn(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def rope_cache(args: ModelArgs, seq_len: int, device=None) -> torch.Tensor:
    """(seq_len, head_dim) table: cos of each rotation frequency in the first half, sin in the second."""
    half = args.head_dim // 2
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, half, device=device, dtype=torch.float32) / half))
    if args.rope_scaling:
        freqs = _llama31_scaled(freqs)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), freqs)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def _llama31_scaled(freqs: torch.Tensor, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, old_ctx=8192):
    """Llama 3.1: slow down low frequencies by `factor`, keep high ones, blend in between."""
    wavelen = 2 * math.pi / freqs
    low_wavelen, high_wavelen = old_ctx / low_freq_factor, old_ctx / high_freq_factor
    smooth = (old_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * freqs / factor + smooth * freqs
    scaled = torch.where(wavelen > low_wavelen, freqs / factor, blended)
    return torch.where(wavelen < high_wavelen, freqs, scaled)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x0, x1) of each head (Meta's layout). x: (b, s, h, d); rope: the
    table's rows for each token, (b, s, d), or its first rows for positions 0.. (s', d)."""
    half = x.shape[-1] // 2
    rows = rope.view(-1, x.shape[1], 1, rope.shape[-1]) if rope.dim() == 3 else rope[: x.shape[1]].view(1, x.shape[1], 1, -1)
    cos, sin = rows[..., :half], rows[..., half:]
    pairs = x.float().unflatten(-1, (half, 2))
    if not torch.compiler.is_compiling():
        # Eager: one complex multiply, forward and backward (3.4x faster than the real form on CPU).
        return torch.view_as_real(torch.view_as_complex(pairs) * torch.complex(cos.float(), sin.float())).flatten(-2).type_as(x)
    # Compiled: inductor fuses the real form into one kernel; it has no complex code generation.
    x0, x1 = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


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


def plain_linears(*modules: nn.Module) -> bool:
    """Fused matmuls take plain nn.Linear weights; a converted linear (float8) runs its own matmul."""
    return all(type(m) is nn.Linear for m in modules)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.qkv = FusedLinear() if args.fused_projections else None
        # Qwen3: each query and key head is RMS-normalized before RoPE.
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.inner_attention = CoreAttention()

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: DocumentMask | None = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        if self.qkv is not None and plain_linears(self.wq, self.wk, self.wv):
            q, k, v = self.qkv(x, self.wq.weight, self.wk.weight, self.wv.weight)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        # -1 heads: under tensor parallel each rank holds a slice of the heads.
        q, k, v = (t.view(bsz, seqlen, -1, self.head_dim) for t in (q, k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = self.inner_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, fused: bool = False):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w13 = FusedLinear() if fused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w13 is not None and plain_linears(self.w1, self.w3):
            gate, up = self.w13(x, self.w1.weight, self.w3.weight)
        else:
            gate, up = self.w1(x), self.w3(x)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    """Attention, then a feed-forward: Llama's SwiGLU unless given another (a mixture of experts)."""

    def __init__(self, layer_id: int, args: ModelArgs, feed_forward: nn.Module | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = feed_forward or FeedForward(args.dim, args.ffn_hidden_dim, args.fused_projections)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: DocumentMask | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.make_block(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Not persistent: recomputed after materialization, never checkpointed.
        self.register_buffer("rope", rope_cache(args, args.max_seq_len), persistent=False)

    def make_block(self, layer_id: int, args: ModelArgs) -> nn.Module:
        return TransformerBlock(layer_id, args)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens (b, s) (a later pipeline stage: the hidden states); `positions` (b, s) pick each
        token's RoPE rows (default 0..s-1); with `document_ids` (b, s) attention stays within each
        document (models/attention.py's document_layout gives both)."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if document_ids is not None and positions is None:
            positions = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
        rope = self.rope if positions is None else self.rope[positions]
        mask = None if document_ids is None else build_mask(document_ids, positions, self.args.attn_type)
        for layer in self.layers.values():
            h = layer(h, rope, mask)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    # ---- initialization ----

    def init_std(self, fqn: str) -> float | None:
        """Init std of a parameter by name; None means ones (norm weights)."""
        args, parts = self.args, fqn.split(".")
        if parts[-2:] == ["tok_embeddings", "weight"]:
            return 1.0
        if parts[0] == "output":
            return args.dim**-0.5
        if "norm" in parts[-2]:
            return None
        layer_id = int(parts[1])
        depth_std = 0.02 / (2 * (layer_id + 1)) ** 0.5 if args.depth_init else 0.02 / (2 * args.n_layers) ** 0.5
        projection = parts[-2] if parts[-1] in ("weight", "bias") else parts[-1]  # a raw parameter: experts.w2
        return depth_std if projection in ("wo", "w2", "w3") else 0.02

    def initial_value(self, fqn: str, shape, device, seed: int) -> torch.Tensor:
        """The full initial tensor of one parameter, from a generator seeded by (seed, name).

        Seeding per name makes the weights identical whether the model is whole, sharded or split
        into pipeline stages: every layout builds the same full tensor and keeps its own slice.
        """
        std = self.init_std(fqn)
        if std is None:
            return torch.ones(shape, device=device)
        gen = torch.Generator(device=device)
        gen.manual_seed(zlib.crc32(f"{seed}:{fqn}".encode()))
        out = torch.empty(shape, device=device)
        if fqn.startswith("tok_embeddings"):
            return out.normal_(0.0, std, generator=gen)
        return nn.init.trunc_normal_(out, std=std, a=-3 * std, b=3 * std, generator=gen)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, assign=None) -> None:
        """Initialize every parameter (depth-scaled) and recompute the RoPE table.

        `assign(param, full_value)` copies a full tensor into a parameter; the parallel code passes
        one that keeps only the local shard of a DTensor.
        """
        assign = assign or (lambda param, value: param.copy_(value))
        for name, param in self.named_parameters():
            assign(param, self.initial_value(canonical_fqn(name), param.shape, param.device, seed))
        self.rope = rope_cache(self.args, self.args.max_seq_len, device=self.rope.device)
        for module in self.modules():
            if module is not self and hasattr(module, "reset_state"):
                module.reset_state()  # state buffers (a MoE's expert bias) start from zero

    # ---- size and cost ----

    def num_params(self, exclude_embedding: bool = False) -> int:
        total = sum(p.numel() for p in self.parameters())
        if exclude_embedding and self.tok_embeddings is not None:
            total -= self.tok_embeddings.weight.numel()
        return total

    def flops_per_token(self, seq_len: int) -> int:
        return self.args.flops_per_token(seq_len)
