"""A fire drill ([fault_injection]): one fault, at one step, on one rank, in the first attempt of a
job (a restarted attempt runs clean, so a drill of a hang shows the restart resuming):

  nan_batch      the logits of the rank's batch of that step become NaN (as a poisoned batch would make
                 them), on whichever rank computes that batch (health.replay recomputes it elsewhere)
  spike_batch    ... are multiplied by spike_factor: a loss and grad-norm spike that the data causes
  spike_rank     the rank's logits of that step, whatever batch it computes, are multiplied by
                 spike_factor: a fault of its device that repeats (health.replay names it persistent)
  bitflip_grad   one bit of one gradient element flips, after backward, before the grad norm
  bitflip_param  one bit of one weight element flips, after the optimizer step
  slow           the rank is held `seconds` at the start of each of `steps` steps: a straggler
  hang           the rank stops at the step's start and never goes on

Flips strike the largest element of the first parameter (its gradient) this rank holds a nonzero
piece of: bit `bit` of its float32.
"""

from __future__ import annotations

import time

import torch

from titanlite.dtensors import local
from titanlite.metrics import log_line
from titanlite.torchrun import attempt


BATCH_KINDS = ("nan_batch", "spike_batch")


class FaultInjector:
    def __init__(self, config, rank: int):
        f = config.fault_injection
        first_attempt = attempt() == 0
        # A poisoned batch is the batch's, not the rank's: every rank arms it, for when it computes that batch.
        self.kind = f.kind if first_attempt and (rank == f.rank or f.kind in BATCH_KINDS) else ""
        self.settings, self.hooks, self.rank = f, [], rank
        self.origin = rank  # the rank whose batch this rank computes (a replay on suspicion recomputes another's)

    def strikes(self, step: int, kind: str) -> bool:
        f = self.settings
        if self.kind != kind:
            return False
        if kind == "slow":
            return f.step <= step < f.step + f.steps
        if step == f.step:
            self.kind = ""  # once: a run rolled back past the step comes to it again clean (its batch is skipped)
            return True
        return False

    def before_step(self, step: int, model_parts) -> None:
        """At the step's start: hold or stop the rank, or poison the logits of its batch."""
        if self.strikes(step, "slow"):
            time.sleep(self.settings.seconds)
        if self.strikes(step, "hang"):
            log_line(f"fault injection: rank hangs at step {step}")
            while True:
                time.sleep(3600)
        f = self.settings
        for kind, factor in (("nan_batch", float("nan")), ("spike_batch", f.spike_factor), ("spike_rank", f.spike_factor)):
            if self.strikes(step, kind):
                if self.rank == f.rank:
                    log_line(f"fault injection: {kind} at step {step}")
                struck = lambda k=kind: k == "spike_rank" or self.origin == f.rank
                # The last stage's output is the logits (other stages pass hidden states on: scaled too)
                self.hooks = [part.register_forward_hook(lambda m, i, out, k=factor, on=struck: scaled(out, k) if on() else out)
                              for part in model_parts]

    def after_backward(self, step: int, params) -> None:
        if self.strikes(step, "bitflip_grad"):
            flip(step, "gradient", [p.grad for p in params if p.grad is not None], self.settings.bit)

    def after_step(self, step: int, params) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        if self.strikes(step, "bitflip_param"):
            flip(step, "weight", [p.detach() for p in params], self.settings.bit)


def scaled(out, factor: float):
    """A module's output times `factor`: the tensor, or the first of a tuple (the logits or the loss)."""
    return out * factor if isinstance(out, torch.Tensor) else (out[0] * factor, *out[1:])


def flip(step: int, what: str, tensors, bit: int) -> None:
    """One bit of the largest element of the first float32 tensor this rank holds a nonzero piece of."""
    for t in map(local, tensors):
        flat = t.view(-1)
        if t.dtype == torch.float32 and flat.numel() and bool(flat.any()):
            i = int(flat.abs().argmax())
            before = flat[i].item()
            flat[i:i + 1].view(torch.int32).bitwise_xor_((1 << bit) if bit < 31 else -(1 << 31))  # bit 31 (the sign) as an int32
            log_line(f"fault injection: step {step}: bit {bit} of a {what} flipped, {before:.4g} -> {flat[i].item():.4g}")
            return
