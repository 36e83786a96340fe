"""Llama 3 shapes (no torch import: run_train.sh checks layouts against them before launching)."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    vocab_size: int = 128256  # 0 = take it from the tokenizer
    multiple_of: int = 1024  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = 1.3
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: bool = True  # Llama 3.1 long-context frequency scaling
    max_seq_len: int = 131072
    depth_init: bool = True  # scale output projections' init std by depth

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def block_params(self) -> int:
        """wq, wk, wv, wo, w1, w2, w3 and the two norms of one TransformerBlock."""
        return 2 * self.dim * self.dim + 2 * self.dim * self.kv_dim + 3 * self.dim * self.ffn_hidden_dim + 2 * self.dim

    def num_params(self, exclude_embedding: bool = False) -> int:
        embedding = 0 if exclude_embedding else self.vocab_size * self.dim
        return embedding + self.n_layers * self.block_params + self.dim + self.dim * self.vocab_size  # + norm, output

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 per non-embedding weight, plus attention scores and values.

        12 * layers * heads * head_dim * seq_len counts QK^T and AV (2 matmuls x 2 FLOPs x 3 for
        forward + backward) without halving for the causal mask, as PaLM, nanoGPT and TorchTitan do.
        """
        return 6 * self.num_params(exclude_embedding=True) + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len

    def with_vocab(self, tokenizer_vocab: int) -> "ModelArgs":
        """Flavors with vocab_size 0 take the tokenizer's, padded to a multiple of 64 so the embedding
        and output split evenly under tensor parallel (and matmuls align)."""
        return self if self.vocab_size else replace(self, vocab_size=-(-tokenizer_vocab // 64) * 64)


# Meta's published shapes (Llama 3.1); debugmodel follows TorchTitan's, with the tokenizer's vocab.
LLAMA3_FLAVORS = {
    "debugmodel": ModelArgs(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=16, vocab_size=0, multiple_of=256, ffn_dim_multiplier=None
    ),
    # The debug model with grouped-query attention (4 query heads per kv head), as the big flavors have.
    "debugmodel_gqa": ModelArgs(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=4, vocab_size=0, multiple_of=256, ffn_dim_multiplier=None
    ),
    "8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, multiple_of=1024, ffn_dim_multiplier=1.3),
    "70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, multiple_of=4096, ffn_dim_multiplier=1.3),
    "405B": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, multiple_of=4096, ffn_dim_multiplier=1.2),
}


def check_llama3(args: ModelArgs, tp: int) -> None:
    """Tensor parallel splits attention by heads: both head counts must divide by tp."""
    from titanlite.config import ConfigError

    for name, value in (("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads)):
        if value % tp:
            raise ConfigError(
                f"parallelism.tensor_parallel_degree={tp} does not divide the model's {name}={value}; "
                f"choose a divisor of {value}"
            )
