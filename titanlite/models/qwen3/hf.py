"""Qwen3's Hugging Face mapping (Qwen3ForCausalLM): Llama 3's names and RoPE layout
(models/llama3/hf.py) with Qwen3's config: its head dim and no sliding window. Tied embeddings leave
lm_head.weight out of the files, as transformers saves them. The Qwen3-MoE flavors (models/moe/hf.py)
build on this."""

from __future__ import annotations

from pathlib import Path

import torch

from titanlite.checkpoint.hf import SHARD_BYTES, check_config_values, write_shards
from titanlite.models.common.args import ModelArgs
from titanlite.models.llama3 import hf as llama3_hf
from titanlite.models.llama3.hf import iter_hf  # noqa: F401 (the adapter's reader: Llama 3's names)


def transformer_config(args: ModelArgs, dtype: torch.dtype) -> dict:
    """config.json's keys of a Qwen3 decoder (dense or MoE)."""
    return llama3_hf.transformer_config(args, dtype) | {"use_sliding_window": False}


def hf_config(args: ModelArgs, dtype: torch.dtype) -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"} | transformer_config(args, dtype)


def expected_config(args: ModelArgs, config: dict) -> dict:
    """config.json key -> (the model's value, what the key means when a config leaves it out)."""
    return llama3_hf.expected_config(args, config) | {
        "head_dim": (args.head_dim, config["hidden_size"] // config["num_attention_heads"]),
        "use_sliding_window": (False, False),
    }


# ---- the adapter the checkpointer calls (ParallelPlan.hf) ----


def save_hf(read, sizes: dict[str, int], args: ModelArgs, folder: Path, dtype: torch.dtype, shard_bytes: int = SHARD_BYTES) -> None:
    write_shards(read, sizes, folder, dtype, lambda name, w: llama3_hf.to_hf_tensors(name, w, args), hf_config(args, dtype), shard_bytes)


def check_hf_shapes(config: dict, args: ModelArgs, folder: Path) -> None:
    """ConfigError naming the first config.json value that differs from the model being trained."""
    check_config_values(config, expected_config(args, config), folder)
