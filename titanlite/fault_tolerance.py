"""Fault-tolerant replica groups on torchft (`[fault_tolerance] enable`).

Each replica group is its own torchrun job, with FSDP, TP, PP and CP inside it; torchft's Manager
owns the replicate dimension between groups and agrees with torchft's Lighthouse on who takes part,
every step:
  start_step()       the quorum, run in the background while the forward runs; a group that (re)joins
                     behind the others receives a live peer's state over HTTP (torchft's transport)
  sync_gradients()   after backward, before clipping: the mean of each gradient shard with the same
                     shard of every other group (one all-reduce per dtype over torchft's process
                     group; a group still healing adds zeros and is not counted)
  should_commit()    every rank of this group agrees the step went through, and no group healed in
                     it; only then the optimizer steps. Otherwise (a group died mid-step, or one
                     took a peer's state) every group redoes the step with the same batch.
A group that comes back takes the weights, buffers, optimizer states, lr schedule and step of a
healthy peer, not a checkpoint. Each group reads its own part of the data (`data_position`); a
restarted group resumes its part from its last checkpoint (its data position), else from the start.

With `semi_sync_method` the groups train apart and meet every `sync_steps` steps, through torchft's
own LocalSGD (the weights averaged) or DiLoCo (the mean of each group's change since the last sync,
the pseudo-gradient, taken by an outer Nesterov SGD, lr 0.7 and momentum 0.9 as TorchTitan; streaming
DiLoCo syncs `num_fragments` runs of blocks in turn). The quorum, healing and the commit happen at the
syncs, in the optimizer's step hook; a failed sync's DiLoCo fragment goes back to its last synced weights.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from datetime import timedelta

import torch
from torch import nn

from titanlite.config import ConfigError, JobConfig
from titanlite.dtensors import local
from titanlite.metrics import log_line
from titanlite.parallel.pipeline import spread_modules

OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # DiLoCo's outer Nesterov SGD, TorchTitan's settings
MAX_FAILED_IN_A_ROW = 10  # steps (or syncs) torchft may fail to commit in a row before the run ends in one line


class FaultToleranceFailed(RuntimeError):
    """torchft could not go on (the Lighthouse or a peer unreachable past the timeout): one line."""


@contextmanager
def reported(what: str, timeout_ms: int):
    """torchft's exceptions out of `what` (RuntimeError, TimeoutError, KeyError, its own) as one line."""
    try:
        yield
    except FaultToleranceFailed:
        raise  # said already, by a call inside this one
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise FaultToleranceFailed(
            f"fault tolerance: {what} failed ({first}); the Lighthouse (TORCHFT_LIGHTHOUSE) and the other replica "
            f"groups must answer within fault_tolerance.process_group_timeout_ms={timeout_ms}"
        ) from None


class FaultTolerance:
    """torchft's Manager for this rank, and the state a recovering group takes from it. `trainer` is
    the Trainer (its model parts, optimizers, lr schedulers and step counters)."""

    def __init__(self, config: JobConfig, trainer):
        import torchft  # preflight.check_lighthouse said how to install it where it is missing
        ft = config.fault_tolerance
        self.trainer, self.replica_id, self.group_size, self.settings = trainer, ft.replica_id, ft.group_size, ft
        timeout = timedelta(milliseconds=ft.process_group_timeout_ms)
        # torchft's process group between the groups: its size counts the groups of the last quorum, healing ones too.
        self.group = (torchft.ProcessGroupGloo if ft.process_group == "gloo" else torchft.ProcessGroupNCCL)(timeout=timeout)
        for optimizer in trainer.optimizers:  # a group that has not stepped holds the tensors a peer's state lands in
            if not optimizer.state:
                make_optimizer_state(optimizer)
        self.state, self.timeout_ms = self.recovery_tensors(), ft.process_group_timeout_ms
        with reported("joining the Lighthouse", self.timeout_ms):
            self.manager = reporting_manager(torchft.Manager, self.timeout_ms)(
                pg=self.group,
                min_replica_size=ft.min_replica_size,
                load_state_dict=self.load_state,
                state_dict=self.state_to_send,
                replica_id=f"titanlite_ft_{ft.replica_id}",
                timeout=timeout,
                connect_timeout=timeout,
                # Every group starts from the same weights (debug.seed is required): torchft's step-0 sync
                # would count the group it syncs as a participant of step 1 while zeroing its gradients.
                init_sync=False,
                max_retries=MAX_FAILED_IN_A_ROW,
                # LocalSGD and DiLoCo agree on the quorum (and heal) at a sync, before its all-reduce.
                use_async_quorum=ft.semi_sync_method is None,
            )
        self.committed = True  # the last step's fate (a semi-sync step always commits: its sync may not)
        self.steps_redone, self.lost_seconds, self.step_start, self.started = 0, 0.0, 0.0, None
        self.quorum_at_step_start = self.quorum_at_start = 0.0
        self.data_step = None  # the step of a data position loaded without the model (a checkpoint of this group's)
        self.sync_every, self.inner_steps, self.syncs, self.syncs_failed = 0, 0, 0, 0
        self.last_sync_end: dict[int, float] = {}  # per DiLoCo fragment
        self.outer: list[torch.optim.Optimizer] = []  # DiLoCo's outer optimizers, one per fragment
        self.semi_sync = self.start_semi_sync() if ft.semi_sync_method else None  # torchft's LocalSGD or DiLoCo

    def data_position(self, dp_rank: int, dp_degree: int) -> tuple[int, int]:
        """(rank, ranks) of this rank's loader among every group's data-parallel ranks."""
        return self.replica_id * dp_degree + dp_rank, self.group_size * dp_degree

    def recovery_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's parts of every parameter, persistent buffer and optimizer state, by name: what a
        recovering peer copies in place. Gathered on the main thread, at start and after a checkpoint load
        (which may replace the tensors): torchft sends them from its quorum thread while FSDP runs the forward."""
        t, tensors = self.trainer, {}
        for part, optimizer in zip(t.model_parts, t.optimizers):
            names = {id(p): name for name, p in part.named_parameters()}
            for name, value in part.state_dict().items():
                tensors[f"model.{name}"] = local(value)
            for group in optimizer.param_groups:
                for p in group["params"]:
                    for key, value in optimizer.state[p].items():
                        tensors[f"optimizer.{names[id(p)]}.{key}"] = local(value)
        return tensors

    def state_to_send(self) -> dict:
        """A snapshot for a recovering peer, in host memory (this group trains on while the peer reads),
        taken once the optimizer steps already launched on the device are done."""
        t = self.trainer
        if torch.cuda.is_available():
            torch.cuda.synchronize()
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
        if self.data_step is not None and self.data_step != counters["step"] - 1:
            log_line(f"this replica group's data position is of step {self.data_step}, and it healed to step "
                     f"{counters['step'] - 1}: it reads on from its own position (batches repeated or skipped)")
        self.data_step = None
        t.step, t.tokens_seen = counters["step"], counters["tokens_seen"]
        t.skipped_steps = counters["skipped_steps"]
        for scheduler in t.lr_schedulers:
            scheduler.last_epoch = counters["lr_step"]
            for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_lr()):
                group["lr"] = lr

    def resumed(self, manager_step: int) -> None:
        """After loading a checkpoint of this group's whole state: torchft's step as saved, so that the
        groups that resumed nothing (step 0) heal from the newest; the tensors a peer would be sent
        again (the load may have replaced them)."""
        self.state = self.recovery_tensors()
        self.manager.load_state_dict({"step": manager_step, "batches_committed": self.manager.batches_committed()})

    def writes_model(self) -> bool:
        """Whether this group writes the model and optimizer at a checkpoint. With gradients synced
        every step one group does (the first of the last quorum), the others save their data position;
        under LocalSGD and DiLoCo every group does (their weights and optimizers differ between syncs)."""
        return bool(self.settings.semi_sync_method) or self.manager.participating_rank() == 0

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """DiLoCo's state, by fragment: the last synced weights (as DTensors like their parameters, so
        any layout reloads them; they share the memory DiLoCo keeps them in) and the outer momentum.
        A checkpoint loads them in place."""
        from torch.distributed.tensor import DTensor

        state = {}
        # torchft 0.2.0 (pinned) keeps each fragment's last synced weights in `_fragments[i].original_parameters`.
        for i, (fragment, outer) in enumerate(zip(getattr(self.semi_sync, "_fragments", []), self.outer)):
            for name, p in fragment._model_fragment.named_parameters():
                synced = fragment.original_parameters[name]
                if isinstance(p, DTensor):
                    synced = DTensor.from_local(synced, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)
                state[f"{i}.synced.{name}"] = synced
                state[f"{i}.momentum.{name}"] = outer.state[p]["momentum_buffer"]
        return state

    def start_step(self) -> None:
        self.step_start, self.quorum_at_step_start = time.perf_counter(), self.manager.quorum_seconds
        if not self.settings.semi_sync_method:
            self.manager.start_quorum()

    def start_semi_sync(self):
        """torchft's LocalSGD or DiLoCo on the model and its optimizer, its hooks on the optimizer's
        step between two of ours: one notes when a sync starts, the other whether it committed. DiLoCo
        takes the weights as its last synced ones now; a checkpoint load puts the saved ones in place."""
        from torchft import local_sgd

        ft, model, optimizer = self.settings, self.trainer.model_parts[0], self.trainer.optimizers[0]
        if ft.should_quantize and not torch.cuda.is_available():
            log_line("fault_tolerance.should_quantize: torchft quantizes with triton on a GPU; here the pseudo-gradients go in full precision")
        optimizer.register_step_post_hook(self.before_sync)
        if ft.semi_sync_method == "local_sgd":
            method, self.sync_every = local_sgd.LocalSGD(self.manager, model, optimizer, sync_every=ft.sync_steps), ft.sync_steps
        else:
            parts = fragments(model, self.trainer.plan, ft.module_fqns_per_model_fragment, ft.num_fragments)
            self.outer = [torch.optim.SGD(part.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True) for part in parts]
            for outer in self.outer:  # zero momentum steps as none: a checkpoint has it from the start
                for p in outer.param_groups[0]["params"]:
                    outer.state[p]["momentum_buffer"] = torch.zeros_like(p)
            method = local_sgd.DiLoCo(
                self.manager, parts, optimizer, self.outer, sync_every=ft.sync_steps, should_quantize=ft.should_quantize,
                fragment_sync_delay=ft.fragment_sync_delay, fragment_update_alpha=ft.fragment_update_alpha,
            )
            self.sync_every = ft.sync_steps // len(parts)
        method.__enter__()
        optimizer.register_step_post_hook(self.after_sync)
        self.last_sync_end = dict.fromkeys(range(ft.sync_steps // self.sync_every), time.perf_counter())
        return method

    def before_sync(self, *_) -> None:
        self.inner_steps += 1
        if self.inner_steps % self.sync_every == 0:
            self.sync_start, self.sync_step = time.perf_counter(), self.manager.current_step()

    def after_sync(self, *_) -> None:
        """A sync that did not commit: LocalSGD keeps the local weights, DiLoCo's fragment goes back to
        its last synced ones, so its steps since then count as lost."""
        if self.inner_steps % self.sync_every:
            return
        self.syncs += 1
        fragment = self.sync_step % len(self.last_sync_end)  # DiLoCo's turn: torchft's step modulo the fragments
        if not self.manager.committed:
            self.syncs_failed += 1
            if self.settings.semi_sync_method == "diloco":
                self.lost_seconds += self.sync_start - self.last_sync_end[fragment]
        self.last_sync_end[fragment] = time.perf_counter()

    def sync_gradients(self, params: list[torch.Tensor]) -> None:
        """The mean over the participating groups of each of this rank's gradient shards, in place
        (every step; semi-sync methods meet at their syncs instead)."""
        if self.settings.semi_sync_method:
            return
        self.manager.wait_quorum()
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

        if self.settings.semi_sync_method:  # each group balances its own experts between syncs
            return t
        self.manager.allreduce(t, reduce_op=ReduceOp.SUM).wait()
        return t

    def should_commit(self) -> bool:
        """Whether this step counts: every rank of this group went through it, and no group took a
        peer's state in it. A healing group's gradient counts for nothing (torchft zeroes it), so every
        group redoes such a step with the same batch: each step that counts averages every group's batch,
        and a full restart (one group resumes the model, the others heal from it) resumes exactly."""
        if self.started is None:  # goodput counts from the first step's end: the wait for the groups to start is not a failure
            self.started, self.quorum_at_start = time.perf_counter(), self.manager.quorum_seconds
        if self.settings.semi_sync_method:
            return True
        self.committed = self.manager.should_commit() and self.group.size() == self.manager.num_participants()
        if not self.committed:  # the whole step is redone (its wait for the quorum is counted already)
            self.steps_redone += 1
            self.lost_seconds += time.perf_counter() - self.step_start - (self.manager.quorum_seconds - self.quorum_at_step_start)
        elif self.data_step is not None:
            log_line(f"this replica group resumed its data position of step {self.data_step}, but no group held a "
                     "model to heal from: training starts from the initial weights")
            self.data_step = None
        return self.committed

    @property
    def stalled_seconds(self) -> float:
        """Time lost to failures since the first step: waits for a quorum that changed (a dead group is
        dropped after the Lighthouse's heartbeat timeout; a group joins and heals), steps redone, and
        DiLoCo's steps undone by a failed sync."""
        return self.manager.quorum_seconds - self.quorum_at_start + self.lost_seconds

    def goodput(self) -> float:
        """The share of the wall time since the first step that was not stalled."""
        wall = time.perf_counter() - self.started if self.started is not None else 0.0
        return 1.0 - self.stalled_seconds / wall if wall > 0 else 1.0

    def metrics(self) -> dict[str, float]:
        """For a log step: the groups that took part in the last step or sync (whether this one did:
        not while it heals), steps redone, time stalled and goodput so far; the syncs of a semi-sync method."""
        metrics = {
            "ft_replicas": float(self.manager.num_participants()),
            "ft_participating": float(self.manager.is_participating()),
            "ft_steps_redone": float(self.steps_redone),
            "ft_stalled_seconds": self.stalled_seconds,
            "ft_goodput": self.goodput(),
        }
        if self.settings.semi_sync_method:
            metrics |= {"ft_syncs": float(self.syncs), "ft_syncs_failed": float(self.syncs_failed)}
        return metrics

    def summary(self) -> str:
        """The run's fault-tolerance figures, for the last console line."""
        syncs = f", {self.syncs} syncs ({self.syncs_failed} failed)" if self.settings.semi_sync_method else ""
        return (f"fault tolerance: goodput {100 * self.goodput():.1f}%, {self.stalled_seconds:.1f}s stalled, "
                f"steps redone: {self.steps_redone}{syncs}")

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


def reporting_manager(manager_class: type, timeout_ms: int) -> type:
    """torchft's Manager, its failures reported in one line and its waits for a quorum that changed
    timed into `quorum_seconds` (a dead group's heartbeat timeout, a recovery), whether the Trainer
    calls it or torchft's LocalSGD and DiLoCo do. (`_quorum_id`: torchft 0.2.0's, pinned.)"""

    class ReportingManager(manager_class):
        quorum_seconds, timing, committed = 0.0, False, True  # committed: the last commit vote

        @contextmanager
        def timed(self, what: str):
            """Counts a wait in which the groups changed (torchft's quorum id moved: a group dropped after
            its heartbeat timeout, or one joined and healed); waits for a slower group at an unchanged
            quorum are the price of training in step, not of a failure. The outermost call only: a
            synchronous start_quorum calls wait_quorum."""
            outermost, self.timing, start, quorum = not self.timing, True, time.perf_counter(), self._quorum_id
            try:
                with reported(what, timeout_ms):
                    yield
            finally:
                if outermost:
                    self.timing = False
                    if self._quorum_id != quorum:
                        self.quorum_seconds += time.perf_counter() - start

        def start_quorum(self, *args, **kwargs) -> None:
            with self.timed("the quorum (or healing from a peer)"):
                super().start_quorum(*args, **kwargs)

        def wait_quorum(self) -> None:
            with self.timed("the quorum"):
                super().wait_quorum()

        def should_commit(self, *args, **kwargs) -> bool:
            with reported("the commit vote (or healing from a peer)", timeout_ms):
                self.committed = super().should_commit(*args, **kwargs)
            return self.committed

    return ReportingManager


def fragments(model: nn.Module, plan, names: list[list[str]], count: int) -> list[nn.Module]:
    """DiLoCo's fragments: the modules named per fragment, or `count` runs of consecutive blocks (the
    embedding and the output each counted as a block, as TorchTitan). Every parameter in exactly one."""
    blocks = [f"{plan.blocks}.{key}" for key in getattr(model, plan.blocks).keys()]
    names = [list(part) for part in names] or spread_modules(list(plan.head), blocks, list(plan.tail), count, 1, 1)
    modules = dict(model.named_modules())
    unknown = [name for part in names for name in part if name not in modules]
    if unknown:
        raise ConfigError(
            f"fault_tolerance.module_fqns_per_model_fragment names {unknown[0]!r}, not a module of the model; "
            f"use names from {', '.join([*plan.head, *blocks, *plan.tail])}"
        )
    parts = [nn.ModuleList([modules[name] for name in part]) for part in names]
    owners = {}
    for i, part in enumerate(parts):
        for p in part.parameters():
            owners.setdefault(id(p), set()).add(i)
    alone = {id(p) for p in model.parameters()} - set(owners)
    if alone or any(len(o) > 1 for o in owners.values()):
        raise ConfigError(
            f"fault_tolerance.module_fqns_per_model_fragment={names} must hold every parameter in exactly one "
            f"fragment ({len(alone)} in none, {sum(len(o) > 1 for o in owners.values())} in several)"
        )
    return parts
