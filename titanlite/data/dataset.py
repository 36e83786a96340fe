"""Text datasets: built-in corpus, local files, Hugging Face hub streaming; packing; a stateful loader.

Documents are tokenized with BOS/EOS, concatenated, and cut into non-overlapping `seq_len + 1`
windows (input = window[:-1], labels = window[1:]). Each data-parallel rank reads a disjoint part
(`split_dataset_by_node`). The loader's state (stream position + token buffer + epoch) is saved
and restored exactly.
"""

from __future__ import annotations

import glob
import os
import socket
import warnings
from pathlib import Path
from urllib.parse import urlparse

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from titanlite.config import ConfigError, JobConfig
from titanlite.data.corpus import shakespeare_files
from titanlite.data.tokenizer import Tokenizer

# torchdata 0.11 calls a deprecated torch API on every loader; nothing for users to act on.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")

BUILDERS = {".jsonl": "json", ".json": "json", ".gz": "json", ".parquet": "parquet", ".txt": "text"}


def _local_files(path: str) -> list[str]:
    """A file, a folder (every supported file in it) or a glob -> sorted file list."""
    if os.path.isdir(path):
        files = [str(p) for p in sorted(Path(path).rglob("*")) if p.is_file() and _builder(str(p))]
    else:
        files = sorted(glob.glob(path))
    return files


def _builder(path: str) -> str | None:
    if path.endswith((".jsonl.gz", ".json.gz")):
        return "json"
    suffix = Path(path).suffix
    return BUILDERS.get(suffix) if suffix != ".gz" else None


def _check_hub_reachable(name: str) -> None:
    """Fail in seconds, not minutes, when the hub cannot be reached (datasets retries for ~6 minutes)."""
    hint = f"training.dataset='{name}' is a Hugging Face hub dataset"
    fix = "use a local path (file, folder or glob of .jsonl/.jsonl.gz/.parquet/.txt) or the built-in 'shakespeare'"
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "") or os.environ.get("HF_DATASETS_OFFLINE", "0") not in (
        "0",
        "",
    ):
        raise ConfigError(f"{hint}, but HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set; {fix}")
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=3).close()
    except OSError as e:
        raise ConfigError(f"{hint}, but {endpoint.hostname} is unreachable ({e}); {fix}")


def load_documents(name: str, path: str, split: str):
    """A streaming `datasets.IterableDataset` of documents for a dataset name (+ optional local path)."""
    from datasets import load_dataset

    if name == "shakespeare" and not path:
        return load_dataset("json", data_files=str(shakespeare_files()[split]), split="train", streaming=True)
    location = os.path.expanduser(path or name)
    files = _local_files(location)
    if files:
        builders = {_builder(f) for f in files}
        if len(builders) != 1 or None in builders:
            raise ConfigError(
                f"training.dataset_path='{location}' mixes or lacks supported file types {sorted(builders, key=str)}; "
                "use one of .jsonl, .jsonl.gz, .parquet, .txt"
            )
        builder = builders.pop()
        kwargs = {"sample_by": "document"} if builder == "text" else {}
        return load_dataset(builder, data_files=files, split="train", streaming=True, **kwargs)
    looks_local = name.startswith(("/", ".", "~")) or any(c in name for c in "*?[") or _builder(name)
    if path or looks_local:
        raise ConfigError(f"training.dataset_path='{location}' matches no files; give an existing file, folder or glob")
    _check_hub_reachable(name)
    return load_dataset(name, split=split, streaming=True)


class TokenWindows(IterableDataset, Stateful):
    """Packs tokenized documents into (input, label) windows of seq_len; resumable exactly.

    With ranks > 1 the stream is split by windows: consecutive blocks of `block` windows go to
    ranks 0, 1, ... in turn, so rank r's batch k holds rows r*B..(r+1)*B-1 of the global batch k
    that one process with batch ranks*B would see.
    """

    def __init__(
        self,
        documents,
        tokenizer: Tokenizer,
        seq_len: int,
        text_field: str = "text",
        infinite: bool = True,
        rank: int = 0,
        ranks: int = 1,
        block: int = 1,
    ):
        self.documents, self.tokenizer, self.seq_len = documents, tokenizer, seq_len
        self.text_field, self.infinite = text_field, infinite
        self.rank, self.ranks, self.block = rank, ranks, block
        self._start = documents.state_dict()
        self._buffer: list[int] = []
        self.epoch = 0
        self.windows = 0  # windows cut from the stream so far, all ranks' included

    def __iter__(self):
        window = self.seq_len + 1
        while True:
            for doc in self.documents:
                if self.text_field not in doc:
                    raise ConfigError(
                        f"training.dataset_text_field='{self.text_field}' is not a column of the dataset; "
                        f"columns: {sorted(doc)}"
                    )
                self._buffer.extend(self.tokenizer.encode(doc[self.text_field]))
                while len(self._buffer) >= window:
                    tokens = torch.tensor(self._buffer[:window], dtype=torch.long)
                    self._buffer = self._buffer[window:]
                    mine = (self.windows // self.block) % self.ranks == self.rank
                    self.windows += 1
                    if mine:
                        yield tokens[:-1], tokens[1:]
            if not self.infinite:
                return
            self.epoch += 1
            # A resumed HF stream restarts from its loaded state; rewind it to the beginning.
            self.documents.load_state_dict(self._start)

    def state_dict(self) -> dict:
        return {
            "documents": self.documents.state_dict(),
            "buffer": list(self._buffer),
            "epoch": self.epoch,
            "windows": self.windows,
        }

    def load_state_dict(self, state: dict) -> None:
        self.documents.load_state_dict(state["documents"])
        self._buffer, self.epoch, self.windows = list(state["buffer"]), state["epoch"], state["windows"]


def build_dataloader(
    config: JobConfig, tokenizer: Tokenizer, dp_rank: int, dp_degree: int, split: str = "train"
) -> StatefulDataLoader:
    """The loader of one data-parallel rank. tp/cp/pp peers pass the same dp_rank and read the same rows."""
    from datasets.distributed import split_dataset_by_node

    t, v = config.training, config.validation
    name, path = t.dataset, t.dataset_path
    if split == "validation":
        if v.dataset or v.dataset_path:
            name, path = v.dataset or t.dataset, v.dataset_path
        elif _local_files(path or name):
            raise ConfigError(
                f"validation.enable=true but validation.dataset is empty and training.dataset='{t.dataset}' is local "
                "files with no held-out part; set validation.dataset or validation.dataset_path"
            )
    documents = load_documents(name, path, split)
    if t.data_split == "documents":
        documents = split_dataset_by_node(documents, rank=dp_rank, world_size=dp_degree)
        dp_rank, dp_degree = 0, 1  # this rank's documents are all its own
    windows = TokenWindows(
        documents, tokenizer, t.seq_len, t.dataset_text_field, split == "train", dp_rank, dp_degree, t.local_batch_size
    )
    return StatefulDataLoader(windows, batch_size=t.local_batch_size, num_workers=0)
