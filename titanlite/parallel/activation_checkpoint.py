"""Activation checkpointing: recompute activations in backward instead of keeping them.

  full                    every transformer block keeps only its input and reruns its forward
  selective, option 'op'  per-op policy: keep the outputs of matmuls (a MoE's grouped ones too) and
                          attention (expensive to recompute), recompute the cheap elementwise ops and norms
  selective, option 'k'   fully checkpoint every k-th block (layer ids 0, k, 2k, ...)

Recompute exchanges no counts and reads nothing to the host: what a checkpointed block's forward got
from other ranks (expert parallel's counts and split sizes, MoE counts summed over ranks) is kept
(`ForwardReplay`) and handed back when backward reruns that forward. The op policy keeps the token
exchanges' outputs too (as it keeps matmuls'), so its recompute communicates nothing; full
checkpointing exchanges the tokens again rather than keep 2 x top_k copies of a block's input.
"""

from __future__ import annotations

from collections import deque
from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts

from titanlite.models.common.forward_stats import in_backward
from titanlite.models.common.moe import any_dtype_grouped_mm
from titanlite.parallel.document_ring import document_ring
from titanlite.parallel.stage_inference import MetadataInference

aten = torch.ops.aten
SAVED_OPS = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten._grouped_mm.default,
    any_dtype_grouped_mm._opoverload,  # the grouped GEMM in fp32 (CPU)
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.higher_order.flex_attention,  # block_causal on CUDA (models/common/attention.py), in compiled blocks
    document_ring._opoverload,  # block_causal under context parallel: its output, not its score tiles
}


class ForwardReplay:
    """Values a module's forward got by communicating, in order, kept for its recompute: `begin()` at
    the forward's first exchange, then `replay(lambda: exchange(...))` for each. In the forward the
    exchanges run and their results are recorded; in recompute (inside backward) they come back from
    the record of the oldest forward not yet recomputed (backward takes microbatches in forward
    order), and nothing is exchanged. Only inside checkpointed blocks (`active`, set by apply_ac)
    and for forwards that record a graph; the lambdas hold the exchange alone: local ops run in both,
    so recompute saves the same tensors as the forward and calls every op the op policy saves as
    often. Bulky exchanges (tokens) are kept under the op policy only."""

    def __init__(self):
        self.active, self.records, self.recording, self.replaying = False, deque(), False, None
        self.keep_bulky = False  # keep exchanges marked bulky (tokens) too: the op policy

    def begin(self) -> None:
        recorded = self.active and torch.is_grad_enabled() and not MetadataInference.running
        self.recording, self.replaying = recorded and not in_backward(), None
        if self.recording:
            self.records.append([])
        elif recorded:
            self.replaying = iter(self.records.popleft())

    def __call__(self, exchange, bulky: bool = False):
        if bulky and not self.keep_bulky:
            return exchange()
        if self.replaying is not None:
            return next(self.replaying)
        value = exchange()
        if self.recording:
            self.records[-1].append(value)
        return value


def check_replays_done(replays_: list[ForwardReplay]) -> None:
    """After a step's backward every recorded forward has been recomputed: one left over would hand
    its values to another microbatch's recompute."""
    if any(replay.records for replay in replays_):
        for replay in replays_:
            replay.records.clear()
        raise RuntimeError("a checkpointed forward's exchanges were never replayed by its recompute (a forward "
                           "with autograd and no backward?); the records are cleared")


def replays(module: nn.Module) -> list[ForwardReplay]:
    return [m.forward_replay for m in module.modules() if isinstance(getattr(m, "forward_replay", None), ForwardReplay)]


def ignore_profiler_annotations() -> None:
    """The op policy keeps a record of every op a block's forward runs and wants recompute to run no
    more of each. FSDP's hooks annotate with record_function ops, and a unit nested in a block (split
    experts) that the block before it prefetched annotates less in the forward (no gather) than in
    the recompute: torch's own ignore list gets the profiler's ops, which compute nothing."""
    profiler = torch.ops.profiler
    for op in (profiler._record_function_enter, profiler._record_function_enter_new, profiler._record_function_exit):
        SAC_IGNORED_OPS.update(getattr(op, overload) for overload in op.overloads())


def _keep_matmuls_and_attention(ctx, op, *args, **kwargs):
    if not torch.is_grad_enabled():  # what a forward computes aside (QK-clip's largest logits) is kept by no one
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: nn.Module, plan, ac, replay_exchanges: bool = True) -> None:
    """Wrap the model's blocks in place (the family's `blocks`, keyed by layer id, and its blocks
    elsewhere; names gain `_checkpoint_wrapped_module.`), as [activation_checkpoint] says; its
    preserve_rng_state, determinism_check, debug and early_stop go to torch.utils.checkpoint as they are
    (early_stop: not for blocks with exchanges to replay). `replay_exchanges`: false where a block may
    be recomputed twice (split-backward pipeline schedules): then recompute exchanges again."""
    option = ac.selective_ac_option
    checkpoint_options = dict(
        preserve_rng_state=ac.preserve_rng_state, determinism_check=ac.determinism_check, debug=ac.debug,
        early_stop=ac.early_stop,
    )
    blocks = getattr(model, plan.blocks)
    for parent, name in [(blocks, key) for key in blocks] + plan.blocks_elsewhere(model):
        block = getattr(parent, name)
        layer_id = int(name) if name.isdigit() else block.layer_id
        # A block that replays its exchanges reruns its whole forward: stopping early could leave a
        # record unused, and the next recompute would take it.
        options = checkpoint_options | ({"early_stop": False} if replay_exchanges and replays(block) else {})
        if ac.mode == "full" or (ac.mode == "selective" and option.isdigit() and layer_id % int(option) == 0):
            setattr(parent, name, checkpoint_wrapper(block, **options))
        elif ac.mode == "selective" and option == "op":
            ignore_profiler_annotations()
            policy = partial(create_selective_checkpoint_contexts, _keep_matmuls_and_attention)
            setattr(parent, name, checkpoint_wrapper(block, context_fn=policy, **options))
        else:
            continue
        for replay in replays(block):
            replay.active, replay.keep_bulky = replay_exchanges, ac.mode == "selective" and option == "op"
