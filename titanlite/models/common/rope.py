"""Rotary position embedding: the table (theta, with Llama 3.1's frequency scaling) and its
application to each head, in Meta's layout (consecutive pairs rotate together)."""

from __future__ import annotations

import math

import torch

from titanlite.models.common.args import ModelArgs


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
