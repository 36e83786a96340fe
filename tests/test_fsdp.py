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
