"""Replay on suspicion (health.replay), in the manner of Megatron's rerun state machine but in process:
a step whose loss or grad norm spiked or is not finite runs again on the same data, before its update.

- The replay differs, bit for bit, from the first result on some ranks (their loss part or the bits of
  their gradient pieces): a transient fault there. Those ranks and hosts are named; the first result
  is dropped and the replay's kept (checked for a spike again, without another replay).
- It reproduces: the data, or a fault that repeats. The suspect (the rank SpikeGuard names: the
  largest part of the loss or gradients) has its batch recomputed by the next data-parallel rank, as
  Megatron reruns from a checkpoint on another GPU; every data-parallel rank takes its neighbour's
  batch, as their collectives need. The same loss bits: the data (the step is skipped, a spike as
  spike_policy says). Other bits: a persistent fault of the suspect's device, named; the run stops.

It compares bits, so the kernels must give the same bits each run (debug.deterministic on a GPU).
What is compared is each rank's own loss part and gradient pieces: under FSDP a fault in a rank's
backward shows in the piece a reduce-scatter brings to its owner, and the recompute elsewhere runs the
forward alone (a fault only in the backward is taken for the data there).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from titanlite.dtensors import local
from titanlite.errors import ConfigError, TrainingDiverged
from titanlite.health import bits_sum
from titanlite.optim.clip import clip_grad_norm_, reduce_partial_grads


class HardwareFault(TrainingDiverged):
    """A rank computes a step's batch differently from another rank, again and again: one line, exit 1."""


class Replay:
    def __init__(self, config, device: torch.device, metrics, hosts: list[str]):
        if device.type == "cuda" and not config.debug.deterministic:
            raise ConfigError("health.replay=true compares a step's bits with its replay's, and this GPU's kernels may "
                              "differ run to run; set debug.deterministic=true")
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
            checker = self.recompute_elsewhere(trainer, local_loss, suspect)
            if checker is None:
                self.metrics.log_event(trainer.step, {"health_replay_data": 1.0},
                                       f"step {trainer.step}: replay reproduces the result, and {self.named([suspect])}'s "
                                       "batch recomputed on another rank gives the same bits: the data")
                return "data"
            raise HardwareFault(
                f"step {trainer.step}: {self.named([suspect])} gives the same suspect result again, but its batch "
                f"recomputed on {self.named([checker])} gives other bits: a persistent fault of {self.named([suspect])}'s "
                "device; training stopped. Leave that host out and resume from the last checkpoint")
        finally:
            self.seconds += time.perf_counter() - began

    def replay(self, trainer, local_loss: torch.Tensor, grad_norm: torch.Tensor) -> list[int]:
        """The step's forward and backward again, on the same microbatches; the ranks whose result changed."""
        params = trainer.parameters()
        first = fingerprint(local_loss, params)
        for opt in trainer.optimizers:
            opt.zero_grad(set_to_none=True)
        for layer in trainer.moe_layers:  # the counts start again: the replay's routing is the one kept
            layer.tokens_per_expert.zero_()
            layer.aux_loss_sum.zero_()
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

    def recompute_elsewhere(self, trainer, local_loss: torch.Tensor, suspect: int) -> int | None:
        """Each data-parallel rank's batch, forward only, on the next data-parallel rank; the rank that
        recomputed the suspect's batch when its loss bits differ from the suspect's own, else None."""
        group = trainer.batch_group
        ranks = dist.get_process_group_ranks(group)
        me = ranks.index(dist.get_rank())
        batches = torch.stack([torch.stack(pair) for pair in trainer.microbatches])  # (accumulation, 2, batch, seq)
        every = [torch.empty_like(batches) for _ in ranks]
        dist.all_gather(every, batches, group=group)
        source = (me - 1) % len(ranks)
        mtp_loss = trainer.mtp_loss.clone()
        trainer.injector.origin = ranks[source]
        try:
            with torch.no_grad():
                recomputed = trainer.compute_gradients([(pair[0], pair[1]) for pair in every[source]], backward=False)
        finally:
            trainer.injector.origin = dist.get_rank()
            trainer.mtp_loss.copy_(mtp_loss)
        own = [torch.zeros_like(local_loss) for _ in ranks]  # each rank's first loss part
        dist.all_gather(own, local_loss.detach().clone(), group=group)
        differs = ranks[source] == suspect and not same(recomputed, own[source])
        checker = ranks_where(differs, local_loss.device)
        return checker[0] if checker else None

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
    """The same bits, or both NaN (a NaN's sign and payload may differ from one kernel path to another)."""
    return torch.equal(bits_sum(a.float()), bits_sum(b.float())) or bool(a.isnan() & b.isnan())


def ranks_where(flag: bool, device: torch.device) -> list[int]:
    """The global ranks where `flag` holds (one all-gather over the world)."""
    mine = torch.tensor([float(flag)], device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [r for r, f in enumerate(every) if f.item()]
