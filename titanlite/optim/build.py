"""The optimizer of a model part: AdamW or Adam, or Muon for the hidden matrices with AdamW beside it."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from titanlite.config import JobConfig


def build_optimizer(params, config: JobConfig) -> torch.optim.Optimizer:
    o = config.optimizer
    cls = torch.optim.AdamW if o.name == "AdamW" else torch.optim.Adam
    impl = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[o.implementation]
    # Fused/foreach kernels cannot mix DTensors and plain tensors (e.g. norms under TP without
    # sequence parallel stay plain), so each kind gets its own param group.
    params = list(params)
    groups = [
        {"params": group}
        for group in ([p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)])
        if group
    ]
    return cls(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, **impl)
