"""Muon for the hidden matrices, AdamW beside it for the rest, in one optimizer (one state to save).

Each matrix's update is what torch.optim.Muon's code computes (torch/optim/_muon.py): momentum as a
running average (`lerp`), Nesterov, the quintic Newton-Schulz iteration on the whole matrix (the
wide way round, normalized by its Frobenius norm), decoupled weight decay with the unadjusted lr,
the lr adjusted to the matrix's shape ("original": sqrt(max(1, rows / cols)); "match_rms_adamw":
0.2 sqrt(max(rows, cols))). Newton-Schulz runs in `ns_dtype`: by default bf16 as torch's does, fp32 on CPU. A grouped
expert weight (experts, rows, cols) is one matrix per expert; a weight holding several projections
(the family's matrix_components: MLA's) is one matrix per projection. On any layout a sharded parameter's
update is gathered whole, orthogonalized, and this rank gets its own piece back (owners.py), so
every layout computes the update of one process.
"""

from __future__ import annotations

import math

import torch

from titanlite.dtensors import local
from titanlite.optim.owners import orthogonal_pieces

COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's quintic
EPS = 1e-7


def newton_schulz_dtype(name: str, device: torch.device) -> torch.dtype:
    """`ns_dtype` "auto": bf16 on an accelerator (torch.optim.Muon's), fp32 on CPU, where a CPU without
    bf16 instructions (AVX2) runs Newton-Schulz in bf16 about 30x slower than in fp32."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return getattr(torch, name)


def orthogonalize(update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Newton-Schulz's approximate U V^T of a 2-D `update` = U S V^T, in `dtype`."""
    a, b, c = COEFFICIENTS
    x = update.to(dtype)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=EPS)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def lr_scale(adjust_lr_fn: str, rows: int, cols: int) -> float:
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1, rows / cols))


class Muon(torch.optim.Optimizer):
    """Groups with "muon": True take Muon's update; the others take AdamW's (torch.optim.AdamW, run
    on those groups with this optimizer's state, so one state dict holds both)."""

    def __init__(self, muon_groups: list[dict], adamw_groups: list[dict], *, momentum: float, nesterov: bool,
                 ns_steps: int, ns_dtype: str, adjust_lr_fn: str, adamw: dict, ns_distribution: str = "owners",
                 components: dict | None = None):
        self.adamw = torch.optim.AdamW(adamw_groups, **adamw) if adamw_groups else None
        groups = [dict(g, muon=True) for g in muon_groups] + [dict(g, muon=False) for g in (self.adamw.param_groups if self.adamw else [])]
        defaults = dict(lr=adamw["lr"], weight_decay=adamw["weight_decay"], momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, ns_dtype=ns_dtype, adjust_lr_fn=adjust_lr_fn, ns_distribution=ns_distribution)
        super().__init__(groups, defaults)
        self.components = components or {}  # parameter -> (groups, row sizes): matrix_components' projections
        self.qk_clip = None  # MuonClip's QK-clip after each step (optim/qk_clip.py), where the run asks for it

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["muon"] and params:
                self._muon_step(params, group)
        if self.adamw is not None:
            # The same group dicts and state, re-linked: load_state_dict replaces both objects.
            self.adamw.param_groups = [g for g in self.param_groups if not g["muon"]]
            self.adamw.state = self.state
            self.adamw.step()
        if self.qk_clip is not None:
            self.qk_clip.clip()
        return loss

    def _muon_step(self, params: list[torch.Tensor], group: dict) -> None:
        updates = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            grad, buf = local(p.grad), local(state["momentum_buffer"])
            buf.lerp_(grad, 1 - group["momentum"])
            updates.append(grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf)

        ns_dtype = newton_schulz_dtype(group["ns_dtype"], params[0].device)

        def ns(matrix: torch.Tensor) -> torch.Tensor:
            return orthogonalize(matrix, group["ns_steps"], ns_dtype)

        def orthogonal(full: torch.Tensor, components, dtype: torch.dtype) -> torch.Tensor:
            if components:  # each projection's rows alone, at its own shape's lr (folded in here, in the update's dtype)
                groups, sizes = components
                blocks = full.reshape(groups, sum(sizes), full.shape[-1]).split(sizes, dim=1)
                scaled = [ns(b.reshape(-1, b.shape[-1])).to(dtype) * lr_scale(group["adjust_lr_fn"], groups * b.shape[1], b.shape[-1])
                          for b in blocks]
                return torch.cat([m.reshape(groups, -1, full.shape[-1]) for m in scaled], dim=1).reshape(full.shape)
            if full.ndim == 2:
                return ns(full)  # as it comes out (a tall matrix's a transposed view, as torch's)
            return torch.stack([ns(m) for m in full])  # a grouped expert weight: one matrix per expert

        components = [self.components.get(p) for p in params]
        functions = [lambda full, c=c, u=u: orthogonal(full, c, u.dtype) for c, u in zip(components, updates)]
        pieces = orthogonal_pieces(params, updates, functions, owners=group["ns_distribution"] == "owners", ns_dtype=ns_dtype)
        for p, piece, parts in zip(params, pieces, components):
            rows, cols = p.shape[-2:]
            param = local(p)
            param.mul_(1 - group["lr"] * group["weight_decay"])
            scale = 1.0 if parts else lr_scale(group["adjust_lr_fn"], rows, cols)
            param.add_(piece.to(param.dtype), alpha=-group["lr"] * scale)
