"""Whether a pipeline stage is inferring its shapes now.

At the first step, and at each switch between training and validation, torch's PipelineStage runs a
forward to learn its outputs' shapes, after the first stage on activations nothing wrote; in training
torch 2.13 then computes the loss of the last stage's outputs and runs a backward. Two things must
keep nothing of those passes: the trainer's MTP loss sum, and activation checkpointing's record of
a forward's exchanges (these passes exchange for themselves, and no recompute will read them).
"""

from __future__ import annotations

from contextlib import contextmanager


class MetadataInference:
    """`running` while a stage infers its shapes: `of_a_stage()` around torch's inference methods
    (parallel/pipeline.py)."""

    running = False

    @classmethod
    @contextmanager
    def of_a_stage(cls):
        before, cls.running = cls.running, True
        try:
            yield
        finally:
            cls.running = before
