"""A long run's guards ([health]): loss spikes, stragglers and hangs, each found and named by rank.

- `SpikeGuard`: a step whose loss or grad norm is past mean + k std of the last `spike_window` good
  steps (the global values: every rank decides alike; under torchft the grad norm alone, the one
  value every replica group shares) is skipped (no optimizer update, as OLMo-core
  does) or only named. The rank whose part of the loss is largest is named with it. Non-finite grad
  norms stay training.skip_nonfinite_steps' (skip) or stop the run.
- `Stragglers`: every `straggler_interval` steps each rank's arrival at the step's start (after its
  own work since the last collective: the optimizer step, logging, data) is gathered; a rank later than
  the median by `straggler_percent` of the median step time, `straggler_checks` checks in a row, is
  named. Slowness inside a collective (FSDP's gathers, TP's) holds every rank alike: not seen here.
- `HangWatchdog`: a step past comm.train_timeout_seconds: every rank writes its Python stack to
  <dump_folder>/hang/ and its progress to the store, the ranks furthest behind are named in one
  line, and the rank exits 1 (torchrun or torchft restarts it). Collectives then time out later
  (`GRACE` seconds on), so the watchdog speaks first.
"""

from __future__ import annotations

import faulthandler
import math
import os
import socket
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist

from titanlite.dtensors import local
from titanlite.torchrun import write_error

GRACE = 60  # seconds the collectives wait beyond the watchdog's deadline
LEVEL_SHIFT = 3  # spikes in a row taken for a new level of the loss or grad norm, not a spike
PHASES = ("at the step's start (its batch, its own work)", "in the step (forward, backward, optimizer)", "done with the step")


def hosts() -> list[str]:
    """Every rank's host name (one all-gather, at start)."""
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    return names


class SpikeGuard:
    def __init__(self, config, metrics, hosts: list[str], replay=None):
        h = config.health
        self.window, self.sigmas, self.metrics, self.hosts = h.spike_window, h.spike_sigmas, metrics, hosts
        self.replay, self.cause = replay, "a spike"  # replay.Replay (health.replay); what the last skip was for
        # Under torchft each group would skip by its own history (a healed group's is empty): named, never skipped.
        self.policy = "warn" if h.spike_policy == "skip" and config.fault_tolerance.enable else h.spike_policy
        self.history = {"loss": deque(maxlen=self.window), "grad_norm": deque(maxlen=self.window)}
        self.spikes, self.in_a_row = 0, 0
        self.rollback = False  # policy rollback: the last step's spike is to be rolled back

    def skips(self, trainer, local_loss: torch.Tensor | None, grad_norm: torch.Tensor, replay: bool = True) -> bool:
        """Whether this step's update is to be skipped (a spike under policy skip; with health.replay a
        non-finite step the replay puts down to the data). Collective: every rank calls it (with no loss,
        as a test stepping by hand does, nothing is checked)."""
        if local_loss is None:
            return False
        loss = trainer.reduce_loss(local_loss.detach().clone())
        values = dict(zip(("loss", "grad_norm"), torch.stack([loss.float(), grad_norm.float()]).tolist()))  # one read
        if trainer.ft:  # each replica group's loss is its own batch's; the grad norm, synced, is every group's
            values.pop("loss")
        finite = all(math.isfinite(v) for v in values.values())
        found = self.far_above(values) if finite else [f"{n} is {v}" for n, v in values.items() if not math.isfinite(v)]
        if not found:
            return False
        worst, whose = self.whose(trainer, local_loss, by_loss=found[0].startswith("loss"))
        named = f"rank {worst} ({self.hosts[worst]}) holds the largest part {whose}"
        if not finite:
            self.metrics.log_event(trainer.step, {"health_nonfinite_rank": float(worst)},
                                   f"step {trainer.step}: not finite: {'; '.join(found)}; {named}")
        self.cause = "a spike" if finite else "a non-finite result of the data"
        if self.replay is not None and replay:
            if self.replay.classify(trainer, local_loss, grad_norm, worst) == "transient":  # the replay's values stand
                return self.skips(trainer, local_loss, grad_norm, replay=False)
            if not finite:
                return True  # the data's: skipped
        if not finite:  # training.skip_nonfinite_steps skips it or stops the run; here it is named
            return False
        self.spikes += 1
        self.in_a_row += 1
        new_level = self.in_a_row >= LEVEL_SHIFT
        if new_level:  # not a spike but where the run is now: its values join the history
            for name, value in values.items():
                self.history[name].append(value)
        skip = self.policy in ("skip", "rollback") and not new_level
        self.rollback = skip and self.policy == "rollback"
        action = ("skipped" + ("; rolling back" if self.rollback else "") if skip else f"kept ({LEVEL_SHIFT} in a row: taken for a new level)" if new_level
                  else "kept (health.spike_policy = warn, or under fault tolerance)")
        self.metrics.log_event(trainer.step, {"health_spike": 1.0, "health_spike_rank": float(worst)},
                               f"step {trainer.step}: spike: {'; '.join(found)} (window of {len(self.history['grad_norm'])} "
                               f"steps); {named}; update {action}")
        return skip

    def state(self) -> dict[str, list[float]]:
        return {name: list(values) for name, values in self.history.items()}

    def load(self, saved: dict[str, list[float]]) -> None:
        """A resumed run checks against the history the saved run had (a resume stays exact)."""
        for name, values in saved.items():
            self.history[name].clear()
            self.history[name].extend(values)

    def far_above(self, values: dict[str, float]) -> list[str]:
        """What is past its window's mean + k std; the history takes the values when none is."""
        found = []
        for name, value in values.items():
            past = self.history[name]
            if len(past) >= max(2, self.window // 2):
                mean, std = statistics.fmean(past), statistics.pstdev(past)
                if value > mean + self.sigmas * std:
                    found.append(f"{name} {value:.4g} is past {mean:.4g} + {self.sigmas:g} x {std:.4g}")
        if not found:
            self.in_a_row = 0
            for name, value in values.items():
                self.history[name].append(value)
        return found

    def whose(self, trainer, local_loss: torch.Tensor, by_loss: bool) -> tuple[int, str]:
        """The rank with the largest part of the loss (a poisoned batch), else of the gradients' squares (a
        flipped bit: each rank's own pieces; FSDP's are reduced over the batch already). One all-gather."""
        grads = [local(p.grad).float().square().sum() for p in trainer.parameters() if p.grad is not None]
        squares = torch.stack(grads).sum().to(local_loss.device) if grads else local_loss.new_zeros(())  # grads may be offloaded
        mine = torch.stack([local_loss.detach().float().reshape(()), squares])
        parts = [torch.zeros_like(mine) for _ in self.hosts]
        dist.all_gather(parts, mine)
        column = [part[0 if by_loss else 1].item() for part in parts]
        worst = max(range(len(column)), key=lambda r: column[r] if column[r] == column[r] else math.inf)  # NaN counts as largest
        return worst, "of the loss" if by_loss else "of the gradients' squares"


class Stragglers:
    def __init__(self, config, metrics, hosts: list[str]):
        h = config.health
        self.interval, self.percent, self.checks = h.straggler_interval, h.straggler_percent, h.straggler_checks
        self.metrics, self.hosts = metrics, hosts
        self.in_a_row = [0] * len(hosts)
        self.arrived = 0.0

    def due(self, step: int) -> bool:
        return self.interval > 0 and step % self.interval == 0

    def arrive(self, step: int, device: torch.device) -> None:
        """The step's start on this rank, after its own work (on a GPU, once its queued work is done)."""
        if self.due(step):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.arrived = time.time()

    def check(self, step: int, step_start: float, device: torch.device) -> None:
        """On check steps: gather every rank's arrival and step time, name a rank late too often. Collective."""
        if not self.due(step):
            return
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        mine = torch.tensor([self.arrived, time.perf_counter() - step_start], dtype=torch.float64, device=device)  # nccl: on the GPU
        every = [torch.zeros_like(mine) for _ in self.hosts]
        dist.all_gather(every, mine)
        arrivals = [float(t[0]) for t in every]
        median_arrival, median_step = statistics.median(arrivals), statistics.median(float(t[1]) for t in every)
        for rank, arrival in enumerate(arrivals):
            late = arrival - median_arrival
            self.in_a_row[rank] = self.in_a_row[rank] + 1 if late > self.percent / 100 * median_step else 0
            if self.in_a_row[rank] == self.checks:
                self.metrics.log_event(step, {"health_straggler_rank": float(rank), "health_straggler_late_s": late},
                                       f"step {step}: straggler: rank {rank} ({self.hosts[rank]}) reached the step {late:.2f} s after "
                                       f"the median rank ({100 * late / median_step:.0f}% of the median step time of "
                                       f"{median_step:.2f} s), {self.checks} checks in a row")


class ReplicaCheck:
    """Under HSDP or DDP the replicas' weights are the same bits. Every `replica_check_interval` steps
    each rank sums the bits of each of its pieces (as integers: any flip shows) and the sums are
    compared across its replica group. A rank that differs from the majority is named; with 2
    replicas there is no majority, and replica 0 is taken for the healthy one (said in the line). Then
    `heal`: every weight is sent from a healthy replica (the optimizer's state is left as it is, the
    same on all of them when only weights flipped); or `stop`: one line, exit 1."""

    def __init__(self, config, dims, metrics, hosts: list[str]):
        h = config.health
        self.interval, self.action, self.metrics, self.hosts = h.replica_check_interval, h.replica_check_action, metrics, hosts
        mesh = dims.get_mesh("dp_replicate") if dims.dp_replicate > 1 and self.interval else None
        self.group, self.ranks = (mesh.get_group(), dist.get_process_group_ranks(mesh.get_group())) if mesh else (None, [])

    def check(self, step: int, params) -> None:
        """On check steps: compare, name, heal or stop. Collective over each replica group."""
        if self.group is None or step % self.interval:
            return
        sums = torch.stack([bits_sum(local(p.detach())) for p in params])
        every = [torch.zeros_like(sums) for _ in self.ranks]
        dist.all_gather(every, sums, group=self.group)
        votes = {}
        for i, sums_of_replica in enumerate(every):
            votes.setdefault(tuple(sums_of_replica.tolist()), []).append(i)
        healthy = max(votes.values(), key=lambda members: (len(members), -members[0]))  # the majority; a tie: the lowest replica
        tie = len(votes) > 1 and sum(len(m) == len(healthy) for m in votes.values()) > 1
        me = self.ranks.index(dist.get_rank())
        # Every rank learns every group's finding (one all-gather over the world): the line and the metrics
        # come from rank 0 too. Per rank: whether it differs, the healthy rank it takes its weights from.
        mine = torch.tensor([float(me not in healthy), float(self.ranks[healthy[0]]), float(tie)], dtype=torch.float64,
                            device=sums.device)
        found = [torch.zeros_like(mine) for _ in self.hosts]
        dist.all_gather(found, mine)
        bad = [(r, int(f[1]), bool(f[2])) for r, f in enumerate(found) if f[0]]
        if not bad:
            return
        named = ", ".join(f"rank {r} ({self.hosts[r]})" for r, _, _ in bad)
        why = " (2 replicas, no majority: replica 0's taken for the healthy one)" if any(t for _, _, t in bad) else ""
        if self.action == "stop":
            raise ReplicaDiverged(f"step {step}: {named} holds weights that differ from its replicas'{why}; training stopped "
                                  "(health.replica_check_action = heal sends the healthy weights instead)")
        if len(votes) > 1:  # this replica group differs: its healthy replica sends every weight
            for p in params:
                dist.broadcast(local(p.detach()), group=self.group, group_src=healthy[0])
        sources = ", ".join(sorted({f"rank {src}" for _, src, _ in bad}))
        self.metrics.log_event(step, {"health_replica_healed_rank": float(bad[0][0])},
                               f"step {step}: {named} held weights that differ from its replicas'{why}; healed from {sources}")


class ReplicaDiverged(RuntimeError):
    """A replica's weights differ from the others' and replica_check_action = stop: one line, exit 1."""


def bits_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of a tensor's bits read as integers of its width: equal tensors give equal sums, a flip changes it."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(ints).sum(dtype=torch.int64) if t.numel() else torch.zeros((), dtype=torch.int64, device=t.device)


class HangWatchdog:
    def __init__(self, config, rank: int, hosts: list[str]):
        self.timeout, self.rank, self.hosts = config.comm.train_timeout_seconds, rank, hosts
        self.folder = Path(config.job.dump_folder) / "hang"
        self.store = dist.distributed_c10d._get_default_store()
        self.step, self.phase, self.deadline = 0, 0, None
        self.lock = threading.Lock()
        threading.Thread(target=self.watch, name="hang-watchdog", daemon=True).start()

    def at(self, step: int, phase: int, armed: bool) -> None:
        """Progress: this rank is at `step`, `PHASES[phase]`; `armed`: the step is timed from now."""
        with self.lock:
            self.step, self.phase = step, phase
            if armed:
                self.deadline = time.monotonic() + self.timeout
            elif phase == len(PHASES) - 1:
                self.deadline = None

    def watch(self) -> None:
        while True:
            time.sleep(0.5)
            with self.lock:
                fired = self.deadline is not None and time.monotonic() > self.deadline
                step, phase = self.step, self.phase
            if fired:
                self.report(step, phase)

    def report(self, step: int, phase: int) -> None:
        """Stack to disk, progress to the store, wait a little for the others', one line, exit 1 (whatever fails)."""
        try:
            self.tell(step, phase)
        finally:
            os._exit(1)

    def tell(self, step: int, phase: int) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"rank{self.rank}.txt", "w") as f:
            f.write(f"rank {self.rank} ({self.hosts[self.rank]}), step {step}, {PHASES[phase]}\n")
            faulthandler.dump_traceback(file=f, all_threads=True)
        self.store.set(f"titanlite/hang/{self.rank}", f"{step} {phase}")
        progress = {}
        give_up = time.monotonic() + 10
        while time.monotonic() < give_up and len(progress) < len(self.hosts):
            for r in range(len(self.hosts)):
                key = f"titanlite/hang/{r}"
                if r not in progress and self.store.check([key]):
                    progress[r] = tuple(int(x) for x in self.store.get(key).decode().split())
            time.sleep(0.2)
        silent = [r for r in range(len(self.hosts)) if r not in progress]
        least = min(progress.values())
        behind = [r for r, p in sorted(progress.items()) if p == least and least < max(progress.values())]
        named = ", ".join(f"rank {r} ({self.hosts[r]})" for r in behind + silent)
        where = (f"{named} did not reach what the others did (furthest behind: step {least[0]}, {PHASES[least[1]]}"
                 + (f"; {len(silent)} never answered" if silent else "") + ")") if named else \
            f"every rank was at step {least[0]}, {PHASES[least[1]]}: the hang is inside it (a collective or the device)"
        message = (f"titanlite: step {step} ran past comm.train_timeout_seconds={self.timeout}: {where}; every rank's "
                   f"stack is in {self.folder}; exiting so that the launcher restarts the run")
        if not write_error(message, 1):
            print(message, file=sys.stderr, flush=True)
        time.sleep(2 if self.rank else 5)  # rank 0 may hold the store: it leaves last
