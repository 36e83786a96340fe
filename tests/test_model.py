"""Llama 3: shapes, presets, FLOPs count, RoPE, GQA, init."""

import math
from collections import Counter
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import tiny_args
from titanlite.config import parse_args
from titanlite.models import build_model, model_args
from titanlite.models.llama3.args import LLAMA3_FLAVORS
from titanlite.models.common.linear import FusedLinear
from titanlite.models.common.rope import apply_rope, rope_cache
from titanlite.models.llama3.model import Transformer


def tiny(vocab=320, **overrides):
    """The GQA debug model, 2 layers."""
    return replace(model_args("llama3", "debugmodel_gqa", vocab, 64), n_layers=2, **overrides)


@pytest.mark.parametrize(
    "flavor, billions", [("8B", 8.03), ("70B", 70.55), ("405B", 405.85)]
)
def test_presets_have_metas_sizes(flavor, billions):
    args = model_args("llama3", flavor, 0, 8192)
    model = build_model("llama3", args)
    assert model.num_params() / 1e9 == pytest.approx(billions, abs=0.01)
    assert args.num_params() == model.num_params()  # the planner counts from the shapes alone
    assert next(model.parameters()).device.type == "meta"


def test_presets_shapes():
    a = LLAMA3_FLAVORS["8B"]
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.ffn_hidden_dim, a.vocab_size) == (4096, 32, 32, 8, 14336, 128256)
    a = LLAMA3_FLAVORS["70B"]
    assert (a.ffn_hidden_dim, a.n_heads) == (28672, 64)
    a = LLAMA3_FLAVORS["405B"]
    assert (a.dim, a.n_layers, a.ffn_hidden_dim) == (16384, 126, 53248)
    debug = model_args("llama3", "debugmodel", 259, 256)
    assert (debug.dim, debug.n_layers, debug.n_heads, debug.vocab_size) == (256, 6, 16, 320)  # padded to 64


def test_forward_shape_and_initial_loss():
    args = tiny()
    model = Transformer(args)
    model.init_weights(seed=0)
    tokens = torch.randint(0, args.vocab_size, (2, 64))
    logits = model(tokens)
    assert logits.shape == (2, 64, args.vocab_size)
    loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    # Near-uniform predictions at init: the loss is close to log(vocab).
    assert abs(loss.item() - math.log(args.vocab_size)) < 1.0


def test_flops_per_token_formula():
    args = model_args("llama3", "8B", 0, 8192)
    model = build_model("llama3", args)
    non_embedding = model.num_params() - args.vocab_size * args.dim
    expected = 6 * non_embedding + 12 * 32 * 32 * 128 * 8192
    assert model.flops_per_token(8192) == expected
    assert expected / 1e9 == pytest.approx(6 * 7.5 + 12 * 32 * 4096 * 8192 / 1e9, rel=0.01)


def test_init_is_seeded_per_parameter_and_depth_scaled():
    args = tiny()
    a, b, c = Transformer(args), Transformer(args), Transformer(args)
    a.init_weights(1)
    b.init_weights(1)
    c.init_weights(2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name
    wo0, wo1 = a.layers["0"].attention.wo.weight, a.layers["1"].attention.wo.weight
    assert wo0.std().item() == pytest.approx(0.02 / 2**0.5, rel=0.1)
    assert wo1.std().item() == pytest.approx(0.02 / 4**0.5, rel=0.1)
    assert torch.equal(a.norm.weight, torch.ones_like(a.norm.weight))
    # A stage holding only layer 1 gets the same weights for it (names, not order, seed them).
    stage = Transformer(args)
    del stage.layers["0"]
    stage.init_weights(1)
    assert torch.equal(stage.layers["1"].attention.wq.weight, a.layers["1"].attention.wq.weight)


def test_causal():
    model = Transformer(tiny())
    model.init_weights(0)
    tokens = torch.randint(0, 320, (1, 64))
    changed = tokens.clone()
    changed[0, 40:] = (changed[0, 40:] + 1) % 320
    assert torch.allclose(model(tokens)[:, :40], model(changed)[:, :40], atol=1e-5)


def test_rope_rotates_pairs_and_preserves_norm():
    args = tiny()
    rope = rope_cache(args, 64)
    x = torch.randn(2, 64, 4, args.head_dim)
    y = apply_rope(x, rope)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-4)
    assert torch.equal(y[:, 0], x[:, 0])  # position 0: no rotation
    # Relative positions: <rope(q, m), rope(k, n)> depends only on m - n.
    q, k = torch.randn(args.head_dim), torch.randn(args.head_dim)
    def dot(m, n):
        qs = apply_rope(q.expand(1, 64, 1, -1).clone(), rope)[0, m, 0]
        ks = apply_rope(k.expand(1, 64, 1, -1).clone(), rope)[0, n, 0]
        return (qs * ks).sum()
    assert dot(10, 3) == pytest.approx(dot(20, 13).item(), abs=1e-4)


def test_rope_compiled_form_matches_eager():
    """Eager RoPE is a complex multiply, compiled RoPE the real form inductor fuses: the same rotation,
    values and gradients, with per-token positions too."""
    args = tiny()
    rope = rope_cache(args, 64)
    x = torch.randn(2, 64, 4, args.head_dim, requires_grad=True)
    positions = torch.randint(0, 64, (2, 64))
    for table in (rope, rope[positions]):
        eager = apply_rope(x, table)
        (grad_eager,) = torch.autograd.grad(eager.square().sum(), x)
        compiled = torch.compile(apply_rope, backend="aot_eager")(x, table)
        (grad_compiled,) = torch.autograd.grad(compiled.square().sum(), x)
        assert torch.allclose(eager, compiled, atol=1e-6) and torch.allclose(grad_eager, grad_compiled, atol=1e-5)


def test_llama31_rope_scaling_slows_low_frequencies_only():
    scaled = rope_cache(tiny(rope_scaling=True, dim=1024, n_heads=8, n_kv_heads=2), 2)
    plain = rope_cache(tiny(rope_scaling=False, dim=1024, n_heads=8, n_kv_heads=2), 2)
    half = scaled.shape[1] // 2
    freq_scaled, freq_plain = torch.atan2(scaled[1, half:], scaled[1, :half]), torch.atan2(plain[1, half:], plain[1, :half])
    assert torch.allclose(freq_scaled[:4], freq_plain[:4])  # high frequencies kept
    assert torch.allclose(freq_scaled[-4:], freq_plain[-4:] / 8, rtol=1e-4)  # lowest slowed down 8x


def test_gqa_shares_kv_heads():
    args = tiny()
    model = Transformer(args)
    assert model.layers["0"].attention.wk.weight.shape == (args.n_kv_heads * args.head_dim, args.dim)
    assert args.n_heads // args.n_kv_heads == 4


def test_context_parallel_finds_torchs_ring_attention():
    """The CPU ring-attention route relies on private torch APIs; fail loudly if a torch moves them."""
    from titanlite.parallel import context

    ring = context._ring
    for name in ("custom_ops", "_templated_ring_attention", "_templated_ring_attention_backward", "_cp_options", "set_rotate_method"):
        assert hasattr(ring, name), name
    assert hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward")


@pytest.mark.parametrize("name, flavor", [("llama3", "debugmodel_gqa"), ("moe", "debugmoe_qwen3")])
def test_fused_projections_compute_what_the_separate_ones_do(name, flavor):
    """q/k/v as one matmul: the same parameters under
    the same names, the same logits, gradients within fp32 round-off; float8 linears keep their own."""
    from titanlite.float8 import convert_to_float8
    from titanlite.models import FAMILIES

    args = replace(model_args(name, flavor, 320, 64), n_layers=2)
    separate, fused = (FAMILIES[name].plan.build(replace(args, fused_projections=f)) for f in (False, True))
    separate.init_weights(seed=0)
    fused.load_state_dict(separate.state_dict())
    assert list(fused.state_dict()) == list(separate.state_dict())
    assert all(isinstance(block.attention.qkv, FusedLinear) for block in fused.layers.values())
    tokens = torch.randint(0, 320, (2, 64))
    grads = []
    for model in (separate, fused):
        logits = model(tokens)
        logits.square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        assert torch.equal(logits, separate(tokens))  # separate's forward ran first: its logits are the reference
    for n, g in grads[0].items():
        assert (grads[1][n] - g).abs().max() <= 1e-5 * g.abs().max(), n
    for model in (separate, fused):
        convert_to_float8(model, "tensorwise", ["output"], emulate=True)
    assert torch.equal(fused(tokens), separate(tokens))


@pytest.mark.parametrize("overrides", [[], ["--model.name", "moe", "--model.flavor", "debugmoe"]], ids=["llama3", "moe"])
def test_a_model_built_from_the_default_config_runs_its_fused_matmuls(overrides, tmp_path):
    """model.fused_projections is the default: a model built from the config as the Trainer builds it
    multiplies each block's q/k/v in one FusedLinear, in
    training and in evaluation, and never calls those linears alone. The fused and separate paths give
    the same results, so parity cannot tell which ran: only the calls can."""
    config = parse_args(tiny_args(tmp_path / "corpus.jsonl", tmp_path, *overrides))
    m, seq_len = config.model, config.training.seq_len
    args = model_args(m.name, m.flavor, 320, seq_len, m.n_layers, m)
    model = build_model(m.name, args).to_empty(device="cpu")
    model.init_weights(seed=0)
    calls = Counter()
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, FusedLinear)):
            module.register_forward_hook(lambda *_, name=name: calls.update([name]))
    tokens = torch.randint(0, 320, (2, seq_len))
    model(tokens).sum().backward()
    with torch.no_grad():
        model(tokens)
    fused = [name for name, module in model.named_modules() if isinstance(module, FusedLinear)]
    assert len(fused) == args.n_layers, fused
    assert all(calls[name] == 2 for name in fused), calls
    alone = {name for name in calls if name.rsplit(".", 1)[-1] in ("wq", "wk", "wv")}
    assert not alone, f"projections configured fused ran separately: {sorted(alone)}"


def test_fused_projections_keep_only_the_weights_for_backward():
    """The concatenated weight is not saved for backward (under FSDP it would hold every block's
    gathered weights through the forward): the saved tensors are the input and the parameters."""
    x = torch.randn(4, 8, requires_grad=True)
    weights = [torch.randn(n, 8, requires_grad=True) for n in (6, 2, 2)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        q, k, v = FusedLinear()(x, *weights)
    assert (q.shape, k.shape, v.shape) == ((4, 6), (4, 2), (4, 2))
    assert len(saved) == 4 and all(any(s is t for t in (x, *weights)) for s in saved)
    (q.sum() + 2 * k.sum() + 3 * v.sum()).backward()
    assert torch.allclose(weights[2].grad, 3 * x.sum(0).expand(2, 8), atol=1e-5)
