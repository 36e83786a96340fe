"""Replay on suspicion (health.replay), in the manner of Megatron's rerun state machine but in process:
a step whose loss or grad norm spiked or is not finite runs again on the same data, before its update.

- The replay differs, bit for bit, from the first result on some ranks (their loss part or the bits of
  their gradient pieces): a transient fault there. Those ranks and hosts are named; the first result
  is dropped and the replay's kept (checked for a spike again, without another replay).
- It reproduces: the data, or a fault that repeats. Every data-parallel rank computes its own batch
  and the previous rank's, forward only (as Megatron reruns from a checkpoint on another GPU), and
  compares the second with that rank's own bit for bit. All the same: the data (the step is skipped,
  a spike as spike_policy says). Otherwise the rank in most mismatches (its own batch and the one it
  checked) is named a persistent fault; the run stops.

It compares bits, so the kernels must give the same bits each run (debug.deterministic on a GPU).
What is compared is each rank's own loss part and gradient pieces: under FSDP a fault in a rank's
backward shows in the piece a reduce-scatter brings to its owner, and the recompute elsewhere runs the
forward alone (a fault only in the backward is taken for the data there). Under tensor or pipeline
parallel the ranks that compute a batch together are named together.
"""

from __future__ import annotations

import time
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from titanlite.dtensors import local
from titanlite.errors import ConfigError, TrainingDiverged
from titanlite.health import bits_sum
from titanlite.models.common.moe import clear_counts
from titanlite.optim.clip import clip_grad_norm_, reduce_partial_grads


class HardwareFault(TrainingDiverged):
    """A rank computes a step's batch differently from another rank, again and again: one line, exit 1."""


class Replay:
    def __init__(self, config, device: torch.device, metrics, hosts: list[str]):
        d = config.debug
        if device.type == "cuda" and (not d.deterministic or d.deterministic_warn_only):
            raise ConfigError("health.replay=true compares a step's bits with its replay's, and this GPU's kernels may "
                              "differ run to run; set debug.deterministic=true (and deterministic_warn_only=false)")
        self.metrics, self.hosts = metrics, hosts
        self.seconds = 0.0  # spent replaying since the goodput clock last took it

    def classify(self, trainer, local_loss: torch.Tensor, grad_norm: torch.Tensor, suspect: int) -> str:
        """'transient' (the replay's gradients, loss part and grad norm now stand in the first's place,
        in place) or 'data'; raises HardwareFault. Collective: every rank calls it."""
        began = time.perf_counter()
        try:
            changed = self.replay(trainer, local_loss, grad_norm)
            if changed:
                self.metrics.log_event(
                    trainer.step, {"health_transient_rank": float(changed[0])},
                    f"step {trainer.step}: replay on the same data differs from the first result on {self.named(changed)}: "
                    "a transient fault; the first result is dropped, the replay's kept")
                return "transient"
            if trainer.dp_degree == 1:
                self.metrics.log_event(trainer.step, {"health_replay_data": 1.0}, f"step {trainer.step}: replay reproduces "
                                       "the result; no other data-parallel rank to recompute it on: taken for the data")
                return "data"
            faulty, why = self.recompute_elsewhere(trainer, suspect)
            if not faulty:
                self.metrics.log_event(trainer.step, {"health_replay_data": 1.0},
                                       f"step {trainer.step}: replay reproduces the result, and every data-parallel rank's "
                                       "batch recomputed on the next gives the same bits there: the data")
                return "data"
            raise HardwareFault(
                f"step {trainer.step}: the replay reproduces the result, but recomputed on the next data-parallel rank the "
                f"batches {self.named(faulty)} computed give other bits: a persistent fault of {self.named(faulty)}{why}; "
                "training stopped. Leave that host out and resume from the last checkpoint")
        finally:
            self.seconds += time.perf_counter() - began

    def replay(self, trainer, local_loss: torch.Tensor, grad_norm: torch.Tensor) -> list[int]:
        """The step's forward and backward again, on the same microbatches; the ranks whose result changed."""
        params = trainer.parameters()
        first = fingerprint(local_loss, params)
        for p in params:
            p.grad = None
        clear_counts(trainer.moe_layers)  # the replay's routing is the one kept
        for opt in trainer.optimizers:
            if getattr(opt, "qk_clip", None):
                opt.qk_clip.reset()
        loss = trainer.compute_gradients(trainer.microbatches)
        trainer.injector.after_backward(trainer.step, params)
        reduce_partial_grads(params)
        changed = ranks_where(not torch.equal(first, fingerprint(loss, params)), local_loss.device)
        if changed:
            local_loss.copy_(loss)
            grad_norm.copy_(clip_grad_norm_(params, 0, trainer.pp_group))
            if trainer.is_moe:
                trainer.balance = trainer.expert_balance()
        return changed

    def recompute_elsewhere(self, trainer, suspect: int) -> tuple[list[int], str]:
        """Forward only, without gradients, on every data-parallel rank: its own batch, then the previous
        rank's (a ring: each sends its batch and its loss bits to the next), compared bit for bit. A rank
        that computes wrong is in two mismatches (its own batch and the one it checked), its neighbours
        in one: the ranks in most are named. Where all tie (2 data-parallel ranks) the suspect is, as
        Megatron trusts the GPU it reruns on. ([] when every batch agrees, what the naming rests on)."""
        group = trainer.batch_group
        ranks = dist.get_process_group_ranks(group)
        me = ranks.index(dist.get_rank())
        after, before = ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]
        mine = torch.stack([torch.stack(pair) for pair in trainer.microbatches])  # (accumulation, 2, batch, seq)
        mtp_loss = trainer.mtp_loss.clone()
        try:
            own = forward_only(trainer, mine, dist.get_rank())
            theirs, their_loss = torch.empty_like(mine), torch.empty_like(own)
            ops = [dist.P2POp(dist.isend, mine, after, group), dist.P2POp(dist.isend, own, after, group),
                   dist.P2POp(dist.irecv, theirs, before, group), dist.P2POp(dist.irecv, their_loss, before, group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            recomputed = forward_only(trainer, theirs, before)
        finally:
            trainer.mtp_loss.copy_(mtp_loss)
            for module in (m for part in trainer.model_parts for m in part.modules() if isinstance(m, FSDPModule)):
                module.reshard()  # a forward without backward leaves units that keep their gathered weights so
        mismatches = gathered([float(not same(recomputed, their_loss)), float(before)], own.device)
        involved = Counter()
        for rank, (differs, source) in enumerate(mismatches):
            if differs:
                involved.update([rank, int(source)])
        if not involved:
            return [], ""
        most = max(involved.values())
        faulty = sorted(rank for rank, count in involved.items() if count == most)
        if len(faulty) == len(involved):
            return [suspect], " (whose result spiked: the recompute cannot tell it from the rank that checked it)"
        return faulty, ""

    def take_seconds(self) -> float:
        """The time spent replaying since the last call (the goodput clock counts it apart)."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def named(self, ranks: list[int]) -> str:
        return ", ".join(f"rank {r} ({self.hosts[r]})" for r in ranks)


def fingerprint(loss: torch.Tensor, params) -> torch.Tensor:
    """A rank's result as integers: its loss part's bits and the bit sums of its gradient pieces."""
    grads = [bits_sum(local(p.grad.detach())).to(loss.device) for p in params if p.grad is not None]
    return torch.stack([bits_sum(loss.detach().float()).to(loss.device), *grads])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits (a NaN's too: the same computation gives the same NaN)."""
    return torch.equal(bits_sum(a.float()), bits_sum(b.float()))


def forward_only(trainer, batches: torch.Tensor, origin: int) -> torch.Tensor:
    """The loss part of (accumulation, 2, batch, seq) microbatches, forward only, without gradients;
    `origin`: the rank whose batch it is (a drill's poisoned batch follows it)."""
    trainer.injector.origin = origin
    try:
        with torch.no_grad():
            return trainer.compute_gradients([(pair[0], pair[1]) for pair in batches], backward=False).float().reshape(1)
    finally:
        trainer.injector.origin = dist.get_rank()


def gathered(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's `values` (one all-gather over the world)."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [t.tolist() for t in every]


def ranks_where(flag: bool, device: torch.device) -> list[int]:
    """The global ranks where `flag` holds."""
    return [rank for rank, (value,) in enumerate(gathered([float(flag)], device)) if value]
