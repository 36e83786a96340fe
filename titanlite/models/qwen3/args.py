"""Qwen3's dense flavors: the published config.json shapes (Qwen/Qwen3-0.6B ... Qwen3-32B) and debug
presets with every feature on. All have GQA with 8 kv heads, heads of 128, q/k RMSNorm with weights,
RoPE theta 1e6 unscaled; 0.6B, 1.7B and 4B tie the output projection to the embedding."""

from __future__ import annotations

from dataclasses import replace

from titanlite.models.common.args import ModelArgs


def _qwen3(dim: int, n_layers: int, n_heads: int, hidden: int, tied: bool) -> ModelArgs:
    return ModelArgs(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8, head_dim_override=128, qk_norm=True,
        dense_hidden_dim=hidden, tie_embeddings=tied, vocab_size=151936, norm_eps=1e-6, rope_theta=1000000.0,
        rope_scaling=False, max_seq_len=40960,
    )


# Heads wider than dim / n_heads (8 x 64 against 256), as Qwen3's are; the vocabulary is the tokenizer's.
DEBUG = ModelArgs(
    dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim_override=64, qk_norm=True, dense_hidden_dim=768,
    vocab_size=0, norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=False,
)
QWEN3_FLAVORS = {
    "debugmodel": DEBUG,
    "debugmodel_tied": replace(DEBUG, tie_embeddings=True),
    "0.6B": _qwen3(1024, 28, 16, 3072, tied=True),
    "1.7B": _qwen3(2048, 28, 16, 6144, tied=True),
    "4B": _qwen3(2560, 36, 32, 9728, tied=True),
    "8B": _qwen3(4096, 36, 32, 12288, tied=False),
    "14B": _qwen3(5120, 40, 40, 17408, tied=False),
    "32B": _qwen3(5120, 64, 64, 25600, tied=False),
}
