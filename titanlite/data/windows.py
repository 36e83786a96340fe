"""Windows of token files: global sample n -> (source, window) -> this rank's rows, Stateful.

Global microbatch k holds samples k*G .. k*G+G-1 (G = local batch x data-parallel ranks), and rank
r reads rows r*B .. r*B+B-1 of it, as the text path does with data_split='sequences'; every rank
computes its own rows from the sample index, and the state is one number (the next global sample),
so a resume is exact on any data-parallel degree. A source's j-th sample is, with the shuffle,
window perm_e(j mod M) of epoch e = j div M (M whole windows; perm a seeded bijection, new each
epoch); without it, the source is read as an endless loop of its stream, window after window, as
the text path reads its documents again and again.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset, get_worker_info

from titanlite.data.formats import TokenStream
from titanlite.data.mixture import Schedule
from titanlite.errors import ConfigError

class Permutation:
    """A seeded bijection of range(size) without a table: a 4-round Feistel network on the smallest
    even number of bits that covers `size`, cycle-walking values that land past it. Memory does not
    grow with the dataset."""

    def __init__(self, size: int, seed: tuple[int, ...]):
        bits = max(2, (size - 1).bit_length())
        self.half = (bits + 1) // 2
        self.size, self.mask = size, np.uint64((1 << self.half) - 1)
        self.keys = np.random.SeedSequence(list(seed)).generate_state(4, dtype=np.uint64)

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        out = self._rounds(np.asarray(positions, dtype=np.uint64))
        outside = out >= self.size
        while outside.any():  # a bijection's cycle returns into range(size) within a few steps
            out[outside] = self._rounds(out[outside])
            outside = out >= self.size
        return out.astype(np.int64)

    def _rounds(self, x: np.ndarray) -> np.ndarray:
        half = np.uint64(self.half)
        left, right = x >> half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (mix(right ^ key) & self.mask)
        return (left << half) | right


def mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: every input bit changes about half of the output bits."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)  # uint64 arrays wrap silently
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class SourceWindows:
    """Where the j-th sample of one source starts in its stream."""

    def __init__(self, stream: TokenStream, index: int, window: int, shuffle: bool, seed: int):
        self.stream, self.index, self.window, self.shuffle, self.seed = stream, index, window, shuffle, seed
        self.whole = stream.tokens // window  # windows of one epoch with the shuffle
        self.permutations: dict[int, Permutation] = {}

    def starts(self, js: np.ndarray) -> np.ndarray:
        """Where samples `js` of this source start in its stream (looped: modulo its length)."""
        if not self.shuffle:  # an endless loop of the stream
            return js * self.window % self.stream.tokens
        epochs, positions = np.divmod(js, self.whole)
        starts = np.empty_like(js)
        for epoch in np.unique(epochs):
            if epoch not in self.permutations:
                self.permutations = {epoch: Permutation(self.whole, (self.seed, self.index, int(epoch)))}
            starts[epochs == epoch] = self.permutations[epoch](positions[epochs == epoch]) * self.window
        return starts

    def read(self, start: int) -> np.ndarray:
        if self.shuffle:
            return self.stream.read(start, self.window)
        return self._read_looped(start)

    def _read_looped(self, start: int) -> np.ndarray:
        pieces, needed = [], self.window
        while needed:
            piece = self.stream.read(start, min(needed, self.stream.tokens - start))
            pieces.append(piece)
            needed -= len(piece)
            start = 0
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


class MixedWindows(IterableDataset, Stateful):
    """Yields this rank's (inputs, labels) microbatches, (batch, seq_len) each, of the mixed sources.
    `limit`: stop before the first global microbatch that needs a sample past it (validation reads
    each window once)."""

    def __init__(
        self, streams: list[TokenStream], weights: list[Fraction], seq_len: int, batch: int, rank: int, ranks: int,
        shuffle: bool, seed: int, vocab_size: int, limit: int | None = None,
    ):
        self.sources = [SourceWindows(s, i, seq_len + 1, shuffle, seed) for i, s in enumerate(streams)]
        self.schedule = Schedule(weights)
        self.batch, self.rank, self.ranks, self.limit = batch, rank, ranks, limit
        self.vocab_size = vocab_size
        self.sample = 0  # the next global microbatch's first sample (all ranks' rows counted)
        self.worker_sample: int | None = None  # a loader worker's own position, once it has one

    def __iter__(self):
        worker = get_worker_info()
        worker_id, workers = (worker.id, worker.num_workers) if worker else (0, 1)
        rows = self.batch * self.ranks
        if self.worker_sample is None:  # worker w of W yields microbatches w, w+W, ... (the loader interleaves them)
            self.worker_sample = self.sample + worker_id * rows
        while self.limit is None or self.worker_sample + rows <= self.limit:
            first = self.worker_sample + self.rank * self.batch
            tokens = self.read(np.arange(first, first + self.batch))
            self.worker_sample += workers * rows
            self.sample = self.worker_sample if workers == 1 else self.sample
            yield tokens[:, :-1], tokens[:, 1:]

    def read(self, samples: np.ndarray) -> torch.Tensor:
        sources, indices = self.schedule.locate(samples)
        starts = np.empty_like(indices)
        for s in np.unique(sources):
            starts[sources == s] = self.sources[s].starts(indices[sources == s])
        out = np.empty((len(samples), self.sources[0].window), dtype=np.int64)
        for row, (s, start) in enumerate(zip(sources, starts)):
            out[row] = self.sources[s].read(int(start))  # widened to int64 as it is copied
        if out.min() < 0 or out.max() >= self.vocab_size:  # else an index error deep in the embedding (a device assert on GPU)
            row = int(np.flatnonzero((out < 0).any(1) | (out >= self.vocab_size).any(1))[0])
            name = self.sources[sources[row]].stream.name
            raise ConfigError(
                f"token files of source '{name}' hold ids outside this run's vocabulary of {self.vocab_size} (from "
                f"{int(out[row].min())} to {int(out[row].max())}); they were written for another tokenizer or dtype"
            )
        return torch.from_numpy(out)

    def samples_per_source(self, samples: int) -> np.ndarray:
        return self.schedule.counts(samples)

    def state_dict(self) -> dict:
        return {"sample": self.sample, "worker_sample": self.worker_sample}

    def load_state_dict(self, state: dict) -> None:
        self.sample, self.worker_sample = state["sample"], state["worker_sample"]
