"""FSDP2 as titanlite applies it (titanlite/parallel/fsdp.py), beyond the parity suite's fp32 layouts."""

import pytest

from distributed import run_calls, run_distributed
from helpers import tiny_args


def _dtypes_reaching_a_bf16_block(dataset: str, folder: str) -> dict:
    import torch

    from titanlite.config import parse_args
    from titanlite.trainer import Trainer

    trainer = Trainer(parse_args(tiny_args(dataset, folder, "--training.mixed_precision_param", "bfloat16")), torch.device("cpu"))
    seen = {}
    attention = trainer.model_parts[0].layers["0"].attention
    attention.register_forward_pre_hook(lambda module, args: seen.update(hidden=str(args[0].dtype), rope=str(args[1].dtype)))
    tokens = torch.randint(0, 256, (2, 32))
    loss = trainer.forward(tokens, tokens, backward=True)
    return seen | {"finite": bool(torch.isfinite(loss))}


@pytest.mark.slow
def test_bf16_mixed_precision_leaves_the_rope_rows_in_fp32(corpus_jsonl, tmp_path):
    """FSDP computes in bf16, but does not cast the blocks' inputs: RoPE's cos/sin rows stay fp32."""
    (seen,) = run_distributed(_dtypes_reaching_a_bf16_block, 1, str(corpus_jsonl), str(tmp_path))
    assert seen == {"hidden": "torch.bfloat16", "rope": "torch.float32", "finite": True}


def _reduce_scatters_of_a_step(dataset: str, folder: str) -> dict:
    import torch
    import torch.distributed as dist
    from titanlite.config import parse_args
    from titanlite.parallel.fsdp import AllToAllReduceScatter
    from titanlite.trainer import Trainer

    summed = []
    original = AllToAllReduceScatter.__call__

    def counted(self, *args, **kwargs):
        call = dict(zip(("output_tensor", "input_tensor", "group", "op", "async_op"), args)) | kwargs
        summed.append(call["op"] == dist.ReduceOp.SUM and not call.get("async_op"))  # the all-to-all path
        return original(self, *args, **kwargs)

    AllToAllReduceScatter.__call__ = counted
    try:
        trainer = Trainer(parse_args(tiny_args(dataset, folder)), torch.device("cpu"))
        tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
        trainer.forward(tokens, tokens, backward=True)
    finally:
        AllToAllReduceScatter.__call__ = original
    model = trainer.model_parts[0]
    units_with_parameters = 1 + len(model.layers) + 1  # the embedding, each block, norm + output (the root holds none)
    return {"calls": len(summed), "all_to_all": all(summed), "units": units_with_parameters}


@pytest.mark.slow
def test_fsdp_on_gloo_reduces_gradients_through_the_all_to_all(corpus_jsonl, tmp_path):
    """Each FSDP unit's gradient reduce-scatter of a backward goes through AllToAllReduceScatter (one
    call per unit that holds parameters), not gloo's whole all-reduce."""
    for seen in run_distributed(_reduce_scatters_of_a_step, 2, str(corpus_jsonl), str(tmp_path)):
        assert seen["calls"] == seen["units"] > 0 and seen["all_to_all"], seen


def _fallbacks_match_gloos_own() -> list:
    """Another op (MAX) and an asynchronous call take gloo's own reduce-scatter."""
    import torch
    import torch.distributed as dist

    from titanlite.parallel.fsdp import AllToAllReduceScatter

    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = torch.randint(-1000, 1000, (world * 5,), generator=torch.Generator().manual_seed(rank)).float()
    maximum, expected = torch.empty(5), torch.empty(5)
    dist.reduce_scatter_tensor(expected, inputs.clone(), op=dist.ReduceOp.MAX)
    AllToAllReduceScatter()(maximum, inputs.clone(), dist.group.WORLD, dist.ReduceOp.MAX)
    summed, expected_sum = torch.empty(5), torch.empty(5)
    dist.reduce_scatter_tensor(expected_sum, inputs.clone())
    work = AllToAllReduceScatter()(summed, inputs.clone(), dist.group.WORLD, dist.ReduceOp.SUM, async_op=True)
    work.wait()
    return [torch.equal(maximum, expected), torch.equal(summed, expected_sum)]


@pytest.fixture(scope="module")
def reduce_scatters_on_3_ranks() -> dict:
    """Both checks of the reduce-scatter against gloo's own, from one launch of 3 ranks."""
    fallbacks, sums = run_calls(3, [(_fallbacks_match_gloos_own,), (_both_reduce_scatters,)])
    return {"fallbacks": fallbacks, "sums": sums}


@pytest.mark.slow
def test_the_reduce_scatters_fallback_is_gloos_own(reduce_scatters_on_3_ranks):
    assert reduce_scatters_on_3_ranks["fallbacks"] == [[True, True]] * 3


def _both_reduce_scatters() -> list:
    import torch
    import torch.distributed as dist

    from titanlite.parallel.fsdp import AllToAllReduceScatter

    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for numel_per_rank in (1, 1000):
        # Whole numbers: every order of addition gives the same float, so the two must match exactly.
        inputs = torch.randint(-1000, 1000, (world * numel_per_rank,), generator=torch.Generator().manual_seed(rank)).float()
        expected, got = torch.empty(numel_per_rank), torch.full((numel_per_rank,), float("nan"))
        dist.reduce_scatter_tensor(expected, inputs.clone())
        AllToAllReduceScatter()(got, inputs, dist.group.WORLD, dist.ReduceOp.SUM)
        results.append(torch.equal(got, expected))
    return results


@pytest.mark.slow
def test_the_all_to_all_reduce_scatter_sums_like_gloos_own(reduce_scatters_on_3_ranks):
    """The reduce-scatter FSDP runs on CPU gives each rank the sum of its slice (3 ranks, 2 sizes)."""
    assert reduce_scatters_on_3_ranks["sums"] == [[True, True]] * 3
