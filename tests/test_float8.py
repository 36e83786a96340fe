"""Float8: quantization error bounds, the float8 linear against the high-precision one, which
layers convert, and a short training run per recipe against fp32 (layout parity is in
test_parallel_parity.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed import run_distributed
from helpers import train_losses
from titanlite.float8 import (
    E4M3,
    E5M2,
    RECIPES,
    Float8Linear,
    convert_to_float8,
    dequantize,
    float8_mm,
    quantize,
)

# Mantissa bits: a normal float8 value is within half an ulp, 2^-(bits + 1), of the exact one.
MANTISSA_BITS = {E4M3: 3, E5M2: 2}


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dim", [None, -1])
def test_quantize_round_trip_is_within_half_an_ulp(dtype, dim):
    x = torch.randn(64, 128) * torch.logspace(-3, 3, 128)  # columns spanning six decades
    data, scale = quantize(x, dtype, dim)
    assert data.dtype == dtype and scale.shape == (() if dim is None else (64, 1))
    back = dequantize(data, scale, torch.float32)
    # Values that land in float8's normal range keep the relative bound; smaller ones flush toward 0.
    normal = (x * scale).abs() >= torch.finfo(dtype).smallest_normal
    assert normal.float().mean() > 0.5
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max() <= 2.0 ** -(MANTISSA_BITS[dtype] + 1) * 1.0001
    # The largest magnitude maps to the largest float8 value: the full range is used.
    assert (data.float().abs().amax(dim=dim) == torch.finfo(dtype).max).all()


def test_rowwise_power_of_2_scales_are_exact_powers_of_two():
    _, scale = quantize(torch.randn(8, 32) * 7, E4M3, -1, power_of_2=True)
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)


def test_emulated_matmul_equals_scaled_mm():
    """emulate multiplies the same float8 values in fp32: torch._scaled_mm agrees to fp32 round-off."""
    torch.manual_seed(0)
    a, b = torch.randn(32, 64), torch.randn(64, 16)
    for dim_a, dim_b in [(None, None), (-1, 0)]:  # tensorwise; rowwise (per row of a, column of b)
        a8, sa = quantize(a, E4M3, dim_a)
        b8, sb = quantize(b, E4M3, dim_b)
        emulated = float8_mm(a8, sa, b8, sb, torch.float32, emulate=True)
        real = float8_mm(a8, sa, b8, sb, torch.float32, emulate=False)
        assert (emulated - real).abs().max() <= 1e-6 * emulated.abs().max()


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_float8_linear_is_close_to_linear_in_forward_and_backward(recipe, bias):
    torch.manual_seed(0)
    ref = nn.Linear(256, 128, bias=bias)
    model = nn.Sequential(nn.Linear(256, 128, bias=bias))
    model[0].load_state_dict(ref.state_dict())
    assert convert_to_float8(model, recipe, [], emulate=True) == ["0"]
    x = torch.randn(4, 16, 256, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = model(x), ref(x_ref)
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    y_ref.backward(grad_out)

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    # float8 rounds each operand by up to 6% (e4m3) / 12% (e5m2); matmul sums average that down.
    # No error at all would mean no float8.
    checks = [("output", y, y_ref), ("input grad", x.grad, x_ref.grad), ("weight grad", model[0].weight.grad, ref.weight.grad)]
    for name, got, want in checks:
        if name == "weight grad" and RECIPES[recipe].grad_weight_in_high_precision:
            assert rel(got, want) < 1e-6  # grad_output and input, both unrounded, in high precision
        else:
            assert 1e-3 < rel(got, want) < 0.1, f"{recipe} {name}: relative error {rel(got, want):.4f}"
    if bias:  # added in high precision: its gradient is the output gradient's sum
        torch.testing.assert_close(model[0].bias.grad, ref.bias.grad)


def test_which_linears_convert():
    from titanlite.models import build_model, model_args

    args = model_args("llama3", "debugmodel", vocab_size=2048, seq_len=64)
    model = build_model("llama3", args)
    converted = convert_to_float8(model, "tensorwise", ["output", "layers.1.feed_forward"], emulate=True)
    assert "output" not in converted and "layers.0.feed_forward.w1" in converted
    assert not any(name.startswith("layers.1.feed_forward") for name in converted)
    assert len(converted) == 7 * args.n_layers - 3  # q, k, v, o, w1, w2, w3 per block
    assert isinstance(model.layers["0"].attention.wq, Float8Linear) and not isinstance(model.output, Float8Linear)

    odd = nn.Sequential(nn.Linear(24, 32, bias=False), nn.Linear(32, 32, bias=True), nn.Linear(32, 48, bias=False))
    assert convert_to_float8(odd, "rowwise", [], emulate=True) == ["1", "2"]  # 24 % 16 != 0


@pytest.mark.slow
@pytest.mark.full  # in scripts/test_full.sh: the default suite stays under 20 minutes
def test_float8_recipes_train_like_fp32_on_the_default_data(tmp_path):
    """20 steps of the debug model on the built-in corpus (same batches for all): the mean loss of
    the last 5 steps of each recipe is within 3% of fp32's (scripts/loss_compare.py runs the long
    comparison and plots it)."""
    emulated = ["--model.converters", "float8", "--quantize.linear.float8.emulate", "--quantize.linear.float8.recipe_name"]
    runs = {"none": [], **{recipe: [*emulated, recipe] for recipe in RECIPES}}
    losses = run_distributed(train_losses, 1, "debug_model.toml", 20, runs, str(tmp_path))[0]
    end = {recipe: sum(curve[-5:]) / 5 for recipe, curve in losses.items()}
    assert end["none"] < losses["none"][0] - 1.5, losses["none"]  # it learned (starts near ln 8192 = 9.0)
    for recipe in RECIPES:
        assert losses[recipe] != losses["none"]  # float8 really rounded something
        assert abs(end[recipe] - end["none"]) / end["none"] < 0.03, end
