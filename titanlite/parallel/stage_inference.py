"""Whether a pipeline stage is inferring its shapes now.

At the first step (and the first training step after each validation) torch's PipelineStage runs a
forward to learn its outputs' shapes, after the first stage on activations nothing wrote, and torch
2.13 computes the loss of the last stage's outputs and runs a backward after it. Two things must
keep nothing of those passes: the trainer's MTP loss sum, and activation checkpointing's record of
a forward's exchanges (these passes exchange for themselves, and no recompute will read them).
"""

from __future__ import annotations

from contextlib import contextmanager


class MetadataInference:
    running = False

    @classmethod
    @contextmanager
    def of_a_stage(cls):
        before, cls.running = cls.running, True
        try:
            yield
        finally:
            cls.running = before
