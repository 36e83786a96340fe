"""Model registry: [model] name -> ModelFamily; + flavor -> ModelArgs -> nn.Module.

Torch-free: config.py and run_train.sh's checks read the families' flavors and shape checks.
"""

from __future__ import annotations

from dataclasses import replace

from titanlite.models.args import LLAMA3_FLAVORS, ModelArgs, check_llama3
from titanlite.models.family import ModelFamily

FAMILIES = {
    "llama3": ModelFamily("llama3", LLAMA3_FLAVORS, check_llama3, "titanlite.models.llama_parallel"),
}


def model_args(name: str, flavor: str, vocab_size: int, seq_len: int, n_layers: int = 0) -> ModelArgs:
    """The flavor's shapes, with the tokenizer's vocab where the flavor leaves it open, a RoPE table
    as long as the training sequence, and `n_layers` blocks when > 0."""
    args = FAMILIES[name].flavors[flavor].with_vocab(vocab_size)
    return replace(args, max_seq_len=seq_len, n_layers=n_layers or args.n_layers)


def build_model(name: str, args: ModelArgs):
    """Build on the meta device: no memory is spent until the parallelized model is materialized."""
    import torch

    with torch.device("meta"):
        return FAMILIES[name].plan.build(args)
