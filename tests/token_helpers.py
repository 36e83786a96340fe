"""The config and loader the token-file tests (test_token_data.py, test_token_formats.py) read
prepared folders with; conftest.py's token_folders fixture prepares three."""

from __future__ import annotations

import os

OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def config(*args: str):
    from titanlite.config import parse_args

    return parse_args(["--model.hf_assets_path", "byte", "--training.seq_len", "32", "--training.local_batch_size", "2", *args])


def loader(cfg, dp_rank: int = 0, dp_degree: int = 1):
    from titanlite.data.dataset import build_dataloader
    from titanlite.data.tokenizer import ByteTokenizer

    return build_dataloader(cfg, ByteTokenizer(), dp_rank, dp_degree)
