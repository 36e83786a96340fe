"""Pipeline parallel: split the model into stages, place them on the pp ranks, build a torch schedule.

A stage is the same model with the modules it does not own removed (blocks deleted from the
family's ModuleDict, its head and tail modules set to None: Llama's embedding / norm / output), so
parameter names stay those of the whole model and no pipeline code lives in the model. The head
and the tail count as extra layers when blocks are spread over stages
(parallelism.pipeline_parallel_first/last_stage_less_layers). Multi-stage schedules place stages in loop order
(rank r holds r, r + pp, ...); V schedules (ZBVZeroBubble, DualPipeV) in V order (r and 2pp-1-r).
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager

from torch import nn

from titanlite.config import JobConfig
from titanlite.errors import ConfigError
from titanlite.parallel.stage_inference import MetadataInference

V_SCHEDULES = ("zbvzerobubble", "dualpipev")
# Schedules that take a microbatch's backward in two autograd passes (inputs, then weights), each
# of which may recompute a checkpointed block.
SPLIT_BACKWARD_SCHEDULES = ("interleavedzerobubble", "zbvzerobubble", "dualpipev")
BACKWARD_ACTIONS = ("FULL_BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "SEND_B", "RECV_B", "REDUCE_GRAD",
                    # torch >= 2.15 pairs each send and REDUCE_GRAD with a WAIT_ action
                    "WAIT_SEND_B", "WAIT_REDUCE_GRAD")


def schedule_class(name: str):
    """The torch schedule class for a name, or a clear error naming what this torch offers."""
    from torch.distributed.pipelining import schedules

    try:
        return schedules.get_schedule_class(name)
    except ValueError:
        offered = [n for n in ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                               "ZBVZeroBubble", "DualPipeV") if _offered(schedules, n)]
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule='{name}' is not a schedule of the installed torch; "
            f"choose one of: {', '.join(offered)}"
        )


def _offered(schedules, name: str) -> bool:
    try:
        schedules.get_schedule_class(name)
        return True
    except ValueError:
        return False


def is_multi_stage(cls) -> bool:
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    return issubclass(cls, PipelineScheduleMulti)


def stage_module_names(config: JobConfig, plan, n_layers: int, pp: int, multi_stage: bool) -> list[list[str]]:
    """Module names of each stage, in pipeline order. The embedding counts as
    `first_stage_less_layers` layers and norm + output as `last_stage_less_layers` (TorchTitan's
    weights), and the layers so counted are spread evenly, earlier stages taking the remainder."""
    p = config.parallelism
    head, tail = list(plan.head), list(plan.tail)
    blocks = [f"{plan.blocks}.{i}" for i in range(n_layers)]
    everything = head + blocks + tail
    if p.module_fqns_per_model_part:
        stages = [list(stage) for stage in p.module_fqns_per_model_part]
        if [name for stage in stages for name in stage] != everything:
            raise ConfigError(
                f"parallelism.module_fqns_per_model_part={p.module_fqns_per_model_part} must list every module "
                f"once, in order: {', '.join(everything)} (one list of names per stage)"
            )
        if plan.tail_on_one_stage and not set(tail) <= set(stages[-1]):
            raise ConfigError(
                f"parallelism.module_fqns_per_model_part={p.module_fqns_per_model_part} splits {', '.join(tail)} over "
                f"stages, and this model runs them together (multi-token prediction reads the last block's output and "
                f"the output head): put them all in the last stage"
            )
        return stages
    first, last = p.pipeline_parallel_first_stage_less_layers, p.pipeline_parallel_last_stage_less_layers
    counted = n_layers + first + last
    lps = p.pipeline_parallel_layers_per_stage
    n_stages = math.ceil(counted / lps) if lps else pp * (2 if multi_stage else 1)
    base = counted // n_stages
    if base < max(first, last, 1):
        raise ConfigError(
            f"{n_stages} pipeline stages for {n_layers} layers (+{first} for {', '.join(head)}, +{last} for "
            f"{', '.join(tail)}) "
            f"leave {base} per stage, fewer than the first/last stage give up; use fewer stages, a larger "
            "parallelism.pipeline_parallel_layers_per_stage, or smaller pipeline_parallel_first/last_stage_less_layers"
        )
    return spread_modules(head, blocks, tail, n_stages, first, last)


def spread_modules(head: list[str], blocks: list[str], tail: list[str], n_parts: int, first: int, last: int) -> list[list[str]]:
    """head + blocks + tail in `n_parts` runs (pipeline stages, DiLoCo's fragments): the head counts as
    `first` blocks and the tail as `last`, and the blocks so counted are spread evenly, earlier parts
    taking the remainder."""
    base, extra = divmod(len(blocks) + first + last, n_parts)
    parts, layer = [], 0
    for s in range(n_parts):
        size = base + (1 if s < extra else 0)
        size -= (first if s == 0 else 0) + (last if s == n_parts - 1 else 0)
        names = blocks[layer : layer + size]
        layer += len(names)
        parts.append((head if s == 0 else []) + names + (tail if s == n_parts - 1 else []))
    return parts


def stage_ids_of_rank(pp_rank: int, pp: int, n_stages: int, schedule_name: str, multi_stage: bool) -> list[int]:
    name = f"parallelism.pipeline_parallel_schedule='{schedule_name}'"
    if n_stages % pp:
        raise ConfigError(f"{n_stages} pipeline stages do not divide evenly over pipeline_parallel_degree={pp}")
    per_rank = n_stages // pp
    if not multi_stage and per_rank != 1:
        raise ConfigError(f"{name} runs one stage per rank, but the split gives {per_rank}; use a multi-stage schedule")
    if schedule_name.lower() in V_SCHEDULES:
        if per_rank != 2:
            raise ConfigError(f"{name} needs exactly 2 stages per rank, the split gives {per_rank}")
        return [pp_rank, 2 * pp - 1 - pp_rank]
    if multi_stage and per_rank < 2:
        raise ConfigError(f"{name} needs 2 or more stages per rank; set pipeline_parallel_layers_per_stage lower")
    return [pp_rank + k * pp for k in range(per_rank)]


def split_model(model: nn.Module, plan, names: list[str]) -> nn.Module:
    """A copy of the (meta-device) model holding only the named modules."""
    stage = copy.deepcopy(model)
    keep = set(names)
    blocks = getattr(stage, plan.blocks)
    for key in list(blocks.keys()):
        if f"{plan.blocks}.{key}" not in keep:
            del blocks[key]
    for name in (*plan.head, *plan.tail):
        if name not in keep:
            setattr(stage, name, None)
    return stage


def plan_stages(config: JobConfig, plan, n_layers: int, pp: int, pp_rank: int) -> tuple[list[list[str]], list[int]]:
    """(module names of every stage, the stage ids of pp rank `pp_rank`); raises ConfigError for a
    schedule or split that cannot work. Needs no process group: run_train.sh checks it up front."""
    name = config.parallelism.pipeline_parallel_schedule
    multi = is_multi_stage(schedule_class(name))
    names = stage_module_names(config, plan, n_layers, pp, multi)
    return names, stage_ids_of_rank(pp_rank, pp, len(names), name, multi)


def pipeline_stages(model: nn.Module, plan, dims, config: JobConfig) -> tuple[list[int], int, list[nn.Module]]:
    """(stage ids of this rank, number of stages, their modules) for the whole meta-device model."""
    n_layers = len(getattr(model, plan.blocks))
    names, ids = plan_stages(config, plan, n_layers, dims.pp, dims.get_mesh("pp").get_local_rank())
    return ids, len(names), [split_model(model, plan, names[i]) for i in ids]


def stage_keeping_buffers():
    """torch's PipelineStage, except that the forward it runs at the first step to infer shapes
    (a real forward, on uninitialized activations after the first stage) leaves the model's buffers
    as they were: a MoE layer would count its tokens. That forward, and the backward torch 2.13 runs
    after it on some stages, exchange for themselves: activation checkpointing keeps no record of
    them for a recompute; both run under `MetadataInference.running`. (torch 2.13 names these
    methods _forward_metadata_inference and _backward_metadata_inference, earlier releases have
    _shape_inference.)"""
    import torch
    from torch.distributed.pipelining import PipelineStage

    def inferring(infer):
        def run(self, *args, **kwargs):
            with MetadataInference.of_a_stage():
                return infer(self, *args, **kwargs)

        return run

    def keeping_buffers(infer):
        infer = inferring(infer)

        def run(self, *args, **kwargs):
            saved = [(b, b.clone()) for b in self.submod.buffers()]
            try:
                return infer(self, *args, **kwargs)
            finally:
                with torch.no_grad():
                    for buffer, value in saved:
                        if not torch.equal(buffer, value):  # untouched ones (RoPE) may be in the graph
                            buffer.copy_(value)

        return run

    methods = {
        name: keeping_buffers(getattr(PipelineStage, name))
        for name in ("_forward_metadata_inference", "_shape_inference")
        if hasattr(PipelineStage, name)
    }
    if hasattr(PipelineStage, "_backward_metadata_inference"):
        methods["_backward_metadata_inference"] = inferring(PipelineStage._backward_metadata_inference)
    return type("StageKeepingBuffers", (PipelineStage,), methods)


def build_schedule(config: JobConfig, parts: list[nn.Module], stage_ids: list[int], n_stages: int, dims, device, loss_fn):
    """Wrap each part in a PipelineStage and build the schedule (gradients not scaled: the loss is
    already divided by the global token count)."""
    p = config.parallelism
    cls = schedule_class(p.pipeline_parallel_schedule)
    group = dims.get_mesh("pp").get_group()
    stage_class = stage_keeping_buffers()
    stages = [stage_class(part, i, n_stages, device, group=group) for part, i in zip(parts, stage_ids)]
    n_microbatches = config.training.local_batch_size // p.pipeline_parallel_microbatch_size
    try:
        return cls(
            stages if is_multi_stage(cls) else stages[0],
            n_microbatches=n_microbatches,
            loss_fn=loss_fn,
            scale_grads=False,
        )
    except (ValueError, AssertionError, NotImplementedError) as e:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule='{p.pipeline_parallel_schedule}' cannot run {n_stages} stages "
            f"on pp={dims.pp} with {n_microbatches} microbatches: {e}"
        )


@contextmanager
def forward_only(schedule):
    """Evaluate with `schedule.eval()`. Multi-stage schedules run from a per-rank action list, and
    torch's eval still walks its backward actions: on a V schedule the stage that shares a rank with
    the next one then asks that stage for an input gradient it never made (torch 2.13: "can't
    steal_bwd_input if this stage doesn't have backward"). Run the forward actions alone, in their
    order: every forward still meets the sends it waits for, since none of them waits on a backward."""
    order = getattr(schedule, "pipeline_order_with_comms", None)
    if order is None:  # single-stage schedules have no action list
        yield
        return
    schedule.pipeline_order_with_comms = {rank: _forward_actions(actions) for rank, actions in order.items()}
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = order


def _forward_actions(actions) -> list:
    kept = []
    for action in actions:
        kind = action.computation_type.name
        if kind == "OVERLAP_F_B":  # DualPipeV's overlapped forward + backward: keep the forward
            kept += [a for a in action.sub_actions if a.computation_type.name == "FORWARD"]
        elif kind not in BACKWARD_ACTIONS:
            kept.append(action)
    return kept
