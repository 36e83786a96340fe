"""Float8 grouped GEMMs for the routed experts ([quantize.grouped_mm.float8]: rowwise, e4m3).

Each GEMM of the experts' SwiGLU, `x (tokens, K) @ w[e] (K, N)` over the tokens of expert e, casts
both operands to float8 e4m3 with power-of-two scales taken along the contracted dim, as the
rowwise float8 linear does (titanlite/float8.py):

  forward       out = x @ w      x per token row;                w per (expert, output column)
  input grad    gx  = g @ w^T    g per token row;                w per (expert, input column)
  weight grad   gw  = x^T @ g    contracted over an expert's own tokens: x per (expert, input column),
                                 g per (expert, output column), amaxes over that expert's tokens

On GPUs (SM90+) `torch._scaled_grouped_mm` multiplies the float8 values; elsewhere the same float8
values are dequantized and multiplied in fp32 (emulated: the same rounding, another accumulation).
CUDA's float8 grouped GEMM wants each group's rows in multiples of 16 (16 bytes of e4m3), so the
tokens are laid out with each expert's group padded by zero rows, without reading the counts on the
host: the buffer has room for the worst case (tokens + experts * 15 rows, rounded up to 16), and the
last expert's group takes the rows left over (zeros in, zeros out: no row is left undefined).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from titanlite.float8 import E4M3, dequantize, quantize, scale_from_amax, to_float8
from titanlite.models.common.moe import GroupedExperts, any_dtype_grouped_mm

GROUP_ALIGN = 16


def padded_layout(counts: torch.Tensor, rows: int, align: int = GROUP_ALIGN):
    """For `rows` tokens grouped by expert (`counts` each): (each token's row in the padded buffer,
    the padded groups' ends (int32), the expert of each block of `align` rows, the buffer's rows)."""
    experts, device = counts.numel(), counts.device
    capacity = -(-(rows + experts * (align - 1)) // align) * align
    padded = (counts + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    ends[-1] = capacity  # the last group takes the spare rows
    expert_of_token = torch.repeat_interleave(torch.arange(experts, device=device), counts, output_size=rows)
    within_group = torch.arange(rows, device=device) - (torch.cumsum(counts, 0) - counts)[expert_of_token]
    position = starts[expert_of_token] + within_group
    expert_of_block = torch.bucketize(torch.arange(0, capacity, align, device=device), ends, right=True)
    return position, ends.to(torch.int32), expert_of_block, capacity


class _PlaceRows(torch.autograd.Function):
    """rows of `x` written to `position` of a zero buffer of `capacity` rows; backward reads them back
    (each row written once: no accumulation, deterministic on every device)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, position: torch.Tensor, capacity: int) -> torch.Tensor:
        ctx.save_for_backward(position)
        return x.new_zeros(capacity, x.shape[1]).index_copy_(0, position, x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (position,) = ctx.saved_tensors
        return grad.index_select(0, position), None, None


class _TakeRows(torch.autograd.Function):
    """The inverse of _PlaceRows: the rows at `position`; backward places the gradient back."""

    @staticmethod
    def forward(ctx, buffer: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(position)
        ctx.capacity = buffer.shape[0]
        return buffer.index_select(0, position)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (position,) = ctx.saved_tensors
        return grad.new_zeros(ctx.capacity, grad.shape[1]).index_copy_(0, position, grad), None


def column_major(t: torch.Tensor) -> torch.Tensor:
    """The same values laid out column-major in the last two dims (what the kernel takes as b)."""
    return t if t.stride(-2) == 1 else t.transpose(-2, -1).contiguous().transpose(-2, -1)


def quantize_by_expert(t: torch.Tensor, expert_of_block: torch.Tensor, experts: int):
    """Float8 e4m3 of `t` (rows, C) with one power-of-two scale per (expert, column): the amax over
    that expert's rows, taken per block of GROUP_ALIGN rows first (a block lies in one expert's
    group). Returns (data, scales (experts, C))."""
    blocks = t.view(-1, GROUP_ALIGN, t.shape[1])
    block_amax = blocks.abs().amax(1).float()
    index = expert_of_block.unsqueeze(1).expand(-1, t.shape[1])
    amax = block_amax.new_zeros(experts, t.shape[1]).scatter_reduce_(0, index, block_amax, "amax")
    scale = scale_from_amax(amax, E4M3, power_of_2=True)
    return to_float8(blocks, scale[expert_of_block].unsqueeze(1), E4M3).view_as(t), scale


def rowwise(t: torch.Tensor, dim: int):
    return quantize(t, E4M3, dim, power_of_2=True)


@functools.cache
def fused_casts():
    """(rowwise, quantize_by_expert), each compiled to one kernel for CUDA (eager, a cast is six
    kernels); dynamic: the rows vary from step to step under expert parallel. Built at first use:
    importing the compiler costs every process a second and a half."""
    return torch.compile(rowwise, dynamic=True), torch.compile(quantize_by_expert, dynamic=True)


def scaled_grouped_mm(a8, a_scale, b8, b_scale, ends, out_dtype: torch.dtype, emulate: bool) -> torch.Tensor:
    """(a / a_scale) @ (b[e] / b_scale[e]) per group of a's rows: a (rows, K) with scales (rows, 1),
    b (experts, K, N) with scales (experts, 1, N)."""
    if emulate:
        a, b = dequantize(a8, a_scale, torch.float32), dequantize(b8, b_scale, torch.float32)
        return any_dtype_grouped_mm(a, b, ends).to(out_dtype)
    return torch._scaled_grouped_mm(
        a8.contiguous(), column_major(b8), a_scale.reciprocal().flatten(), b_scale.reciprocal().flatten(1), offs=ends,
        out_dtype=out_dtype,
    )


def scaled_grouped_mm_over_rows(a8, a_scale, b8, b_scale, expert_of_block, ends, out_dtype, emulate) -> torch.Tensor:
    """Per expert e, (a_e / a_scale[e])^T @ (b_e / b_scale[e]) over its rows: a (rows, K), b (rows, N),
    scales (experts, K) and (experts, N). Returns (experts, K, N)."""
    if emulate:
        expert_of_row = expert_of_block.repeat_interleave(GROUP_ALIGN)
        a = dequantize(a8, a_scale[expert_of_row], torch.float32)
        b = dequantize(b8, b_scale[expert_of_row], torch.float32)
        return any_dtype_grouped_mm(a, b, ends).to(out_dtype)
    return torch._scaled_grouped_mm(
        a8.t().contiguous(), column_major(b8), a_scale.reciprocal().flatten(), b_scale.reciprocal().flatten(), offs=ends,
        out_dtype=out_dtype,
    )


class _Float8GroupedMM(torch.autograd.Function):
    """x (rows, K) @ w[e] (K, N) for each expert's rows (groups ending at `ends`), in float8."""

    @staticmethod
    def forward(ctx, x, w, ends, expert_of_block, emulate: bool):
        ctx.save_for_backward(x, w, ends, expert_of_block)
        ctx.emulate = emulate
        cast = rowwise if emulate else fused_casts()[0]
        x8, x_scale = cast(x, -1)
        w8, w_scale = cast(w, -2)
        return scaled_grouped_mm(x8, x_scale, w8, w_scale, ends, x.dtype, emulate)

    @staticmethod
    def backward(ctx, grad):
        x, w, ends, expert_of_block = ctx.saved_tensors
        emulate = ctx.emulate
        cast, cast_by_expert = (rowwise, quantize_by_expert) if emulate else fused_casts()
        grad = grad.contiguous()
        g8, g_scale = cast(grad, -1)
        wt8, wt_scale = cast(w.transpose(-2, -1), -2)
        grad_x = scaled_grouped_mm(g8, g_scale, wt8, wt_scale, ends, grad.dtype, emulate)
        x8, x_scale = cast_by_expert(x, expert_of_block, w.shape[0])
        g8, g_scale = cast_by_expert(grad, expert_of_block, w.shape[0])
        grad_w = scaled_grouped_mm_over_rows(x8, x_scale, g8, g_scale, expert_of_block, ends, grad.dtype, emulate)
        return grad_x, grad_w.to(w.dtype), None, None, None


def float8_grouped_swiglu(x, counts, w1, w2, w3, emulate: bool) -> torch.Tensor:
    """The experts' SwiGLU (weights (experts, in, out)) on tokens grouped by expert, every GEMM in float8."""
    position, ends, expert_of_block, capacity = padded_layout(counts, x.shape[0])
    padded = _PlaceRows.apply(x, position, capacity)

    def mm(a, w):
        return _Float8GroupedMM.apply(a, w, ends, expert_of_block, emulate)

    hidden = F.silu(mm(padded, w1)) * mm(padded, w3)
    return _TakeRows.apply(mm(hidden, w2), position)


class Float8GroupedExperts(GroupedExperts):
    """GroupedExperts whose GEMMs run in float8 (the converter swaps the class; the weights stay in
    high precision). CUDA's kernel takes bf16 operands and gives bf16 out, so there the tokens run in
    bf16; elsewhere the float8 GEMMs are emulated in fp32 and the activations keep their dtype."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor, meanwhile=None) -> torch.Tensor:
        emulate = x.device.type != "cuda"
        dtype = (self.compute_dtype or x.dtype) if emulate else torch.bfloat16
        w1, w2, w3 = self.weights(dtype)
        return float8_grouped_swiglu(x.to(dtype), counts, w1, w2, w3, emulate).to(x.dtype)


def convert_experts_to_float8(model: torch.nn.Module, fqns: list[str]) -> list[str]:
    """Every GroupedExperts whose name contains one of `fqns` becomes Float8GroupedExperts (in place,
    works on meta); returns their names."""
    converted = []
    for name, module in model.named_modules():
        if type(module) is GroupedExperts and any(part in name for part in fqns):
            module.__class__ = Float8GroupedExperts
            converted.append(name)
    return converted
