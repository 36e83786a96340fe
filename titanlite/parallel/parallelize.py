"""The one place where a plain model becomes a parallel one, in a fixed order you can read:

    converters (float8) -> tensor parallel -> expert parallel -> context parallel -> activation
    checkpointing -> compile -> FSDP

Context parallel is mostly a per-step context (parallel/context.py); here it swaps the core
attention for a ring (for document masks) and tells MoE layers to sum their per-sequence counts
over the ranks that share a sequence (cp, and tp under sequence parallel). Pipeline stages are
split before this.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from titanlite.config import JobConfig, float8_recipe
from titanlite.errors import ConfigError
from titanlite.parallel.activation_checkpoint import apply_ac
from titanlite.parallel.compile import apply_compile
from titanlite.parallel.context import apply_cp, share_expert_counts
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.expert import apply_ep
from titanlite.parallel.fsdp import apply_fsdp
from titanlite.parallel.pipeline import SPLIT_BACKWARD_SCHEDULES
from titanlite.parallel.tensor import apply_tp

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def param_dtype(config: JobConfig, device_type: str) -> torch.dtype:
    """The compute dtype: training.mixed_precision_param, never wider than training.dtype."""
    name = config.training.mixed_precision_param
    if config.training.dtype == "bfloat16":
        return torch.bfloat16
    if name == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return DTYPES[name]


def loss_parallel_enabled(dims: ParallelDims, config: JobConfig) -> bool:
    return dims.tp_enabled and not config.parallelism.disable_loss_parallel


def data_parallel_mesh(dims: ParallelDims, shard_dim: str = "fsdp"):
    """FSDP's mesh: 1-D over `shard_dim`, or 2-D (dp_replicate, shard_dim) for HSDP and DDP. Besides
    fsdp: efsdp (split routed experts), moe_fsdp (MoE layers under TP)."""
    if dims.dp_replicate > 1:
        return dims.get_mesh(("dp_replicate", shard_dim))
    return dims.get_mesh(shard_dim)


def parallelize(
    model: nn.Module, plan, dims: ParallelDims, config: JobConfig, device_type: str, converters=()
) -> nn.Module:
    """`plan`: the model family's ParallelPlan (its TP plans and units); nothing here names a module."""
    p, f8 = config.parallelism, config.float8
    for converter in converters:
        converter.convert(model, plan)

    if dims.tp_enabled:
        tied = tied_parameters(model)
        apply_tp(
            model, plan, dims.get_mesh("tp"), p.enable_sequence_parallel, loss_parallel_enabled(dims, config),
            float8_recipe=float8_recipe(f8) if f8 else None,
        )
        tie(model, tied)
        if p.enable_async_tensor_parallel and device_type != "meta":
            enable_async_tp(dims.get_mesh("tp"), device_type)

    if dims.expert_mesh_dims:
        mesh_dims = dims.expert_mesh_dims
        apply_ep(model, plan, dims.get_mesh(mesh_dims if len(mesh_dims) > 1 else mesh_dims[0]))
    if dims.cp_enabled:
        apply_cp(model, dims.get_mesh("cp"), p.context_parallel_rotate_method, p.context_parallel_load_balancer == "headtail")
    if plan.moe_layers(model):
        routing = dims.get_mesh("routing")
        sequence = dims.get_mesh("sequence") if dims.cp_enabled or dims.tp_enabled else None
        share_expert_counts(model, plan, sequence, routing if routing.size() > 1 else None)

    ac = config.activation_checkpoint
    if ac.mode != "none":
        split_backward = dims.pp_enabled and p.pipeline_parallel_schedule.lower() in SPLIT_BACKWARD_SCHEDULES
        apply_ac(model, plan, ac, replay_exchanges=not split_backward)

    if config.compile.enable and "model" in config.compile.components:
        apply_compile(model, plan, dims.tp_enabled, collectives_in_graph=dims.tp_enabled or dims.cp_enabled, backend=config.compile.backend)

    dtype = param_dtype(config, device_type)
    # FSDP also carries mixed precision and CPU offload, so a single device gets those too.
    t = config.training
    offload = t.enable_cpu_offload and device_type == "cuda"  # on CPU the parameters live in host memory already
    # MoE layers under TP see each tp rank's own tokens: FSDP sums their gradients over tp as well.
    moe_under_tp = dims.tp_enabled and bool(plan.moe_layers(model))
    if dims.dp_enabled or dims.cp_enabled or dtype != DTYPES[t.dtype] or offload or moe_under_tp:
        reshard = {"default": not dims.pp_enabled, "always": True, "never": False}[p.fsdp_reshard_after_forward]
        for converter in converters:
            converter.before_fsdp(model)
        apply_fsdp(
            model,
            plan,
            data_parallel_mesh(dims),
            param_dtype=dtype,
            reduce_dtype=DTYPES[t.mixed_precision_reduce],
            reshard_after_forward=reshard,
            reshard_output_after_forward=p.fsdp_reshard_after_forward == "always",
            cpu_offload=offload,
            expert_mesh=data_parallel_mesh(dims, dims.expert_fsdp_dim) if dims.expert_mesh_dims else None,
            moe_mesh=data_parallel_mesh(dims, "moe_fsdp") if moe_under_tp else None,
        )
    return model


def tied_parameters(model: nn.Module) -> list[list[str]]:
    """The names of each parameter that several modules share (tied embeddings), its first name first."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def tie(model: nn.Module, groups: list[list[str]]) -> None:
    """Tensor parallel gives each module a parameter of its own: the others take the first name's again
    (the plans shard both alike: the embedding's and the output's vocabulary rows)."""
    for first, *others in groups:
        param = model.get_parameter(first)
        for name in others:
            owner, _, attribute = name.rpartition(".")
            mine = model.get_parameter(name)
            if getattr(mine, "placements", None) != getattr(param, "placements", None):
                raise ConfigError(f"tied parameters {first} and {name} are split differently by tensor parallel "
                                  f"({getattr(param, 'placements', None)} and {getattr(mine, 'placements', None)}); untie them")
            setattr(model.get_submodule(owner), attribute, param)


def enable_async_tp(tp_mesh, device_type: str) -> None:
    """torch's micro-pipelined TP: compiled graphs split TP's all-gather/reduce-scatter + matmul into
    chunks that overlap, through symmetric memory on the TP group (CUDA only)."""
    if device_type != "cuda":
        raise ConfigError(
            f"parallelism.enable_async_tensor_parallel=true needs CUDA GPUs (symmetric memory), not {device_type}; "
            "set it false"
        )
    from torch._inductor import config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)


@torch.no_grad()
def assign_full_value(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full (unsharded) tensor into a parameter, keeping only this rank's shard of a DTensor."""
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank holds the same full tensor, so slice locally, no communication.
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)
