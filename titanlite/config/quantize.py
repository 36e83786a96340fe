"""The `[quantize]` sections of the JobConfig (TorchTitan v0.2.2): float8 and MX, for linear layers
and for MoE grouped GEMMs, nested as `[quantize.linear.float8]` and `[quantize.grouped_mm.float8]`."""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.config.fields import NO_MX, opt, section

FLOAT8_CONVERTERS = ("quantize.linear.float8", "float8")


@dataclass
class Float8Linear:
    enable_fsdp_float8_all_gather: bool = opt(False, "FSDP all-gathers weights in float8 (tensorwise recipe)")
    precompute_float8_dynamic_scale_for_fsdp: bool = opt(
        False, "with float8 all-gather: all weights' scales from one all-reduce per step"
    )
    recipe_name: str | None = opt(
        None, "scaling recipe; none = tensorwise", choices=("tensorwise", "rowwise", "rowwise_with_gw_hp", None)
    )
    filter_fqns: list[str] = opt([], "linear layers to keep in high precision (name substrings), e.g. output")
    emulate: bool = opt(False, "multiply dequantized float8 values in high precision (no float8 matmul hardware)")


@dataclass
class Float8GroupedMM:
    fqns: list[str] = opt([], "MoE modules (name substrings, e.g. experts) whose routed experts run float8 grouped GEMMs")


@dataclass
class MXLinear:
    mxfp8_dim1_cast_kernel_choice: str = opt("triton", "MX cast kernel", not_implemented=NO_MX)
    recipe_name: str = opt("mxfp8_cublas", "MX recipe", not_implemented=NO_MX)
    filter_fqns: list[str] = opt(["output"], "linear layers kept in high precision", not_implemented=NO_MX)


@dataclass
class MXGroupedMM:
    recipe_name: str = opt("mxfp8", "MX recipe of grouped GEMMs", not_implemented=NO_MX)
    fqns: list[str] = opt([], "MoE layers whose grouped GEMMs run in MX", not_implemented=NO_MX)


@dataclass
class QuantizedLinear:
    float8: Float8Linear = section(Float8Linear)
    mx: MXLinear = section(MXLinear)


@dataclass
class QuantizedGroupedMM:
    float8: Float8GroupedMM = section(Float8GroupedMM)
    mx: MXGroupedMM = section(MXGroupedMM)


@dataclass
class Quantize:
    linear: QuantizedLinear = section(QuantizedLinear)
    grouped_mm: QuantizedGroupedMM = section(QuantizedGroupedMM)


def float8_recipe(f8: Float8Linear) -> str:
    return f8.recipe_name or "tensorwise"
