"""Model converters (`model.converters`): swap modules before any parallelism is applied.

A converter changes the model in `convert` (given the family's plan), may prepare it for FSDP (`before_fsdp`), may refresh
state before each step (`before_step`), and describes itself in one log line. trainer.py, train.py
and parallelize.py use this interface only. Two converters: `quantize.linear.float8` (alias `float8`)
and `quantize.grouped_mm.float8` (the MoE layers' routed experts).
"""

from __future__ import annotations

import torch
from torch import nn

from titanlite.config import FLOAT8_CONVERTERS, JobConfig, float8_recipe
from titanlite.errors import ConfigError
from titanlite.float8 import Float8Linear, convert_to_float8, enable_float8_all_gather, precompute_float8_scales
from titanlite.float8_grouped import Float8GroupedExperts, convert_experts_to_float8


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


class Float8GroupedConverter:
    """[quantize.grouped_mm.float8]: the routed experts of the MoE layers named in `fqns` run their
    grouped GEMMs in float8 (rowwise e4m3; titanlite/float8_grouped.py)."""

    def __init__(self, config: JobConfig):
        self.fqns = config.quantize.grouped_mm.float8.fqns

    def convert(self, model: nn.Module, plan) -> None:
        if not convert_experts_to_float8(model, self.fqns) and plan.moe_layers(model):
            raise ConfigError(
                f"quantize.grouped_mm.float8.fqns={self.fqns} names no MoE layer's experts; use the module name, e.g. "
                "--quantize.grouped_mm.float8.fqns experts"
            )

    def before_fsdp(self, model: nn.Module) -> None:
        pass

    def before_step(self, parts: list[nn.Module]) -> None:
        pass

    def describe(self, parts: list[nn.Module], device: torch.device) -> str:
        n = sum(isinstance(m, Float8GroupedExperts) for part in parts for m in part.modules())
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (9, 0):
            capability = "".join(map(str, torch.cuda.get_device_capability(device)))
            raise ConfigError(
                f"model.converters has 'quantize.grouped_mm.float8': float8 grouped GEMMs need SM90 or later (this GPU: "
                f"sm_{capability}); remove it from model.converters"
            )
        how = "torch._scaled_grouped_mm" if device.type == "cuda" else f"emulated in fp32 on {device.type}"
        return f"float8 grouped GEMMs (rowwise): the routed experts of {n} MoE layers ({how})"


CONVERTERS = {**dict.fromkeys(FLOAT8_CONVERTERS, Float8Converter), "quantize.grouped_mm.float8": Float8GroupedConverter}


def build_converters(config: JobConfig) -> list:
    return [CONVERTERS[name](config) for name in config.model.converters]
