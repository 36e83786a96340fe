"""health.spike_policy = "rollback": a spike sends the run back to its newest checkpoint taken before
the `rollback_batches` batches that led into it (the spike's own included), and those batches are
never trained on again, as PaLM did.

Exactness: the checkpoint restores the weights, optimizer, lr schedule, RNG, data position and spike
history, and a batch is skipped by drawing it and dropping it, so the run goes on bit for bit as one
told from the start to skip the same batches (`health.skip_batches`). Batches are counted globally
from 1, skipped ones included; the count and the skip set ride in each checkpoint's data position.
Checkpoints after the one rolled back to were trained on dropped batches: they are moved aside
(`step-K.rolled_back`), never loaded, and kept for a person to look at until the next rollback.
"""

from __future__ import annotations

import shutil
import time

import torch.distributed as dist

from titanlite.checkpoint.checkpointer import PARTS
from titanlite.checkpoint.paths import complete_steps
from titanlite.errors import TrainingDiverged
from titanlite.metrics import log_line


def batch_set(ranges: list[str]) -> set[int]:
    """health.skip_batches' entries ("7", "8-9") as batch numbers."""
    out = set()
    for text in ranges:
        first, _, last = text.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return out


def ranges(batches: set[int]) -> str:
    """Batch numbers as health.skip_batches writes them: 8-9,120."""
    out, ordered = [], sorted(batches)
    for i, b in enumerate(ordered):
        if i and b == ordered[i - 1] + 1:
            out[-1][1] = b
        else:
            out.append([b, b])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


class Batches:
    """The global batches drawn so far, skipped ones included, and the ones to skip."""

    def __init__(self, config):
        self.drawn, self.skip = 0, batch_set(config.health.skip_batches)
        self.rollbacks = 0  # in this process (a checkpoint does not hold it): a spike that comes back stops the run

    def next(self, trainer, data_iter):
        """This rank's microbatches of the next batch not skipped (the skipped ones drawn and dropped)."""
        while self.drawn + 1 in self.skip:
            trainer.next_microbatches(data_iter)
            self.drawn += 1
        self.drawn += 1
        return trainer.next_microbatches(data_iter)

    def drawn_by(self, step: int) -> int:
        """The batches drawn by the end of `step` (its batch is the step-th one not skipped)."""
        drawn = kept = 0
        while kept < step:
            drawn += 1
            kept += drawn not in self.skip
        return drawn

    def state(self) -> dict:
        return {"drawn": self.drawn, "skip": sorted(self.skip)}

    def load(self, saved: dict | None, step: int) -> None:
        """A checkpoint's count (one from before this was saved: a batch a step) and skips, joined to ours."""
        self.drawn = saved["drawn"] if saved else step
        self.skip |= set(saved["skip"]) if saved else set()


def roll_back(trainer, clock):
    """After a spike at this step (its update skipped): back to the newest checkpoint before the batches
    that led into it, which join the skip set. Returns the data iterator to go on with, or None when no
    checkpoint is old enough (the spike's update stays skipped, and the run goes on)."""
    batches, ckpt = trainer.batches, trainer.checkpointer
    first, last, spike_step = max(batches.drawn - trainer.config.health.rollback_batches + 1, 1), batches.drawn, trainer.step
    ckpt.wait()
    # Rank 0 chooses (it commits saves and drops old ones: another rank's listing may lag behind).
    chosen = [None]
    if ckpt.is_coordinator:
        steps = [s for s in complete_steps(ckpt.folder) if batches.drawn_by(s) < first
                 and "train_state" in ckpt.parts_of(ckpt.folder / f"step-{s}")]  # not a model-only seed
        chosen = [steps[-1] if steps else None]
    dist.broadcast_object_list(chosen, src=0)
    target = chosen[0]
    if target is None:
        log_line(f"step {spike_step}: rollback: no checkpoint before batch {first} (keep more with "
                 "checkpoint.keep_latest_k, or save more often): the spike's update is skipped only")
        return None
    clock.record(spike_step)  # the attempt up to the spike: its steps after the checkpoint are lost
    batches.rollbacks += 1
    limit = trainer.config.health.max_rollbacks
    if batches.rollbacks > limit:
        raise TrainingDiverged(f"step {spike_step}: a spike after {limit} rollbacks (health.max_rollbacks): skipping data "
                               "does not cure it; training stopped. Lower optimizer.lr, or look at the model or the hardware")
    began = time.perf_counter()
    if ckpt.is_coordinator:
        for old in ckpt.folder.glob("step-*.rolled_back"):
            shutil.rmtree(old)  # the last rollback's are kept, no more: a run that rolls back often would fill the disk
        for step in reversed(complete_steps(ckpt.folder)):  # newest first: a crash midway leaves none of them loadable
            if step > target:
                path = ckpt.folder / f"step-{step}"
                path.rename(path.with_name(f"{path.name}.rolled_back"))
    dist.barrier()
    dropped = set(range(first, last + 1))
    batches.skip |= dropped
    ckpt.load_from(ckpt.folder / f"step-{target}", set(PARTS))
    trainer.spikes.in_a_row = 0
    clock.restart(trainer.step, time.perf_counter() - began)
    began = time.perf_counter()
    ckpt.save(target)  # the same state with the new skip set: a crash from here resumes skipping them too
    clock.add("save_s", time.perf_counter() - began)
    trainer.metrics.reset()
    log_line(f"step {spike_step}: rolled back to checkpoint step-{target}; batches {ranges(dropped)} skipped from now "
             f"on (to repeat this run from the start: --health.skip_batches {ranges(batches.skip)})")
    return iter(trainer.dataloader)
