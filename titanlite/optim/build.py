"""The optimizer of a model part: AdamW or Adam; or Muon for the hidden matrices with AdamW beside it
for what Muon should not take (optimizer.adamw_params: embeddings, the output head, router gates by
default, every parameter of fewer than 2 dims (norms, biases), and gpt-oss's per-expert biases)."""

from __future__ import annotations

import fnmatch

import torch
from torch.distributed.tensor import DTensor

from titanlite.config import JobConfig
from titanlite.config.keys import LEAVES, default_value
from titanlite.errors import ConfigError
from titanlite.optim.muon import Muon


def build_optimizer(named_params, config: JobConfig, components: dict | None = None) -> torch.optim.Optimizer:
    """`named_params`: (name, parameter) pairs, as a module's named_parameters() gives them; `components`:
    the family's matrix_components (a name suffix -> (groups, row sizes))."""
    o = config.optimizer
    impl = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[o.implementation]
    named = list(named_params)
    if o.name != "Muon":
        cls = torch.optim.AdamW if o.name == "AdamW" else torch.optim.Adam
        return cls(by_kind([p for _, p in named]), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, **impl)
    matrices = [p for name, p in named if takes_muon(name, p, o.adamw_params)]
    rest = [p for name, p in named if not takes_muon(name, p, o.adamw_params)]
    adamw = dict(lr=o.lr if o.adamw_lr is None else o.adamw_lr, betas=(o.beta1, o.beta2), eps=o.eps,
                 weight_decay=o.weight_decay if o.adamw_weight_decay is None else o.adamw_weight_decay, **impl)
    return Muon(
        [{"params": matrices, "lr": o.lr, "weight_decay": o.weight_decay}] if matrices else [], by_kind(rest),
        momentum=o.momentum, nesterov=o.nesterov, ns_steps=o.ns_steps, ns_dtype=o.ns_dtype, adjust_lr_fn=o.adjust_lr_fn,
        adamw=adamw, ns_distribution=o.ns_distribution,
        components={p: parts for name, p in named for suffix, parts in (components or {}).items() if name.endswith(suffix)},
    )


def by_kind(params: list) -> list[dict]:
    """Fused/foreach kernels cannot mix DTensors and plain tensors (e.g. norms under TP without
    sequence parallel stay plain), so each kind gets its own param group."""
    return [
        {"params": group}
        for group in ([p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)])
        if group
    ]


def takes_muon(name: str, param: torch.Tensor, adamw_patterns: list[str]) -> bool:
    """Matrices (a grouped expert weight: one per expert), not biases: gpt-oss's expert biases are
    (experts, size), one vector per expert."""
    return param.ndim >= 2 and not name.endswith("bias") and not matched_patterns(name, adamw_patterns)


def matched_patterns(name: str, patterns: list[str]) -> list[str]:
    """The patterns that match one of the dotted components of a parameter's name."""
    parts = name.split(".")
    return [pattern for pattern in patterns if any(fnmatch.fnmatchcase(part, pattern) for part in parts)]


def check_adamw_params(config: JobConfig, model_parts, device: torch.device) -> None:
    """Every pattern the user gave optimizer.adamw_params matches some parameter of the model (on this
    pipeline stage or another: one all-reduce over every rank); else ConfigError. The defaults name
    modules of every family (a dense model has no router) and pass as they are."""
    defaults = default_value(LEAVES["optimizer.adamw_params"][0])
    patterns = [p for p in config.optimizer.adamw_params if p not in defaults]
    names = [name for part in model_parts for name, _ in part.named_parameters()]
    found = torch.tensor([float(any(matched_patterns(n, [p]) for n in names)) for p in patterns], device=device)
    if torch.distributed.is_initialized() and patterns:
        torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX)
    missing = [p for p, hit in zip(patterns, found.tolist()) if not hit]
    if missing:
        raise ConfigError(
            f"optimizer.adamw_params={config.optimizer.adamw_params}: {missing} match no part of any parameter's name of model "
            f"{config.model.name} (names look like {names[0]!r}); use module names such as tok_embeddings, output, router"
        )
