"""MoE numerics that bf16 GPUs expose, checked on CPU: the router in fp32, Qwen's global-batch
balance loss against transformers', a combine without scatter-adds, and which kernel the routed
experts run on a device. The layouts of the global-batch loss are parity cases (parity_cases.py)."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from titanlite.models import model_args
from titanlite.models.common.moe import MoE, choose_expert_kernel, configure_experts, set_batch


def moe_layer(seed: int = 0, **overrides) -> MoE:
    args = replace(model_args("moe", "debugmoe", 256, 16), **({"dim": 32, "moe_hidden_dim": 16} | overrides))
    layer = MoE(args)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    layer.reset_state()
    return layer


def test_the_router_chooses_in_fp32_in_a_bfloat16_model():
    """At Qwen3-30B-A3B's router shape (dim 2048, 128 experts, top 8), a bf16 gate changes the top-8 of
    a few percent of tokens; the router's choice must be the one fp32 logits of the same bf16
    inputs and weights give."""
    layer = moe_layer(dim=2048, num_experts=128, top_k=8, moe_hidden_dim=8, num_shared_experts=0).to(torch.bfloat16)
    layer.reset_state()
    x = torch.randn(512, 2048, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    weights, chosen, _ = layer.router(x, layer.expert_bias)
    w = layer.router.gate.weight
    fp32_scores = (x.double() @ w.double().t()).float().softmax(dim=-1)  # an independent fp32 (here fp64) product
    expected = fp32_scores.topk(8, dim=-1).indices
    assert torch.equal(chosen.sort(dim=-1).values, expected.sort(dim=-1).values)
    assert weights.dtype == torch.float32
    # The test can see the difference: a bf16 gate picks other experts for some tokens.
    bf16_choice = (x @ w.t()).float().softmax(dim=-1).topk(8, dim=-1).indices
    assert not torch.equal(bf16_choice.sort(dim=-1).values, expected.sort(dim=-1).values)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_global_batch_aux_loss_equals_transformers(score_func):
    """transformers' load_balancing_loss_func (Qwen3-MoE's) on the same router logits, for one layer:
    E * sum_i (tokens choosing i / tokens) * mean probability of i. Sigmoid scores enter normalized
    to sum 1 (as Megatron does); transformers takes the softmax, so it is given log of those."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    coeff, bsz, seq = 0.01, 3, 8
    layer = moe_layer(aux_loss_coeff=coeff, aux_loss_type="global_batch", score_func=score_func, load_balance_coeff=0.0)
    assert layer.moe_layer_count == 3  # debugmoe: 4 blocks, the first dense
    layer.moe_layer_count = 1
    set_batch([layer], bsz, seq, 1)
    x = torch.randn(bsz, seq, 32, generator=torch.Generator().manual_seed(2))
    layer(x).sum().backward()
    logits = x.view(-1, 32) @ layer.router.gate.weight.t()
    if score_func == "sigmoid":
        logits = (logits.sigmoid() / logits.sigmoid().sum(dim=-1, keepdim=True)).log()
    expected = coeff * load_balancing_loss_func((logits.detach(),), 8, 2)
    assert layer.aux_loss_sum.item() == pytest.approx(expected.item(), rel=1e-5)
    # A mean over the model's MoE layers and the step's forwards.
    layer.aux_loss_sum.zero_()
    layer.moe_layer_count = 3
    set_batch([layer], bsz, seq, 2)
    layer(x)
    assert layer.aux_loss_sum.item() == pytest.approx(expected.item() / 6, rel=1e-5)


def test_global_batch_aux_loss_trains_the_router_by_its_formula():
    coeff = 1.0  # large: the aux gradient is read as a difference of two gradients, each with its round-off
    layer = moe_layer(aux_loss_coeff=coeff, aux_loss_type="global_batch", load_balance_coeff=0.0)
    layer.moe_layer_count = 1
    set_batch([layer], 2, 6, 1)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(3))
    layer(x).sum().backward()
    grad_with = layer.router.gate.weight.grad.clone()
    layer.router.gate.weight.grad = None
    scores = (x.view(-1, 32) @ layer.router.gate.weight.t()).softmax(dim=-1)
    f = torch.bincount(scores.topk(2, dim=-1).indices.flatten(), minlength=8) / 12  # counts are constants
    (aux_grad,) = torch.autograd.grad(coeff * 8 * (f * scores.mean(dim=0)).sum(), layer.router.gate.weight)
    layer.aux_loss_coeff = 0.0
    layer(x).sum().backward()
    torch.testing.assert_close(grad_with - layer.router.gate.weight.grad, aux_grad, rtol=0, atol=1e-4)
    assert aux_grad.abs().max() > 1e-2


def test_the_qwen3_flavors_balance_by_the_global_batch_loss():
    for flavor in ("qwen3_30b_a3b", "qwen3_235b_a22b"):
        args = model_args("moe", flavor, 0, 64)
        assert (args.aux_loss_type, args.aux_loss_coeff, args.load_balance_coeff) == ("global_batch", 0.001, 0.0)
    assert model_args("moe", "debugmoe_sigmoid", 256, 64).aux_loss_type == "sequence"


class FloatAccumulations(TorchDispatchMode):
    """Records scatter-style accumulations into floating-point tensors (atomics on CUDA: any order)."""

    OPS = ("index_add", "scatter_add", "scatter_reduce", "index_put", "_index_put_impl")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__.rstrip("_")
        accumulates = name in ("index_put", "_index_put_impl") and (kwargs.get("accumulate") or (len(args) > 3 and args[3]))
        if (name in ("index_add", "scatter_add", "scatter_reduce") or accumulates) and args[0].is_floating_point():
            self.seen.append(name)
        return func(*args, **kwargs)


@pytest.mark.parametrize("score_before_experts", [False, True])
def test_the_combine_sums_each_tokens_outputs_in_a_fixed_order(score_before_experts):
    """No scatter-add into the output: each token's k expert outputs come back by a permutation and
    are weighted in fp32 and summed in order, the same on every device (debug.deterministic needs
    nothing more). The result equals a sum by hand over each token's experts."""
    layer = moe_layer(score_before_experts=score_before_experts, num_shared_experts=0)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(4))
    with FloatAccumulations() as mode:
        out = layer(x)
    assert mode.seen == []
    flat = x.view(-1, 32)
    weights, chosen, _ = layer.router(flat, layer.expert_bias)
    e = layer.experts
    expected = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for k in range(layer.top_k):
            w1, w2, w3 = (getattr(e, n)[chosen[t, k]] for n in ("w1", "w2", "w3"))
            row = flat[t] * weights[t, k] if score_before_experts else flat[t]
            y = (F.silu(row @ w1.t()) * (row @ w3.t())) @ w2.t()
            expected[t] += y if score_before_experts else weights[t, k] * y
    # The hand sum runs other matmul kernels than the grouped GEMM: they round apart by a few ulps of the
    # largest output (|35|: 1.3e-5 on this machine's CPU, whose kernels differ from the last one's).
    torch.testing.assert_close(out.view(-1, 32), expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())


def test_the_experts_kernel_for_each_device():
    """CUDA's fast grouped GEMM: bf16 on SM90+. Older GPUs: the exact loop, said in the log line."""
    assert choose_expert_kernel(True, "cuda", (9, 0))[:2] == ("grouped", torch.bfloat16)
    assert choose_expert_kernel(True, "cuda", (10, 0))[:2] == ("grouped", torch.bfloat16)
    kernel, dtype, why = choose_expert_kernel(True, "cuda", (8, 0))
    assert (kernel, dtype) == ("loop", None) and "sm_80" in why and "loop over experts" in why
    assert choose_expert_kernel(True, "cpu", None)[:2] == ("grouped", None)
    assert choose_expert_kernel(False, "cuda", (9, 0))[:2] == ("loop", None)
    # The module runs what it is given: bf16 compute with fp32 activations returns fp32, near fp32's result.
    layer = moe_layer()
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(5))
    reference = layer(x)
    configure_experts([layer.experts], True, torch.device("cpu"))
    assert (layer.experts.kernel, layer.experts.compute_dtype) == ("grouped", None)
    layer.experts.compute_dtype = torch.bfloat16
    out = layer(x)
    assert out.dtype == torch.float32 and not torch.equal(out, reference)
    torch.testing.assert_close(out, reference, rtol=0.05, atol=0.05)
    layer.experts.kernel, layer.experts.compute_dtype = "loop", None
    torch.testing.assert_close(layer(x), reference, rtol=1e-5, atol=1e-5)


def test_a_moe_blocks_router_and_shared_experts_compile_whole():
    """Where a MoE layer is not one graph (here on the loop over experts), per-block compile takes
    the block's attention, router and shared experts, each as one full graph (fullgraph: a graph
    break raises); the routed experts stay eager. (Dynamo's tracing with the eager backend: the
    parity case moe_ep2_compile runs inductor.)"""
    from titanlite.models import FAMILIES, build_model
    from titanlite.parallel.compile import apply_compile

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    plan = FAMILIES["moe"].plan
    args = model_args("moe", "debugmoe", 256, 16)
    model, reference = (build_model("moe", args).to_empty(device="cpu") for _ in range(2))
    for m in (model, reference):
        m.init_weights(0)
    for experts in plan.experts(model) + plan.experts(reference):
        experts.kernel = "loop"
    block = model.layers["1"]
    assert plan.compile_units(block, False) == [block.attention, block.feed_forward.router, block.feed_forward.shared_experts]
    apply_compile(model, plan, False, collectives_in_graph=False, backend="eager")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(6))
    for m in (model, reference):
        m(tokens).float().pow(2).mean().backward()
    torch.testing.assert_close(model.layers["1"].feed_forward.router.gate.weight.grad,
                               reference.layers["1"].feed_forward.router.gate.weight.grad, rtol=1e-5, atol=1e-6)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames >= 3, frames  # attention, router, shared experts (the dense block's too)
