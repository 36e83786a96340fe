"""FSDP2 as titanlite applies it (titanlite/parallel/fsdp.py), beyond the parity suite's fp32 layouts."""

import pytest

from distributed import run_distributed
from helpers import tiny_args


def _dtypes_reaching_a_bf16_block(dataset: str, folder: str) -> dict:
    import torch

    from titanlite.config import parse_args
    from titanlite.train import Trainer

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
def test_the_all_to_all_reduce_scatter_sums_like_gloos_own():
    """The reduce-scatter FSDP runs on CPU gives each rank the sum of its slice (3 ranks, 2 sizes)."""
    assert run_distributed(_both_reduce_scatters, 3) == [[True, True]] * 3
