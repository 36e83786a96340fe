"""torch.compile without graph breaks: what parallelize compiles in each family's blocks (a whole
block, MoE blocks included, their routed experts as one grouped GEMM) traces as one graph per unit,
causal and under document masks, with activation checkpointing (per-op and full) and float8 linears
and grouped GEMMs. Graph breaks are counted through dynamo (`counters["graph_break"]`), forward and
backward, on CPU.

Where a MoE layer cannot be one graph (`MoE.traces_whole`) its routed experts stay outside the
compiled units: `test_a_moe_block_on_the_expert_loop_breaks_only_where_named` names the break, and
expert parallel's host-read split sizes are the same kind of break."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch
from torch._dynamo.utils import counters

from titanlite.models import FAMILIES, model_args

FAMILY_FLAVORS = [("llama3", "debugmodel"), ("qwen3", "debugmodel"), ("moe", "debugmoe"), ("deepseek_v3", "debugmodel"),
                  ("llama4", "debugmodel"), ("gpt_oss", "debugmodel")]
SEQ = 32


def small_model(family: str, flavor: str, block_causal: bool):
    """The family's debug flavor on CPU (two blocks of each kind it has), as the trainer builds it
    there: SDPA, masks built from positions."""
    args = replace(model_args(family, flavor, 320, SEQ), attn_type="sdpa",
                   attn_mask_type="block_causal" if block_causal else "causal")
    if family == "gpt_oss":
        args = replace(args, sliding_window=8)
    model = FAMILIES[family].plan.build(args)
    model.init_weights(seed=0)
    return model


def compiled_model(family: str, flavor: str, block_causal: bool, ac_mode: str, float8: bool, whole_blocks: bool | None,
                   expert_kernel: str = "grouped"):
    """The debug model with the blocks' compile units compiled without inductor (aot_eager: dynamo's
    graphs and AOTAutograd's backward, run eagerly). `whole_blocks`: True checks that the units are
    whole blocks; None compiles whole blocks whatever the units."""
    from titanlite.config import parse_args
    from titanlite.float8 import convert_to_float8
    from titanlite.float8_grouped import convert_experts_to_float8
    from titanlite.parallel.activation_checkpoint import apply_ac

    torch._dynamo.reset()
    counters.clear()
    model = small_model(family, flavor, block_causal)
    plan = FAMILIES[family].plan
    for experts in plan.experts(model):
        experts.kernel = expert_kernel
    if float8:
        convert_to_float8(model, "tensorwise", ["output", *plan.float8_excluded], emulate=True)
        convert_experts_to_float8(model, ["experts"])  # gpt-oss's experts (refused in float8) stay as they are
    if ac_mode != "none":
        apply_ac(model, plan, parse_args(["--activation_checkpoint.mode", ac_mode]).activation_checkpoint)
    for block in [*getattr(model, plan.blocks).values(), *(getattr(p, n) for p, n in plan.blocks_elsewhere(model))]:
        units = plan.compile_units(block, False)
        if whole_blocks:
            assert units == [block], f"{family}: parallelize compiles {[type(u).__name__ for u in units]}, not the whole block"
        for unit in [block] if whole_blocks is None else units:
            unit.compile(backend="aot_eager", fullgraph=False)
    return model


def forward_backward(model, block_causal: bool) -> None:
    tokens = torch.randint(0, 320, (2, SEQ), generator=torch.Generator().manual_seed(0))
    ids = (tokens % 7 == 0).cumsum(1) if block_causal else None
    positions = torch.arange(SEQ).expand(2, SEQ)
    extra = {}
    if getattr(model.args, "mtp_depth", 0):  # DeepSeek-V3's multi-token prediction: each depth's next tokens
        extra["future_tokens"] = torch.stack([tokens.roll(-k, 1) for k in range(1, model.args.mtp_depth + 1)], dim=-1)
    out = model(tokens, positions=positions, document_ids=ids, **extra)
    sum(t.float().square().mean() for t in (out if isinstance(out, tuple) else (out,))).backward()


def break_reasons(*args, **kwargs) -> Counter:
    """Graph breaks (reason -> count) of one forward and backward of `compiled_model(*args, **kwargs)`
    (block_causal is its third argument). Fails if no graph was compiled at all."""
    forward_backward(compiled_model(*args, **kwargs), args[2])
    assert counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    return Counter({reason: n for reason, n in counters["graph_break"].items()})


@pytest.mark.parametrize("family, flavor", FAMILY_FLAVORS, ids=[f for f, _ in FAMILY_FLAVORS])
@pytest.mark.parametrize("block_causal, ac_mode, float8", [(False, "selective", True), (True, "full", False)],
                         ids=["causal_ac_op_float8", "block_causal_ac_full"])
def test_every_block_compiles_whole_without_a_graph_break(family, flavor, block_causal, ac_mode, float8):
    assert break_reasons(family, flavor, block_causal, ac_mode, float8, whole_blocks=True) == Counter()


def test_a_moe_block_on_the_expert_loop_breaks_only_where_named():
    """On the exact loop over experts the MoE layer is not one graph: parallelize compiles the block's
    attention, router and shared experts, which trace whole; the whole block breaks where the loop
    reads each expert's count to the host (counts.tolist()), and nowhere else."""
    assert break_reasons("moe", "debugmoe", True, "full", False, whole_blocks=False, expert_kernel="loop") == Counter()
    reasons = break_reasons("moe", "debugmoe", True, "full", False, whole_blocks=None, expert_kernel="loop")
    assert reasons, "a MoE block on the loop traced without a break: let MoE.traces_whole take it whole"
    unexplained = [r for r in reasons if "_local_scalar_dense" not in r]
    assert unexplained == [], unexplained


def test_compiled_blocks_find_the_largest_logits_of_eager_ones():
    """QK-clip's largest logit per head (models/common/attention.py) from blocks compiled whole under
    full activation checkpointing, without a graph break, as eager blocks find them."""
    from titanlite.models.common.attention import CoreAttention

    found = []
    for compiled in (False, True):
        model = compiled_model("llama3", "debugmodel", True, "full", False, whole_blocks=True) if compiled else small_model("llama3", "debugmodel", True)
        cores = [m for m in model.modules() if isinstance(m, CoreAttention)]
        for core in cores:
            core.max_logits = torch.full((model.args.n_heads,), -torch.inf)
        forward_backward(model, block_causal=True)
        found.append(torch.stack([core.max_logits for core in cores]))
    assert counters["stats"]["unique_graphs"] > 0 and counters["graph_break"] == {}, dict(counters["graph_break"])
    assert torch.isfinite(found[0]).all()
    torch.testing.assert_close(found[1], found[0], rtol=1e-5, atol=1e-5)


def test_a_moe_layer_that_sums_counts_over_ranks_is_not_compiled_whole():
    """An aux loss whose counts are summed over ranks takes the sums through ForwardReplay (AC's
    recompute gets them back from a record), which asks whether backward is running: a graph break
    in a whole block, so such a layer keeps its units. Without an aux loss, or when only the other
    kind of loss's counts are summed, it compiles whole."""
    from titanlite.parallel.activation_checkpoint import ForwardReplay

    model = compiled_model("moe", "debugmoe", False, "full", False, whole_blocks=None)
    layers = FAMILIES["moe"].plan.moe_layers(model)
    replay = ForwardReplay()
    replay.active = True  # as apply_ac sets it

    def summed(counts):  # a one-rank sum, kept for recompute as parallel/context.py's is
        replay.begin()
        return replay(lambda: counts.clone())

    for layer in layers:
        layer.aux_loss_type, layer.reduce_batch_counts = "global_batch", summed
        assert layer.traces_whole()  # no aux loss: the sum is never taken
        layer.aux_loss_coeff = 0.01
        assert not layer.traces_whole()
        layer.aux_loss_type = "sequence"
        assert layer.traces_whole()  # its counts are summed over sequence ranks only: none here
        layer.aux_loss_type = "global_batch"
    forward_backward(model, block_causal=False)
    assert any("_current_graph_task_id" in reason for reason in counters["graph_break"]), dict(counters["graph_break"])


def test_a_compiled_attention_inside_an_eager_checkpoint_adds_no_logits_in_recompute():
    """Under TP (and in a MoE block kept in parts) attention is compiled alone inside an eager
    checkpoint: backward reruns its graph, and the largest logits must not take the recompute's (in
    a pipeline stage's shape inference, logits of activations nothing wrote)."""
    from torch.utils.checkpoint import checkpoint

    from titanlite.models.common.attention import CoreAttention

    torch._dynamo.reset()
    core = CoreAttention()
    core.max_logits = torch.full((4,), -torch.inf)
    core.compile(backend="aot_eager", fullgraph=True)
    q, k, v = (torch.randn(1, 4, 8, 16, requires_grad=True) for _ in range(3))
    out = checkpoint(core, q, k, v, None, use_reentrant=False)
    assert torch.isfinite(core.max_logits).all()
    core.max_logits.fill_(-torch.inf)  # what recompute adds shows
    out.sum().backward()
    assert q.grad is not None and torch.isneginf(core.max_logits).all(), core.max_logits


@pytest.mark.parametrize("kernel, line", [
    ("grouped", "compiled units: 4 TransformerBlock"),
    ("loop", "compiled units: 1 TransformerBlock, 3 Attention, 3 Router, 3 FeedForward"),
])
def test_the_log_says_what_compiles(kernel, line):
    """parallelize's compile step (nothing traced yet: compiling is lazy) on the debug MoE model under
    full AC, and the trainer's log line: its dense block and MoE blocks whole, or the MoE blocks in
    pieces (attention, router, shared experts) when the experts run the loop."""
    from titanlite.config import parse_args
    from titanlite.parallel.activation_checkpoint import apply_ac
    from titanlite.parallel.compile import apply_compile, compiled_units_line

    model, plan = small_model("moe", "debugmoe", False), FAMILIES["moe"].plan
    for experts in plan.experts(model):
        experts.kernel = kernel
    apply_ac(model, plan, parse_args(["--activation_checkpoint.mode", "full"]).activation_checkpoint)
    apply_compile(model, plan, tp_enabled=False, collectives_in_graph=False, backend="aot_eager")
    assert compiled_units_line([model]) == line
