"""Float8 grouped GEMMs of the routed experts ([quantize.grouped_mm.float8]): the padded layout, the
float8 math against a loop of rowwise float8 linears (one per expert, tested in test_float8.py against
fp32), which experts convert, and 60 training steps against fp32 (layout parity: test_parallel_parity.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed
from helpers import train_losses
from titanlite.float8 import RECIPES, Float8Linear
from titanlite.float8_grouped import GROUP_ALIGN, Float8GroupedExperts, float8_grouped_swiglu, padded_layout

COUNTS = [5, 0, 17, 3, 16, 1]  # an empty expert, one of exactly 16 rows, one of a single row


def test_padded_layout_aligns_every_group_and_keeps_each_token_in_its_group():
    counts = torch.tensor(COUNTS)
    rows = int(counts.sum())
    position, ends, expert_of_block, capacity = padded_layout(counts, rows)
    assert capacity % GROUP_ALIGN == 0 and capacity >= rows + len(COUNTS) * (GROUP_ALIGN - 1)
    assert ends.dtype == torch.int32 and ends[-1] == capacity
    assert all(int(e) % GROUP_ALIGN == 0 for e in ends)
    assert len(set(position.tolist())) == rows  # each token its own row
    starts = [0, *ends[:-1].tolist()]
    expected = [expert for expert, n in enumerate(COUNTS) for _ in range(n)]
    for token, (row, expert) in enumerate(zip(position.tolist(), expected)):
        assert starts[expert] <= row < ends[expert], (token, row, expert)
        assert expert_of_block[row // GROUP_ALIGN] == expert
    # Tokens keep their order inside a group, from the group's first row.
    for expert, n in enumerate(COUNTS):
        first = sum(COUNTS[:expert])
        assert position[first : first + n].tolist() == list(range(starts[expert], starts[expert] + n))


def expert_weights(experts: int, dim: int, hidden: int, seed: int = 0, spread: float = 0.0):
    """Stored (experts, out, in) weights; `spread`: the output rows span 10^-spread..10^spread, so a
    scale taken along the wrong dim pushes small values below float8's normal range (power-of-two
    scales round normal values alike whatever the scale)."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((hidden, dim), (dim, hidden), (hidden, dim))
    return [
        torch.randn(experts, *shape, generator=g) * 0.3
        * torch.logspace(-spread, spread, shape[0])[:, None] * torch.logspace(spread, -spread, shape[1])
        for shape in shapes
    ]


def assert_close_along_each_line(got: torch.Tensor, want: torch.Tensor) -> None:
    """Each entry within 1e-5 of the largest of its row or column, whichever is smaller: a value
    flushed by a wrong scale shows even where the whole tensor's largest dwarfs it."""
    want2, got2 = want.reshape(-1, want.shape[-1]), got.reshape(-1, got.shape[-1])
    bound = 1e-5 * torch.minimum(want2.abs().amax(0, keepdim=True), want2.abs().amax(1, keepdim=True))
    assert not got2.isnan().any() and ((got2 - want2).abs() <= bound).all(), ((got2 - want2).abs() / bound).max()


def run_grouped(x, counts, stored):
    """Float8 grouped SwiGLU on stored (experts, out, in) weights: (output, x grad, weight grads)."""
    x = x.detach().clone().requires_grad_()
    ws = [w.clone().requires_grad_() for w in stored]
    out = float8_grouped_swiglu(x, counts, *(w.transpose(-2, -1) for w in ws), emulate=True)
    return out, x, ws


def test_float8_grouped_swiglu_equals_a_loop_of_rowwise_float8_linears():
    """Forward, input gradient and weight gradients: each expert's tokens through three rowwise float8
    linears (titanlite/float8.py, its own per-tensor code) give the same float8 values and products.
    Values span six decades along every dim, so each scale must run along its own dim."""
    torch.manual_seed(0)
    dim, hidden = 32, 48
    stored = expert_weights(len(COUNTS), dim, hidden, spread=3.0)
    counts = torch.tensor(COUNTS)
    x = torch.randn(int(counts.sum()), dim) * torch.logspace(-3, 3, dim)  # columns spanning six decades
    out, xg, ws = run_grouped(x, counts, stored)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    def linear(weight):
        m = Float8Linear(weight.shape[1], weight.shape[0], bias=False)
        m.recipe, m.emulate = RECIPES["rowwise"], True
        m.weight = torch.nn.Parameter(weight.clone())
        return m

    xr = x.clone().requires_grad_()
    layers = [[linear(w[e]) for e in range(len(COUNTS))] for w in stored]
    pieces = []
    for e, rows in enumerate(xr.split(COUNTS)):
        w1, w2, w3 = (layer[e] for layer in layers)
        pieces.append(w2(F.silu(w1(rows)) * w3(rows)) if len(rows) else rows)
    ref = torch.cat(pieces)
    ref.backward(grad_out)
    assert_close_along_each_line(out, ref)
    assert_close_along_each_line(xg.grad, xr.grad)
    for w, layer in zip(ws, layers):
        for e, n in enumerate(COUNTS):
            if n:
                assert_close_along_each_line(w.grad[e], layer[e].weight.grad)
            else:
                assert not w.grad[e].any()


def test_float8_grouped_swiglu_rounds_like_float8_near_the_fp32_result():
    """Relative error between 1e-3 (no error: no float8) and 0.1 against fp32, on each output."""
    torch.manual_seed(1)
    dim, hidden = 64, 128
    counts = torch.tensor([40, 7, 0, 81])
    stored = expert_weights(4, dim, hidden, seed=1)
    x = torch.randn(int(counts.sum()), dim)
    out, xg, ws = run_grouped(x, counts, stored)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    xr = x.clone().requires_grad_()
    wr = [w.clone().requires_grad_() for w in stored]
    pieces = [(F.silu(rows @ wr[0][e].t()) * (rows @ wr[2][e].t())) @ wr[1][e].t() for e, rows in enumerate(xr.split(counts.tolist()))]
    ref = torch.cat(pieces)
    ref.backward(grad_out)
    for name, got, want in [("output", out, ref), ("x grad", xg.grad, xr.grad), *[(f"w{i} grad", a.grad, b.grad) for i, a, b in zip((1, 2, 3), ws, wr)]]:
        rel = ((got - want).norm() / want.norm()).item()
        assert 1e-3 < rel < 0.1, f"{name}: relative error {rel:.4f}"


def test_the_converter_swaps_the_named_experts_only_and_refuses_a_name_that_matches_none():
    from titanlite.config import ConfigError, parse_args
    from titanlite.converters import build_converters
    from titanlite.models import FAMILIES, build_model, model_args

    args = model_args("moe", "debugmoe", vocab_size=2048, seq_len=64)
    config = parse_args(["--model.name", "moe", "--model.flavor", "debugmoe", "--model.converters", "quantize.grouped_mm.float8", "--quantize.grouped_mm.float8.fqns", "layers.1."])
    model = build_model("moe", args)
    (converter,) = build_converters(config)
    converter.convert(model, FAMILIES["moe"].plan)
    converted = [name for name, m in model.named_modules() if isinstance(m, Float8GroupedExperts)]
    assert converted == ["layers.1.feed_forward.experts"], converted  # not the shared experts (dense linears)
    assert "1 MoE layers (emulated in fp32 on cpu)" in converter.describe([model], torch.device("cpu"))

    config.quantize.grouped_mm.float8.fqns = ["attention"]
    with pytest.raises(ConfigError, match=r"fqns=\['attention'\] names no MoE layer's experts"):
        build_converters(config)[0].convert(build_model("moe", args), FAMILIES["moe"].plan)


@pytest.mark.slow
def test_float8_grouped_gemms_train_like_fp32_for_60_steps(tmp_path):
    """The MoE debug model on the built-in corpus, same batches: the mean loss of the last 10 of 60
    steps with float8 experts is within 3% of fp32's (on a GPU the comparison is against bf16 experts)."""
    runs = {"fp32": [], "float8": ["--model.converters", "quantize.grouped_mm.float8", "--quantize.grouped_mm.float8.fqns", "experts"]}
    losses = run_distributed(train_losses, 1, "debug_moe.toml", 60, runs, str(tmp_path))[0]
    assert len(losses["fp32"]) == len(losses["float8"]) == 60, {k: len(v) for k, v in losses.items()}
    assert all(torch.isfinite(torch.tensor(curve)).all() for curve in losses.values()), losses
    end = {name: sum(curve[-10:]) / 10 for name, curve in losses.items()}
    assert end["fp32"] < losses["fp32"][0] - 1.5, losses["fp32"]  # it learned
    assert losses["float8"] != losses["fp32"]  # float8 really rounded something
    assert abs(end["float8"] - end["fp32"]) / end["fp32"] < 0.03, end


def test_the_fused_casts_cuda_runs_equal_the_eager_ones():
    """On CUDA the casts run compiled (one kernel each); compiled here on the CPU, they give the same
    float8 values and scales bitwise, for two row counts (dynamic shapes)."""
    from titanlite.float8_grouped import fused_casts, quantize_by_expert, rowwise

    fused_rowwise, fused_quantize_by_expert = fused_casts()

    torch.manual_seed(3)
    for counts in (torch.tensor([5, 0, 17, 3]), torch.tensor([40, 2, 9, 33])):
        rows = int(counts.sum())
        _, _, expert_of_block, capacity = padded_layout(counts, rows)
        t = torch.randn(capacity, 64).bfloat16() * torch.logspace(-3, 3, 64).bfloat16()
        for got, want in [(fused_rowwise(t, -1), rowwise(t, -1)), (fused_rowwise(t.t(), -2), rowwise(t.t(), -2)),
                          (fused_quantize_by_expert(t, expert_of_block, 4), quantize_by_expert(t, expert_of_block, 4))]:
            assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
