"""The mixture-of-experts family on one process: published sizes, the grouped GEMM path against the
exact loop, routing, load balancing (expert bias, sequence-wise aux loss), and its config checks.
The layouts (expert parallel and the rest) are in test_parallel_parity.py."""

from dataclasses import replace

import pytest
import torch

from titanlite.config import ConfigError, parse_args
from titanlite.models import build_model, model_args
from titanlite.models.moe.args import MOE_FLAVORS, check_moe
from titanlite.models.common.moe import MoE, global_balance, swiglu_experts, set_batch, update_expert_bias
from titanlite.models.moe.model import MoETransformer
from titanlite.parallel.dims import ParallelDims


# Published totals and activated parameters (model cards / papers), in billions.
@pytest.mark.parametrize(
    "flavor, total, active",
    [("qwen3_30b_a3b", 30.5, 3.3), ("qwen3_235b_a22b", 235.0, 22.0), ("deepseek_moe_16b", 16.4, 2.8)],
)
def test_flavors_have_the_published_sizes(flavor, total, active):
    args = model_args("moe", flavor, 0, 4096)
    model = build_model("moe", args)
    assert model.num_params() == args.num_params()  # the planner counts from the shapes alone
    assert args.num_params() / 1e9 == pytest.approx(total, rel=0.01)
    assert args.num_params(active=True) / 1e9 == pytest.approx(active, rel=0.03)
    # FLOPs count the weights a token visits: its top_k experts, not all of them.
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * 4096
    assert args.flops_per_token(4096) == 6 * args.num_params(exclude_embedding=True, active=True) + attention


def expert_inputs(tokens=40, experts=4, dim=8, hidden=12, empty=(2,), seed=0):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, 2 * tokens // experts, (experts,), generator=gen)
    counts[list(empty)] = 0  # an expert no token chose
    x = torch.randn(int(counts.sum()), dim, generator=gen, requires_grad=True)
    # Stored (experts, out, in) as the model holds them; used as (experts, in, out) column-major views.
    weights = [torch.randn(experts, *shape, generator=gen, requires_grad=True) for shape in ((hidden, dim), (dim, hidden), (hidden, dim))]
    return x, counts, weights


def test_grouped_matmul_equals_the_loop_over_experts():
    x, counts, weights = expert_inputs()
    w1, w2, w3 = (w.transpose(-2, -1) for w in weights)
    grad_out = torch.randn(x.shape[0], w2.shape[-1])
    results = []
    for run in (lambda: swiglu_experts(x, counts, w1, w2, w3, "loop"), lambda: swiglu_experts(x, counts, w1, w2, w3, "grouped")):
        out = run()
        grads = torch.autograd.grad(out, (x, *weights), grad_out)
        results.append((out, *grads))
    # The two paths sum in different orders: fp32 round-off, which in the whole suite's process once
    # reached 6e-6 (2.8e-5 relative) on 1 of 176 gradient entries; a wrong group boundary is off by O(1).
    for loop, grouped in zip(*results):
        torch.testing.assert_close(grouped, loop, rtol=1e-4, atol=1e-5)


def tiny_moe(**overrides) -> MoE:
    args = replace(model_args("moe", "debugmoe", 256, 16), dim=16, moe_hidden_dim=8, **overrides)
    layer = MoE(args)
    torch.manual_seed(0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    layer.reset_state()
    return layer


def test_router_weights_sum_to_the_route_scale_and_the_bias_only_moves_the_choice():
    layer = tiny_moe(score_func="sigmoid", route_norm=True, route_scale=2.5)
    x = torch.randn(32, 16)
    weights, chosen, scores = layer.router(x, layer.expert_bias)
    torch.testing.assert_close(weights.sum(dim=-1), torch.full((32,), 2.5))
    bias = torch.zeros(8)
    bias[0] = 10.0  # expert 0 wins every choice; its weight still comes from the scores
    weights_b, chosen_b, _ = layer.router(x, bias)
    assert (chosen_b == 0).any(dim=-1).all()
    raw = scores.gather(1, chosen_b)
    torch.testing.assert_close(weights_b, 2.5 * raw / raw.sum(dim=-1, keepdim=True))


def test_expert_bias_moves_towards_balance_with_zero_mean():
    layers = [tiny_moe(load_balance_coeff=0.01)]
    layers[0].tokens_per_expert.copy_(torch.tensor([10.0, 0, 0, 5, 5, 5, 5, 5]))
    counts, _ = global_balance(layers, None)
    update_expert_bias(layers, counts)
    bias = layers[0].expert_bias
    assert bias[0] < 0 < bias[1]  # the busy expert is chosen less, the idle one more
    assert abs(bias.sum()) < 1e-6 and layers[0].tokens_per_expert.sum() == 0


def test_expert_bias_moves_by_exactly_the_coefficient_whatever_the_imbalance():
    """DeepSeek-V3's step, centered so the biases keep a zero mean: bias += coeff * (s - mean(s)),
    s = sign(mean load - load), each expert's sign worked out by hand below. Only signs count, so a
    step is coeff whatever the counts' scale (the sign test above cannot see a wrong coefficient, a
    lost sign() or centering, or a bias set instead of moved; these numbers do)."""
    coeff = 0.01
    layers = [tiny_moe(load_balance_coeff=coeff) for _ in range(2)]
    loads = [
        [8.0, 0, 4, 4, 4, 4, 6, 2],  # mean 4: as many experts above it as below, so no centering shift
        [10.0, 0, 0, 5, 5, 5, 5, 5],  # mean 4.375: six above, two below, so every step shifts by coeff / 2
    ]
    signs = torch.tensor([[-1.0, 1, 0, 0, 0, 0, -1, 1], [-1.0, 1, 1, -1, -1, -1, -1, -1]], dtype=torch.float64)
    one_step = coeff * (signs - signs.mean(dim=1, keepdim=True))
    assert one_step[0].tolist() == [-coeff, coeff, 0, 0, 0, 0, -coeff, coeff]
    for scale, steps_taken in [(1.0, 1), (1000.0, 2)]:  # a thousand times the counts: the same step again
        for layer, layer_loads in zip(layers, loads):
            layer.tokens_per_expert.copy_(scale * torch.tensor(layer_loads))
        counts, _ = global_balance(layers, None)
        update_expert_bias(layers, counts)
        bias = torch.stack([layer.expert_bias for layer in layers]).double()
        assert (bias - steps_taken * one_step).abs().max() <= 1e-6 * coeff, (steps_taken, bias)


def test_sequence_aux_loss_follows_deepseek_v3_and_trains_the_router():
    coeff, bsz, seq = 0.1, 2, 6
    layer = tiny_moe(aux_loss_coeff=coeff)
    x = torch.randn(bsz, seq, 16)
    set_batch([layer], bsz, seq, 1)
    layer(x).sum().backward()
    grad_with = layer.router.gate.weight.grad.clone()
    # By hand: per sequence, sum_i f_i * P_i with f_i = E / (k S) * count_i and P_i the mean normalized
    # score; the mean over the step's sequences.
    layer.router.gate.weight.grad = None
    _, chosen, scores = layer.router(x.view(-1, 16), layer.expert_bias)
    expected = 0.0
    for b in range(bsz):
        rows = slice(b * seq, (b + 1) * seq)
        f = torch.bincount(chosen[rows].flatten(), minlength=8) * 8 / (2 * seq)
        p = (scores[rows] / scores[rows].sum(dim=-1, keepdim=True)).mean(dim=0)
        expected = expected + coeff * (f * p).sum() / bsz
    assert layer.aux_loss_sum.item() == pytest.approx(expected.item(), rel=1e-5)
    # Its gradient is what reaches the router on top of the routed outputs' (same routing without it).
    (aux_grad,) = torch.autograd.grad(expected, layer.router.gate.weight)
    layer.aux_loss_coeff = 0.0
    layer(x).sum().backward()
    # (A difference of two gradients ~1000x larger: fp32 round-off of theirs, not of the aux's.)
    torch.testing.assert_close(grad_with - layer.router.gate.weight.grad, aux_grad, rtol=0, atol=1e-5)
    assert aux_grad.abs().max() > 1e-3


def test_float8_leaves_the_router_in_high_precision():
    from titanlite.converters import Float8Converter
    from titanlite.float8 import Float8Linear
    from titanlite.models import FAMILIES

    model = build_model("moe", model_args("moe", "qwen3_30b_a3b", 0, 64, n_layers=2))  # gate 2048 x 128: eligible by shape
    Float8Converter(parse_args(["--model.converters", "float8"])).convert(model, FAMILIES["moe"].plan)
    float8 = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert "layers.0.attention.wq" in float8 and not any("router" in name for name in float8)


def test_state_buffers_stay_float32_in_a_bfloat16_model():
    model = MoETransformer(model_args("moe", "debugmoe", 256, 16)).to(torch.bfloat16)
    model.init_weights(0)
    layer = model.layers["1"].feed_forward
    assert layer.router.gate.weight.dtype == torch.bfloat16
    assert {b.dtype for b in (layer.expert_bias, layer.tokens_per_expert, layer.aux_loss_sum)} == {torch.float32}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_tokens_and_aux_loss_are_counted_once_under_activation_checkpointing(compiled):
    """Backward recomputes a checkpointed forward and adds nothing: eagerly (the custom op's check,
    models/common/forward_stats.py), and in a graph compiled with the checkpoint inside (AOTAutograd
    keeps the op in the forward graph)."""
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(2, 6, 16, requires_grad=True)
    plain = tiny_moe(aux_loss_coeff=0.01)
    plain(x).sum().backward()
    layer = tiny_moe(aux_loss_coeff=0.01)
    run = lambda t: checkpoint(layer, t, use_reentrant=False)  # noqa: E731
    (torch.compile(run, backend="aot_eager", fullgraph=True) if compiled else run)(x).sum().backward()
    assert plain.tokens_per_expert.sum() == 2 * 6 * layer.top_k and plain.aux_loss_sum > 0
    assert torch.equal(layer.tokens_per_expert, plain.tokens_per_expert)
    torch.testing.assert_close(layer.aux_loss_sum, plain.aux_loss_sum, rtol=1e-6, atol=0)
    layer.eval()
    layer(x)  # validation does not count
    assert layer.tokens_per_expert.sum() == 2 * 6 * layer.top_k


def test_dense_first_blocks_and_state_in_the_checkpoint():
    args = model_args("moe", "debugmoe", 256, 16)
    model = MoETransformer(args)
    assert not isinstance(model.layers["0"].feed_forward, MoE) and all(
        isinstance(model.layers[str(i)].feed_forward, MoE) for i in range(args.n_dense_layers, args.n_layers)
    )
    keys = model.state_dict().keys()
    assert "layers.1.feed_forward.expert_bias" in keys and "layers.1.feed_forward.tokens_per_expert" not in keys


def dims(*args: str, world: int):
    return ParallelDims.from_config(parse_args(list(args)), world)


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (dict(top_k=9), 1, "top_k=9 of num_experts=8"),
        (dict(score_func="relu"), 1, "score_func='relu'"),
    ],
)
def test_bad_moe_shapes_are_refused(overrides, world, message):
    args = replace(MOE_FLAVORS["debugmoe"], **overrides)
    with pytest.raises(ConfigError, match=message):
        check_moe(args, dims(world=world))


def test_bad_expert_parallel_layouts_are_refused():
    from titanlite.models.llama3.args import LLAMA3_FLAVORS, check_llama3

    with pytest.raises(ConfigError, match="expert_parallel_degree=2 splits the experts of a MoE model, and this model has none"):
        check_llama3(LLAMA3_FLAVORS["debugmodel"], dims("--parallelism.expert_parallel_degree", "2", world=2))
    args = MOE_FLAVORS["debugmoe"]
    with pytest.raises(ConfigError, match="expert_parallel_degree=3 does not divide the model's num_experts=8"):
        check_moe(args, dims("--parallelism.expert_parallel_degree", "3", world=6))
    with pytest.raises(ConfigError, match="tensor_parallel_degree=2 with enable_sequence_parallel=false: a MoE layer"):
        check_moe(args, dims("--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel", "false", world=2))
    with pytest.raises(ConfigError, match="expert_parallel_degree=2 must be context_parallel_degree x tensor_parallel_degree=4"):
        dims("--parallelism.expert_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "4", world=4)
    with pytest.raises(ConfigError, match="model.moe_aux_loss_coeff=0.1 applies to MoE models, and model.name='llama3' has no experts"):
        parse_args(["--model.moe_aux_loss_coeff", "0.1"])
    with pytest.raises(ConfigError, match="expert_tensor_parallel_degree=2 splits the experts of a MoE model"):
        check_llama3(LLAMA3_FLAVORS["debugmodel"], dims("--parallelism.expert_tensor_parallel_degree", "2",
                                                        "--parallelism.tensor_parallel_degree", "2", world=2))
    with pytest.raises(ConfigError, match="expert_tensor_parallel_degree=2 must be 1 .* or tensor_parallel_degree=4"):
        dims("--parallelism.expert_tensor_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "4", world=4)
    # Experts split over tp: EP borrows dp_shard x cp only.
    etp = dims("--parallelism.expert_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2",
               "--parallelism.expert_tensor_parallel_degree", "2", world=4)
    assert (etp.dp_shard_in_ep, etp.efsdp, etp.expert_mesh_dims) == (2, 1, ("ep", "tp"))
    with pytest.raises(ConfigError, match="expert_parallel_degree=4 must be context_parallel_degree x tensor_parallel_degree=1 times a divisor of data_parallel_shard_degree=2"):
        dims("--parallelism.expert_parallel_degree", "4", world=2)
    with pytest.raises(ConfigError, match="expert_parallel_degree=2 must be context_parallel_degree x tensor_parallel_degree=4 times a divisor"):
        dims("--parallelism.expert_parallel_degree", "2", "--parallelism.context_parallel_degree", "4", world=4)
