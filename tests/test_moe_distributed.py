"""FSDP of routed experts on 4 gloo ranks: where the ranks outnumber a rank's experts they are
sharded along dim 1 (dim 0 would pad each rank to a whole expert), and each block's forward starts
the next block's expert all-gather with its own. Their losses and gradients are parity cases."""

import pytest

from distributed import run_calls


def _experts_units(num_experts: int, ep: int = 2, param_dtype: str = "float32") -> tuple:
    from dataclasses import replace

    from torch.distributed.fsdp import FSDPModule

    from titanlite.config import parse_args
    from titanlite.models import FAMILIES, build_model, model_args
    from titanlite.parallel.dims import ParallelDims
    from titanlite.parallel.parallelize import parallelize

    config = parse_args(["--model.name", "moe", "--model.flavor", "debugmoe", "--parallelism.expert_parallel_degree", str(ep),
                         "--training.mixed_precision_param", param_dtype])
    dims = ParallelDims.from_config(config, 4)
    dims.build_mesh("cpu")
    plan = FAMILIES["moe"].plan
    model = build_model("moe", replace(model_args("moe", "debugmoe", 256, 32), num_experts=num_experts))
    parallelize(model, plan, dims, config, "cpu")
    placements = {name: [str(pl) for pl in p.placements] for name, p in model.named_parameters() if ".experts." in name or "gate" in name}
    names = {id(m): name for name, m in model.named_modules()}
    prefetch = {names[id(m)]: [names[id(s._modules[0])] for s in m._get_fsdp_state()._states_to_forward_prefetch]
                for m in model.modules() if isinstance(m, FSDPModule)}
    return placements, prefetch


UNIT_LAYOUTS = [(2,), (4,), (8, 4), (8, 4, "bfloat16")]  # _experts_units' arguments


@pytest.fixture(scope="module")
def units() -> dict:
    """Rank 0's placements and prefetches of every layout of UNIT_LAYOUTS, from one launch of 4 ranks."""
    results = run_calls(4, [(_experts_units, *layout) for layout in UNIT_LAYOUTS], timeout=300)
    return {layout: values[0] for layout, values in zip(UNIT_LAYOUTS, results)}


@pytest.mark.slow
@pytest.mark.parametrize("num_experts, fsdp_placement", [(2, "S(1)"), (4, "_S(0, 2)")])  # _S: dim 0 within EP's shard
def test_experts_shard_along_dim_1_where_ranks_outnumber_them(units, num_experts, fsdp_placement):
    """EP 2 on 4 ranks: each expert is FSDP-sharded over 2 ranks (efsdp). One local expert (2 in all):
    dim 1; two local experts: dim 0, as before."""
    placements, prefetch = units[(num_experts,)]
    # (efsdp's FSDP placement, then EP's Shard(0) over experts.)
    assert placements["layers.1.feed_forward.experts.w1"] == [fsdp_placement, "S(0)"]
    assert placements["layers.3.feed_forward.experts.w2"] == [fsdp_placement, "S(0)"]
    # Each unit starts the next block's all-gather and that of its experts (a unit of their own).
    assert prefetch["tok_embeddings"] == ["layers.0"]
    assert prefetch["layers.0"] == ["layers.1", "layers.1.feed_forward.experts"]
    assert prefetch["layers.2"] == ["layers.3", "layers.3.feed_forward.experts"]
    assert prefetch["layers.3"] == ["norm"]


@pytest.mark.slow
def test_experts_no_other_rank_holds_are_left_to_expert_parallel(units):
    """EP 4 on 4 ranks: every rank holds other experts (efsdp 1), so FSDP has nothing to gather or sum
    for them: they are no unit of their own, no block's unit holds them, and they keep EP's placement
    alone. Parity: moe_ep4_aux and the EP 2 cases on 2 ranks. Under bf16 mixed precision they stay a
    unit: FSDP's cast copy is freed after each block's forward, a cast in the layer would live until
    its backward."""
    placements, prefetch = units[(8, 4)]
    assert placements["layers.1.feed_forward.experts.w1"] == ["S(0)"]
    assert placements["layers.3.feed_forward.experts.w2"] == ["S(0)"]
    assert placements["layers.1.feed_forward.router.gate.weight"] == ["S(0)"]  # FSDP's, on the 4 data ranks
    assert not any(".experts" in name for name in prefetch) and prefetch["layers.0"] == ["layers.1"]
    placements, prefetch = units[(8, 4, "bfloat16")]
    assert len(placements["layers.1.feed_forward.experts.w1"]) == 2  # FSDP's (one rank) and EP's
    assert prefetch["layers.0"] == ["layers.1", "layers.1.feed_forward.experts"]


COLLECTIVES = ("all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_gather")


def _collectives_in_backward(dataset: str, folder: str, overrides: list[str]) -> dict:
    """Collectives and host reads that MoE code (parallel/expert.py, parallel/context.py) runs while
    backward runs, over 2 training steps; FSDP's own reductions are not counted."""
    import sys
    from collections import Counter

    import torch
    import torch.distributed as dist

    from helpers import tiny_args
    from titanlite.config import parse_args
    from titanlite.train import train
    from titanlite.trainer import Trainer

    calls = Counter()

    def moe_caller() -> str | None:
        frame = sys._getframe(2)
        while frame is not None:
            path = frame.f_code.co_filename
            if path.endswith(("titanlite/parallel/expert.py", "titanlite/parallel/context.py")):
                return path.rsplit("/", 1)[-1]
            frame = frame.f_back
        return None

    def counted(name, run):
        def wrapper(*args, **kwargs):
            caller = moe_caller()
            if caller and torch._C._current_graph_task_id() != -1:
                calls[f"{caller}:{name}"] += 1
            return run(*args, **kwargs)
        return wrapper

    originals = {name: getattr(dist, name) for name in COLLECTIVES}
    tolist = torch.Tensor.tolist
    for name in COLLECTIVES:
        setattr(dist, name, counted(name, originals[name]))
    torch.Tensor.tolist = counted("tolist", tolist)
    try:  # the launch runs other calls after this one: they see torch's own functions again
        trainer = Trainer(parse_args(tiny_args(dataset, folder, "--training.steps", "2", *overrides)), torch.device("cpu"))
        train(trainer)
    finally:
        for name, run in originals.items():
            setattr(dist, name, run)
        torch.Tensor.tolist = tolist
    return {"calls": dict(calls), "moe_layers": len(trainer.moe_layers)}


EP2 = ["--model.name", "moe", "--model.flavor", "debugmoe", "--parallelism.expert_parallel_degree", "2"]
EP2_GLOBAL_AUX = EP2 + ["--model.moe_aux_loss_coeff", "0.01", "--model.moe_aux_loss_type", "global_batch"]
RECOMPUTE = {"op": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
             "full": ["--activation_checkpoint.mode", "full"]}


@pytest.fixture(scope="module")
def ep2_runs(corpus_jsonl, tmp_path_factory) -> dict:
    """Every rank's values of the EP 2 runs below (each AC mode's backward, the shared experts' overlap),
    from one launch of 2 ranks."""
    folder = tmp_path_factory.mktemp("ep2")
    calls = {f"recompute_{mode}": (_collectives_in_backward, str(corpus_jsonl), str(folder / mode), EP2_GLOBAL_AUX + ac)
             for mode, ac in RECOMPUTE.items()}
    calls["shared_experts"] = (_shared_experts_while_tokens_travel, str(corpus_jsonl), str(folder / "shared"), EP2)
    return dict(zip(calls, run_calls(2, list(calls.values()), timeout=300)))


@pytest.mark.slow
@pytest.mark.parametrize("mode, token_exchanges", [("op", 2), ("full", 4)])
def test_recompute_runs_no_moe_communication(ep2_runs, mode, token_exchanges):
    """Under activation checkpointing backward reruns each block's forward. Its expert-parallel
    count all-to-all, the host read of the split sizes and the global-batch loss's all-reduce of
    counts are never rerun. Under the op policy neither are the token all-to-alls: backward runs
    only their own backward, one all-to-all each way per MoE layer and step (2 steps); full
    checkpointing exchanges the tokens again (2 more) rather than keep them."""
    for run in ep2_runs[f"recompute_{mode}"]:
        assert run["calls"] == {"expert.py:all_to_all_single": token_exchanges * 2 * run["moe_layers"]}, run


def _shared_experts_while_tokens_travel(dataset: str, folder: str, overrides: list[str]) -> dict:
    """For each forward of each MoE layer's shared experts over 2 training steps: whether expert
    parallel's token all-to-all was still in flight (launched, not yet waited for)."""
    import torch

    from helpers import tiny_args
    from titanlite.config import parse_args
    from titanlite.train import train
    from titanlite.trainer import Trainer

    trainer = Trainer(parse_args(tiny_args(dataset, folder, "--training.steps", "2", *overrides)), torch.device("cpu"))
    seen = []
    for layer in trainer.moe_layers:
        layer.shared_experts.register_forward_pre_hook(lambda module, args, experts=layer.experts: seen.append(bool(experts.tokens_in_flight)))
    train(trainer)
    return {"seen": seen, "moe_layers": len(trainer.moe_layers)}


@pytest.mark.slow
def test_shared_experts_run_while_the_dispatch_all_to_all_is_in_flight(ep2_runs):
    """EP 2: every MoE layer's shared experts run between the launch of the tokens' all-to-all and its
    wait, once per forward (2 steps of one forward each; validation forwards too where they run)."""
    for run in ep2_runs["shared_experts"]:
        assert len(run["seen"]) >= 2 * run["moe_layers"] > 0 and all(run["seen"]), run
