"""Text datasets: built-in corpus, local files, Hugging Face hub streaming; packing; a stateful loader.

Documents are tokenized with BOS/EOS, concatenated, and cut into non-overlapping `seq_len + 1`
windows (input = window[:-1], labels = window[1:]). Each data-parallel rank reads a disjoint part
(`split_dataset_by_node`). The loader's state (stream position + token buffer + epoch) is saved
and restored exactly.
"""

from __future__ import annotations

import warnings
from fractions import Fraction

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from titanlite.config import JobConfig
from titanlite.errors import ConfigError
from titanlite.data.corpus import shakespeare_files
from titanlite.data.sources import Source, open_token_parts, resolve_source, split_source, token_parts
from titanlite.data.tokenizer import Tokenizer
from titanlite.data.windows import MixedWindows

# torchdata 0.11 calls a deprecated torch API on every loader; nothing for users to act on.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")


def load_documents(name: str, path: str, split: str):
    """A streaming `datasets.IterableDataset` of documents for a dataset name (+ optional local path)."""
    return open_source(resolve_source(name, path), split)


def open_source(source: Source, split: str):
    from datasets import load_dataset

    if source.kind == "builtin":
        return load_dataset("json", data_files=str(shakespeare_files()[split]), split="train", streaming=True)
    if source.kind == "files":
        kwargs = {"sample_by": "document"} if source.builder == "text" else {}
        return load_dataset(source.builder, data_files=list(source.files), split="train", streaming=True, **kwargs)
    return load_dataset(source.name, source.subset, split=source.split or split, streaming=True)


def readable(documents, files: str | None):
    """The documents; from local `files`, a file that fails to parse past its first bytes (sources.py
    sniffs those) stops the run as a ConfigError naming them, not a traceback from inside `datasets`.
    A hub stream's errors (the network) pass through as they are."""
    if files is None:
        yield from documents
        return
    iterator, read = iter(documents), 0
    while True:
        try:
            doc = next(iterator)
        except StopIteration:
            return
        except Exception as e:  # pyarrow, json and gzip each raise their own
            reason = (str(e).strip().splitlines() or [""])[0][:200]
            raise ConfigError(
                f"dataset '{files}' could not be read after {read} documents ({type(e).__name__}: {reason}); fix or "
                "remove the damaged file"
            ) from None
        read += 1
        yield doc


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
        files: str | None = None,
    ):
        self.documents, self.tokenizer, self.seq_len = documents, tokenizer, seq_len
        self.files = files  # the local files' location, named when one fails to parse
        self.text_field, self.infinite = text_field, infinite
        self.rank, self.ranks, self.block = rank, ranks, block
        self._start = documents.state_dict()
        self._buffer: list[int] = []
        self.epoch = 0
        self.windows = 0  # windows cut from the stream so far, all ranks' included

    def __iter__(self):
        window = self.seq_len + 1
        while True:
            documents = 0
            for documents, doc in enumerate(readable(self.documents, self.files), 1):
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
            if documents == 0:  # another pass would read nothing again, forever
                raise ConfigError(
                    "training.dataset holds no document for this data-parallel rank (data_split='documents' gives each "
                    "rank its own documents, and there are too few); use more documents or training.data_split='sequences'"
                )
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
    config: JobConfig, tokenizer: Tokenizer, dp_rank: int, dp_degree: int, split: str = "train", part: int = 0
) -> StatefulDataLoader:
    """The loader of one data-parallel rank. tp/cp/pp peers pass the same dp_rank and read the same rows.
    Training reads [training] (batch, seq_len, [training.dataloader]); validation reads [validation],
    from token files one source (`part`) at a time."""
    from datasets.distributed import split_dataset_by_node

    t = config.training
    settings = t if split == "train" else config.validation
    loader = settings.dataloader
    source = None if settings.dataset_mixture else split_source(config, split)  # resolved once (the hub: a connection)
    parts = token_parts(config, split, source)
    if parts is not None:
        return token_loader(config, tokenizer, parts, dp_rank, dp_degree, split, part)
    documents = open_source(source, split)
    if t.data_split == "documents":
        documents = split_dataset_by_node(documents, rank=dp_rank, world_size=dp_degree)
        dp_rank, dp_degree = 0, 1  # this rank's documents are all its own
    if loader.num_workers > 1 and documents.num_shards < loader.num_workers:
        # `datasets` hands each loader worker whole files (shards); a worker without one reads nothing.
        key = "training" if split == "train" else "validation"
        raise ConfigError(
            f"{key}.dataloader.num_workers={loader.num_workers} but the {split} data has {documents.num_shards} "
            f"file(s) for this rank, and each worker reads whole files; use num_workers <= {max(documents.num_shards, 1)} "
            "or split the data into more files"
        )
    windows = TokenWindows(
        documents, tokenizer, settings.seq_len, t.dataset_text_field, split == "train", dp_rank, dp_degree,
        settings.local_batch_size, source.name if source.kind == "files" else None,
    )
    # drop_last: a partial batch would not split into pipeline microbatches, and ranks must agree on
    # the number of batches of a finite (validation) stream.
    return stateful_loader(windows, loader, settings.local_batch_size)


def token_loader(config: JobConfig, tokenizer: Tokenizer, parts, dp_rank: int, dp_degree: int, split: str, part: int):
    """Training: the sources mixed by weight, endless, shuffled per training.dataset_shuffle. Validation:
    source `part`'s windows once, in order. Either way the windows yield whole microbatches."""
    t = config.training
    settings, section = (t, "training") if split == "train" else (config.validation, "validation")
    key = f"{section}.dataset_mixture" if settings.dataset_mixture else f"{section}.dataset_path"
    streams = open_token_parts(parts, tokenizer, settings.seq_len, key)
    batch = settings.local_batch_size
    if split == "train":
        weights = [p.weight for p, _ in parts]
        windows = MixedWindows(
            streams, weights, t.seq_len, batch, dp_rank, dp_degree, t.dataset_shuffle, t.dataset_seed, tokenizer.vocab_size
        )
    else:
        whole = streams[part].tokens // (settings.seq_len + 1)
        windows = MixedWindows(
            [streams[part]], [Fraction(1)], settings.seq_len, batch, dp_rank, dp_degree, False, 0, tokenizer.vocab_size, whole
        )
    return stateful_loader(windows, settings.dataloader, None)


def stateful_loader(windows, loader, batch_size: int | None) -> StatefulDataLoader:
    """batch_size None: the windows yield whole microbatches themselves."""
    return StatefulDataLoader(
        windows,
        batch_size=batch_size,
        drop_last=batch_size is not None,
        num_workers=loader.num_workers,
        persistent_workers=loader.persistent_workers,
        pin_memory=loader.pin_memory and torch.cuda.is_available(),
        prefetch_factor=loader.prefetch_factor,
    )
