"""Fault-tolerant replica groups on torchft (`[fault_tolerance] enable`).

Each replica group is its own torchrun job, with FSDP, TP, PP and CP inside it; torchft's Manager
owns the replicate dimension between groups and agrees with torchft's Lighthouse on who takes part,
every step:
  start_step()       the quorum, run in the background while the forward runs; a group that (re)joins
                     behind the others receives a live peer's state over HTTP (torchft's transport)
  sync_gradients()   after backward, before clipping: the mean of each gradient shard with the same
                     shard of every other group (one all-reduce per dtype over torchft's process
                     group; a group still healing adds zeros and is not counted)
  should_commit()    every rank of this group agrees the step went through; only then the optimizer
                     steps. A group whose all-reduce failed (a group died mid-step) does not commit
                     and redoes the step with the next batch; a group behind heals from one that did.
A group that comes back takes the weights, buffers, optimizer states, lr schedule and step of a
healthy peer, not a checkpoint. Each group reads its own part of the data (`data_position`); a
restarted group starts its part from the beginning.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from datetime import timedelta

import torch

from titanlite.config import JobConfig


class FaultToleranceFailed(RuntimeError):
    """torchft could not go on (the Lighthouse or a peer unreachable past the timeout): one line."""


@contextmanager
def reported(what: str, timeout_ms: int):
    """torchft's exceptions out of `what` (RuntimeError, TimeoutError, KeyError, its own) as one line."""
    try:
        yield
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise FaultToleranceFailed(
            f"fault tolerance: {what} failed ({first}); the Lighthouse (TORCHFT_LIGHTHOUSE) and the other replica "
            f"groups must answer within fault_tolerance.process_group_timeout_ms={timeout_ms}"
        ) from None


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (the same part on the same rank of every group), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


class FaultTolerance:
    """torchft's Manager for this rank, and the state a recovering group takes from it. `trainer` is
    the Trainer (its model parts, optimizers, lr schedulers and step counters)."""

    def __init__(self, config: JobConfig, trainer):
        import torchft  # preflight.check_lighthouse said how to install it where it is missing
        ft = config.fault_tolerance
        self.trainer, self.replica_id, self.group_size = trainer, ft.replica_id, ft.group_size
        timeout = timedelta(milliseconds=ft.process_group_timeout_ms)
        group = (torchft.ProcessGroupGloo if ft.process_group == "gloo" else torchft.ProcessGroupNCCL)(timeout=timeout)
        self.state, self.timeout_ms = self.recovery_tensors(), ft.process_group_timeout_ms
        with reported("joining the Lighthouse", self.timeout_ms):
            self.manager = torchft.Manager(
                pg=group,
                min_replica_size=ft.min_replica_size,
                load_state_dict=self.load_state,
                state_dict=self.state_to_send,
                replica_id=f"titanlite_ft_{ft.replica_id}",
                timeout=timeout,
                connect_timeout=timeout,
                # Every group starts from the same weights (debug.seed is required): torchft's step-0 sync
                # would count the group it syncs as a participant of step 1 while zeroing its gradients.
                init_sync=False,
            )
        self.committed = True  # the last step's fate
        self.steps_redone, self.stalled_seconds, self.step_start = 0, 0.0, 0.0

    def data_position(self, dp_rank: int, dp_degree: int) -> tuple[int, int]:
        """(rank, ranks) of this rank's loader among every group's data-parallel ranks."""
        return self.replica_id * dp_degree + dp_rank, self.group_size * dp_degree

    def recovery_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's parts of every parameter, persistent buffer and optimizer state, by name: what a
        recovering peer copies in place. The optimizer states are made now (zero steps' worth), so
        that a group that has not stepped yet holds the tensors a peer's state lands in."""
        t, tensors = self.trainer, {}
        for part, optimizer in zip(t.model_parts, t.optimizers):
            names = {id(p): name for name, p in part.named_parameters()}
            for name, value in part.state_dict().items():
                tensors[f"model.{name}"] = local(value)
            if not optimizer.state:
                make_optimizer_state(optimizer)
            for group in optimizer.param_groups:
                for p in group["params"]:
                    for key, value in optimizer.state[p].items():
                        tensors[f"optimizer.{names[id(p)]}.{key}"] = local(value)
        return tensors

    def state_to_send(self) -> dict:
        """A snapshot for a recovering peer, in host memory (this group trains on while the peer reads)."""
        t = self.trainer
        return {
            "tensors": {name: value.detach().to("cpu", copy=True) for name, value in self.state.items()},
            "counters": {"step": t.step, "tokens_seen": t.tokens_seen, "skipped_steps": t.skipped_steps,
                         "lr_step": t.lr_schedulers[0].last_epoch},
        }

    def load_state(self, sent: dict) -> None:
        t = self.trainer
        missing = set(self.state) ^ set(sent["tensors"])
        if missing:
            raise RuntimeError(f"a peer's recovery state differs in {sorted(missing)[:3]}: replica groups must run one model and layout")
        with torch.no_grad():
            for name, value in self.state.items():
                value.copy_(sent["tensors"][name])
        counters = sent["counters"]
        t.step, t.tokens_seen = counters["step"], counters["tokens_seen"]
        t.skipped_steps = counters["skipped_steps"]
        for scheduler in t.lr_schedulers:
            scheduler.last_epoch = counters["lr_step"]
            for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_lr()):
                group["lr"] = lr

    def start_step(self) -> None:
        self.step_start = time.perf_counter()
        self.manager.start_quorum()

    def sync_gradients(self, params: list[torch.Tensor]) -> None:
        """The mean over the participating groups of each of this rank's gradient shards, in place.
        Waiting for the quorum (a dead group is dropped after the Lighthouse's heartbeat timeout)
        counts as time stalled."""
        start = time.perf_counter()
        with reported("the quorum", self.timeout_ms):
            self.manager.wait_quorum()
        self.stalled_seconds += time.perf_counter() - start
        grads = [local(p.grad) for p in params if p.grad is not None]
        for dtype in sorted({g.dtype for g in grads}, key=str):  # the same order in every group
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.flatten() for g in same])
            self.manager.allreduce(flat).wait()
            for g, mean in zip(same, flat.split([g.numel() for g in same])):
                g.copy_(mean.view_as(g))

    def sum_over_groups(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the participating groups (MoE's expert counts: every group moves its expert
        bias alike)."""
        from torch.distributed import ReduceOp

        self.manager.allreduce(t, reduce_op=ReduceOp.SUM).wait()
        return t

    def should_commit(self) -> bool:
        with reported("the commit vote (or healing from a peer)", self.timeout_ms):
            self.committed = self.manager.should_commit()
        if not self.committed:  # the whole step is lost
            self.steps_redone += 1
            self.stalled_seconds += time.perf_counter() - self.step_start
        return self.committed

    def metrics(self) -> dict[str, float]:
        """For a log step: the groups that took part in the last step (whether this one did: not while
        it heals), steps redone and time stalled (redone steps, waits for the quorum) so far."""
        return {
            "ft_replicas": float(self.manager.num_participants()),
            "ft_participating": float(self.manager.is_participating()),
            "ft_steps_redone": float(self.steps_redone),
            "ft_stalled_seconds": self.stalled_seconds,
        }

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def make_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's state tensors as a first step makes them, with the step counters at zero: a
    step at lr 0 on zero gradients (as DCP does before it loads), then every counter back to 0."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"].zero_()
        elif "step" in state:
            state["step"] = 0
