"""Model converters (`model.converters`): swap modules before any parallelism is applied.

A converter changes the model in `convert` (given the family's plan), may prepare it for FSDP (`before_fsdp`), may refresh
state before each step (`before_step`), and describes itself in one log line. trainer.py, train.py
and parallelize.py use this interface only; `float8` is the one converter today.
"""

from __future__ import annotations

import torch
from torch import nn

from titanlite.config import FLOAT8_CONVERTERS, JobConfig, float8_recipe
from titanlite.float8 import Float8Linear, convert_to_float8, enable_float8_all_gather, precompute_float8_scales


class Float8Converter:
    """[quantize.linear.float8]: eligible nn.Linear -> Float8Linear, optional float8 FSDP all-gather."""

    def __init__(self, config: JobConfig):
        self.settings = config.float8
        self.recipe = float8_recipe(self.settings)
        self.chunked_loss = config.training.loss_chunks > 1

    def convert(self, model: nn.Module, plan) -> None:
        """filter_fqns, and what the family keeps in high precision (a MoE's router)."""
        convert_to_float8(model, self.recipe, self.filter_fqns(plan), self.settings.emulate)

    def filter_fqns(self, plan) -> list[str]:
        # The chunked loss runs the output projection's matmuls itself, in high precision.
        return [*self.settings.filter_fqns, *plan.float8_excluded, *(["output"] if self.chunked_loss else [])]

    def before_fsdp(self, model: nn.Module) -> None:
        if self.settings.enable_fsdp_float8_all_gather:
            enable_float8_all_gather(model)

    def before_step(self, parts: list[nn.Module]) -> None:
        """One all-reduce for every float8 all-gather weight's scale, before the weights are gathered."""
        f8 = self.settings
        if f8.enable_fsdp_float8_all_gather and f8.precompute_float8_dynamic_scale_for_fsdp:
            for part in parts:
                precompute_float8_scales(part)

    def describe(self, parts: list[nn.Module], device: torch.device) -> str:
        n = sum(isinstance(m, Float8Linear) for part in parts for m in part.modules())
        how = "emulated in high precision" if self.settings.emulate else "torch._scaled_mm"
        slow_on_cpu = device.type == "cpu" and not self.settings.emulate and self.recipe == "tensorwise"
        return (
            f"float8 {self.recipe}: {n} linear layers ({how}); MFU counts their FLOPs against the high-precision "
            "(bf16) peak above, not a float8 peak"
            + ("; tensorwise float8 matmuls run a very slow reference kernel on CPU: set "
               "quantize.linear.float8.emulate=true" if slow_on_cpu else "")
        )


CONVERTERS = dict.fromkeys(FLOAT8_CONVERTERS, Float8Converter)


def build_converters(config: JobConfig) -> list:
    return [CONVERTERS[name](config) for name in config.model.converters]
