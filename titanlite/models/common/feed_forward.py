"""SwiGLU, the dense feed-forward (w2(silu(w1 x) * w3 x)); w1 and w3 run as one matmul when fused."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.common.linear import FusedLinear, plain_linears


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
