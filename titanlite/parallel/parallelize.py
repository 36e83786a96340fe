"""The one place where a plain model becomes a parallel one, in a fixed order you can read:

    float8 linears -> tensor parallel -> activation checkpointing -> compile -> FSDP (float8 all-gather)

Context parallel changes no module: it is a per-step context (parallel/context.py), and pipeline
stages are split before this.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from titanlite.config import JobConfig
from titanlite.float8 import convert_to_float8, enable_float8_all_gather
from titanlite.parallel.activation_checkpoint import apply_ac
from titanlite.parallel.compile import apply_compile
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.fsdp import apply_fsdp
from titanlite.parallel.tensor import apply_tp

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def param_dtype(config: JobConfig, device_type: str) -> torch.dtype:
    name = config.training.mixed_precision_param
    if name == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return DTYPES[name]


def loss_parallel_enabled(dims: ParallelDims, config: JobConfig) -> bool:
    return dims.tp_enabled and not config.parallelism.disable_loss_parallel


def data_parallel_mesh(dims: ParallelDims):
    """FSDP's mesh: 1-D over fsdp, or 2-D (dp_replicate, fsdp) for HSDP and DDP."""
    if dims.dp_replicate > 1:
        return dims.get_mesh(("dp_replicate", "fsdp"))
    return dims.get_mesh("fsdp")


def parallelize(model: nn.Module, dims: ParallelDims, config: JobConfig, device_type: str) -> nn.Module:
    p, f8 = config.parallelism, config.float8
    if f8.enable:
        convert_to_float8(model, f8.recipe_name, f8.filter_fqns, f8.emulate)

    if dims.tp_enabled:
        apply_tp(
            model, dims.get_mesh("tp"), p.enable_sequence_parallel, loss_parallel_enabled(dims, config),
            float8_recipe=f8.recipe_name if f8.enable else None,
        )

    ac = config.activation_checkpoint
    if ac.mode != "none":
        apply_ac(model, ac.mode, ac.selective_ac_option)

    if config.compile.enable and "model" in config.compile.components:
        apply_compile(model, dims.tp_enabled, collectives_in_graph=dims.tp_enabled or dims.cp_enabled)

    dtype = param_dtype(config, device_type)
    # FSDP also carries mixed precision, so a single device in bf16 gets it too.
    if dims.dp_enabled or dims.cp_enabled or dtype != torch.float32:
        reshard = {"default": not dims.pp_enabled, "always": True, "never": False}[p.fsdp_reshard_after_forward]
        if f8.enable and f8.enable_fsdp_float8_all_gather:
            enable_float8_all_gather(model)
        apply_fsdp(
            model,
            data_parallel_mesh(dims),
            param_dtype=dtype,
            reduce_dtype=DTYPES[config.training.mixed_precision_reduce],
            reshard_after_forward=reshard,
            reshard_output_after_forward=p.fsdp_reshard_after_forward == "always",
        )
    return model


@torch.no_grad()
def assign_full_value(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full (unsharded) tensor into a parameter, keeping only this rank's shard of a DTensor."""
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank holds the same full tensor, so slice locally, no communication.
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)
