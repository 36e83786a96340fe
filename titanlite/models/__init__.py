"""Model registry: [model] name + flavor -> ModelArgs -> nn.Module."""

from __future__ import annotations

from dataclasses import replace

from titanlite.models.args import LLAMA3_FLAVORS, ModelArgs

MODEL_FLAVORS = {"llama3": LLAMA3_FLAVORS}


def model_args(name: str, flavor: str, vocab_size: int, seq_len: int, n_layers: int = 0) -> ModelArgs:
    """The flavor's shapes, with the tokenizer's vocab where the flavor leaves it open, a RoPE table
    as long as the training sequence, and `n_layers` blocks when > 0."""
    args = MODEL_FLAVORS[name][flavor].with_vocab(vocab_size)
    return replace(args, max_seq_len=seq_len, n_layers=n_layers or args.n_layers)


def build_model(args: ModelArgs):
    """Build on the meta device: no memory is spent until the parallelized model is materialized."""
    import torch

    from titanlite.models.llama import Transformer

    with torch.device("meta"):
        return Transformer(args)
