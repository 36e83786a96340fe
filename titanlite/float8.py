"""Float8 training of linear layers, in three recipes:

  tensorwise          one scale per tensor; e4m3 forward, e5m2 gradients
  rowwise             one scale per row of each matmul operand (along the contracted dim), all e4m3,
                      scales rounded down to powers of two (exact rescaling)
  rowwise_with_gw_hp  rowwise, e5m2 gradients, and the weight gradient in high precision

A matmul `a @ b` casts both operands to float8 with dynamic scales (amax -> dtype max) and runs
`torch._scaled_mm`, which multiplies the float8 values and applies the inverse scales; `emulate`
multiplies the dequantized values in high precision instead (for machines without float8 matmuls:
the same rounding of the operands, a different accumulation). Weights stay in high precision for
the optimizer; only the matmul operands are float8.

Distributed pieces:
- FSDP2 float8 all-gather (tensorwise): a weight is a `Float8AllGatherWeight` whose
  `fsdp_pre_all_gather` casts its shard to float8 with the scale of the whole weight, so the
  all-gather moves 1 byte per element; the gathered weight arrives as `Float8Weight` (data + scale)
  and the forward uses it as is. The bytes travel as uint8, which every backend can gather (gloo
  cannot gather float8 dtypes). `precompute_float8_scales` computes every weight's scale with one
  all-reduce after the optimizer step instead of one per weight.
- Tensor parallel: the linears work on DTensors as they are, so scales come from global amaxes and
  match one process. With sequence parallel, `Float8PrepareModuleInput` gathers the activation
  shards in float8 (1 byte per element, scale from the global amax, or per row), then dequantizes;
  the linears re-cast the gathered values exactly, since they already lie on that float8 grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle
from torch.utils._pytree import tree_map

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
AMAX_FLOOR = 1e-12  # an all-zero tensor gets a finite scale


@dataclass(frozen=True)
class Recipe:
    rowwise: bool
    grad_dtype: torch.dtype
    grad_weight_in_high_precision: bool


RECIPES = {
    "tensorwise": Recipe(rowwise=False, grad_dtype=E5M2, grad_weight_in_high_precision=False),
    "rowwise": Recipe(rowwise=True, grad_dtype=E4M3, grad_weight_in_high_precision=False),
    "rowwise_with_gw_hp": Recipe(rowwise=True, grad_dtype=E5M2, grad_weight_in_high_precision=True),
}


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, power_of_2: bool) -> torch.Tensor:
    scale = torch.finfo(dtype).max / amax.float().clamp(min=AMAX_FLOOR)
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_2 else scale


def to_float8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    limit = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-limit, limit).to(dtype)


def quantize(x: torch.Tensor, dtype: torch.dtype, dim: int | None, power_of_2: bool = False):
    """(float8 data, scale) with dequantized value = data / scale; one scale per tensor when `dim`
    is None, else one per slice along `dim` (the amax is taken over `dim`, keepdim)."""
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    scale = scale_from_amax(amax, dtype, power_of_2)
    return to_float8(x, scale, dtype), scale


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (data.float() / scale).to(dtype)


def global_tensorwise_scale(local: torch.Tensor, group) -> torch.Tensor:
    """The e4m3 scale of a tensor sharded over `group`: from the amax of all its shards."""
    amax = local.abs().amax().float()
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return scale_from_amax(amax, E4M3, power_of_2=False)


def with_local(like: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor laid out like `like` whose local shard is `local` (no communication)."""
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride())


def float8_mm(a, a_scale, b, b_scale, out_dtype: torch.dtype, emulate: bool) -> torch.Tensor:
    """(a / a_scale) @ (b / b_scale) for float8 a (M, K) and b (K, N)."""
    if emulate:
        return (dequantize(a, a_scale, torch.float32) @ dequantize(b, b_scale, torch.float32)).to(out_dtype)
    # _scaled_mm wants b column-major and fp32 inverse scales shaped like its operands' rows/cols.
    return torch._scaled_mm(
        a.contiguous(), b.t().contiguous().t(), scale_a=a_scale.reciprocal(), scale_b=b_scale.reciprocal(),
        out_dtype=out_dtype,
    )


def scaled_matmul(a: torch.Tensor, b: torch.Tensor, a_dtype, b_dtype, recipe: Recipe, emulate: bool) -> torch.Tensor:
    """a (M, K) @ b (K, N) through float8; rowwise scales run along K: per row of a, per column of b."""
    a8, a_scale = quantize(a, a_dtype, -1 if recipe.rowwise else None, recipe.rowwise)
    b8, b_scale = quantize(b, b_dtype, 0 if recipe.rowwise else None, recipe.rowwise)
    return float8_mm(a8, a_scale, b8, b_scale, a.dtype, emulate)


class Float8Weight(torch.Tensor):
    """A weight already cast to float8 (data, tensorwise scale): what the FSDP float8 all-gather
    produces. Only the float8 linear reads it; FSDP needs detach/as_strided/view of it."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=dtype, device=data.device, requires_grad=False)

    def __init__(self, data, scale, dtype):
        self._data, self._scale = data, scale

    def __repr__(self):
        return f"Float8Weight(shape={tuple(self.shape)}, scale={self._scale})"

    def __tensor_flatten__(self):
        return ["_data", "_scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return Float8Weight(inner["_data"], inner["_scale"], dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        whole = func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default) or (
            func in (torch.ops.aten.as_strided.default, torch.ops.aten.view.default) and tuple(args[1]) == tuple(args[0].shape)
        )
        if whole:
            return Float8Weight(args[0]._data, args[0]._scale, args[0].dtype)
        raise NotImplementedError(f"{func} is not supported on a float8 weight (it is only read by Float8Linear)")


class _Float8Linear(torch.autograd.Function):
    """y = x @ w.T with float8 operands in forward and backward; gradients in high precision."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, recipe: Recipe, emulate: bool):
        ctx.recipe, ctx.emulate = recipe, emulate
        ctx.save_for_backward(x, weight)
        x2 = x.reshape(-1, x.shape[-1])
        if isinstance(weight, Float8Weight):  # cast once, before the FSDP all-gather
            x8, x_scale = quantize(x2, E4M3, None)
            out = float8_mm(x8, x_scale, weight._data.t(), weight._scale, x.dtype, emulate)
        else:
            out = scaled_matmul(x2, weight.t(), E4M3, E4M3, recipe, emulate)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        recipe, emulate = ctx.recipe, ctx.emulate
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        if isinstance(weight, Float8Weight):
            g8, g_scale = quantize(g2, recipe.grad_dtype, None)
            grad_x = float8_mm(g8, g_scale, weight._data, weight._scale, grad_out.dtype, emulate)
        else:
            grad_x = scaled_matmul(g2, weight, recipe.grad_dtype, E4M3, recipe, emulate)
        if recipe.grad_weight_in_high_precision:
            grad_w = g2.t() @ x2
        else:
            grad_w = scaled_matmul(g2.t(), x2, recipe.grad_dtype, E4M3, recipe, emulate)
        return grad_x.reshape(x.shape), grad_w.to(weight.dtype), None, None


class _DequantizeTPShard(torch.autograd.Function):
    """FSDP x TP: a float8-gathered TP shard becomes a high-precision DTensor again. Its values lie
    on the float8 grid of the same global scale, so the matmul re-casts them exactly."""

    @staticmethod
    def forward(ctx, weight: DTensor):
        local = weight._local_tensor
        return with_local(weight, dequantize(local._data, local._scale, local.dtype))

    @staticmethod
    def backward(ctx, grad: DTensor):
        return grad


class Float8Linear(nn.Linear):
    """nn.Linear whose matmuls run in float8; a bias (gpt-oss's) is added in high precision."""

    recipe: Recipe = RECIPES["tensorwise"]
    emulate: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if isinstance(weight, DTensor) and isinstance(weight._local_tensor, Float8Weight):
            weight = _DequantizeTPShard.apply(weight)
        out = _Float8Linear.apply(x, weight, self.recipe, self.emulate)
        return out if self.bias is None else out + self.bias


def float8_eligible(fqn: str, module: nn.Module, filter_fqns: list[str]) -> bool:
    """Linears with both dims divisible by 16 (float8 matmul kernels need it), not filtered."""
    return (
        type(module) is nn.Linear
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
        and not any(part in fqn for part in filter_fqns)
    )


def convert_to_float8(model: nn.Module, recipe_name: str, filter_fqns: list[str], emulate: bool) -> list[str]:
    """Turn the eligible nn.Linear modules into Float8Linear in place (works on meta); returns their names."""
    converted = []
    for fqn, module in model.named_modules():
        if float8_eligible(fqn, module, filter_fqns):
            module.__class__ = Float8Linear
            module.recipe, module.emulate = RECIPES[recipe_name], emulate
            converted.append(fqn)
    return converted


# Ops whose outputs stay Float8AllGatherWeight: those FSDP and init use to shard, move and fill a
# parameter. Everything else (optimizer math, norms) gets the plain tensor inside.
_aten = torch.ops.aten
KEEP_WRAPPED = {
    _aten.view.default, _aten.as_strided.default, _aten._to_copy.default, _aten.split.Tensor,
    _aten.split_with_sizes.default, _aten.chunk.default, _aten.clone.default, _aten.t.default,
    _aten.empty_like.default, _aten.new_zeros.default, _aten.new_empty.default, _aten.slice.Tensor,
    _aten.narrow.default, _aten.copy_.default, _aten.detach.default, _aten.alias.default,
    _aten._pin_memory.default,
}


class Float8AllGatherWeight(torch.Tensor):
    """A high-precision weight whose FSDP2 all-gather runs in float8 (tensorwise recipe)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            device=data.device, requires_grad=data.requires_grad,
        )

    def __init__(self, data: torch.Tensor):
        self._data = data
        self.precomputed_scale: torch.Tensor | None = None

    def __repr__(self):
        return f"Float8AllGatherWeight({self._data})"

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Float8AllGatherWeight(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t._data if isinstance(t, Float8AllGatherWeight) else t  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if func not in KEEP_WRAPPED:
            return out
        return tree_map(lambda t: Float8AllGatherWeight(t) if isinstance(t, torch.Tensor) else t, out)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        scale = self.precomputed_scale
        if scale is None:
            scale = global_tensorwise_scale(self._data, mesh.get_group())
        return (to_float8(self._data, scale, E4M3).view(torch.uint8),), (scale,)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (data,), (scale,) = all_gather_outputs, metadata
        if out is not None:  # FSDP reuses last step's unsharded weight: same buffer, new scale
            (out._local_tensor if isinstance(out, DTensor) else out)._scale = scale
            return
        return Float8Weight(data.view(E4M3), scale, param_dtype), (data,)


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """The high-precision values of a float8 all-gather weight (sharing storage): checkpoints hold
    plain tensors, loadable without float8."""
    if isinstance(t, DTensor) and isinstance(t._local_tensor, Float8AllGatherWeight):
        return with_local(t, t._local_tensor._data)
    return t._data if isinstance(t, Float8AllGatherWeight) else t


def enable_float8_all_gather(model: nn.Module) -> None:
    """Make every Float8Linear weight gather in float8 under FSDP2 (call before fully_shard)."""
    for module in model.modules():
        if isinstance(module, Float8Linear):
            w = module.weight
            if isinstance(w, DTensor):  # tensor parallel: the local shard gathers in float8
                wrapped = with_local(w, Float8AllGatherWeight(w.to_local()))
            else:
                wrapped = Float8AllGatherWeight(w.data)
            module.weight = nn.Parameter(wrapped, requires_grad=w.requires_grad)


@torch.no_grad()
def precompute_float8_scales(model: nn.Module) -> None:
    """Every float8 all-gather weight's scale from one all-reduce (amax over all its shards)."""
    weights = [m.weight for m in model.modules() if isinstance(m, Float8Linear) and isinstance(m.weight, DTensor)]
    weights = [w for w in weights if isinstance(w._local_tensor, Float8AllGatherWeight)]
    if not weights:
        return
    local_amax = torch.stack([w._local_tensor._data.abs().amax().float() for w in weights])
    mesh = weights[0].device_mesh
    amax = DTensor.from_local(local_amax, mesh, [Partial("max")] * mesh.ndim, run_check=False).full_tensor()
    for w, scale in zip(weights, scale_from_amax(amax, E4M3, power_of_2=False)):
        w._local_tensor.precomputed_scale = scale


def _all_gather_dim1(local: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's (B, S_local, ...) tensor along dim 1."""
    first = local.transpose(0, 1).contiguous()
    out = first.new_empty((first.shape[0] * dist.get_world_size(group), *first.shape[1:]))
    dist.all_gather_into_tensor(out, first, group=group)
    return out.transpose(0, 1)


class _Float8SequenceAllGather(torch.autograd.Function):
    """Shard(1) -> Replicate of an activation, sent as float8 bytes with the tensorwise scale the
    linears behind it use (from the global amax); backward reduce-scatters the high-precision
    gradient like a plain redistribute (quantization passes gradients straight through)."""

    @staticmethod
    def forward(ctx, x: DTensor):
        mesh, group = x.device_mesh, x.device_mesh.get_group()
        ctx.mesh, ctx.placements = mesh, x.placements
        local = x.to_local()
        scale = global_tensorwise_scale(local, group)
        gathered = _all_gather_dim1(to_float8(local, scale, E4M3).view(torch.uint8), group).view(E4M3)
        return DTensor.from_local(dequantize(gathered, scale, local.dtype), mesh, [Replicate()], run_check=False)

    @staticmethod
    def backward(ctx, grad: DTensor):
        return grad.redistribute(ctx.mesh, ctx.placements)


class Float8PrepareModuleInput(ParallelStyle):
    """Sequence parallel's gather before attention / feed-forward (the first input, Shard(1) ->
    Replicate) in float8, for the tensorwise recipe. Rowwise recipes keep the high-precision
    gather: their weight gradient (rowwise_with_gw_hp) or its column scales need the unrounded
    activation."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def gather_first_input(_module, args):
            x = args[0] if isinstance(args[0], DTensor) else DTensor.from_local(args[0], device_mesh, [Shard(1)], run_check=False)
            return (_Float8SequenceAllGather.apply(x), *args[1:])

        module.register_forward_pre_hook(gather_first_input)
        return module
