"""Token files on a memory map, one reader for three formats: a flat stream of token ids (documents
end to end, each carrying its BOS/EOS), read by offset, never tokenized.

- Megatron's indexed dataset, `prefix.bin` + `prefix.idx`, as megatron-core's IndexedDatasetBuilder
  writes it (megatron/core/datasets/indexed_dataset.py): the .bin is the sequences end to end; the
  .idx is the header b"MMIDIDX\\x00\\x00", version <Q (1), dtype code <B, sequence count <Q,
  document-index count <Q, then int32 sequence lengths, int64 byte pointers and int64 document
  indices (0, then the sequence count after each document).
- A folder prepared by `python -m titanlite.data.prepare`: manifest.json and Megatron pairs.
- OLMo-core's numpy token files: raw ids with no header despite `.npy`, EOS ending each document,
  the dtype the smallest unsigned one that holds the vocabulary (olmo_core/data/numpy_dataset.py);
  a `.csv.gz` beside a file lists its documents' (start, end) token offsets.
"""

from __future__ import annotations

import csv
import gzip
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from titanlite.errors import ConfigError

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
INDEX_HEAD = struct.Struct("<QBQQ")  # version, dtype code, sequences, document-index entries
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
FLOAT_CODES = (6, 7)  # Megatron writes them, but not for token ids
MANIFEST = "manifest.json"
PROGRESS = "progress.json"  # prepare's finished shards, until the manifest is written
MANIFEST_FORMAT = "titanlite-tokens"


@dataclass
class TokenStream:
    """The token files of one source, end to end: `read(start, n)` crosses file boundaries."""

    name: str
    files: list[Path]
    dtype: np.dtype
    sizes: list[int]  # tokens per file
    documents: int
    made_with: dict | None = None  # a prepared folder's tokenizer: vocab_size, sha256, location
    maps: list = field(default_factory=list, repr=False)

    def __post_init__(self):
        self.starts = np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)])
        self.tokens = int(self.starts[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        if not self.maps:  # opened on first read: in the process (or loader worker) that reads
            self.maps = [np.memmap(f, dtype=self.dtype, mode="r", shape=(n,)) if n else np.empty(0, self.dtype)
                         for f, n in zip(self.files, self.sizes)]
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        piece = self.maps[i][start - self.starts[i] : start - self.starts[i] + length]
        if len(piece) == length:
            return piece
        pieces = [piece]
        while sum(len(p) for p in pieces) < length:
            i += 1
            pieces.append(self.maps[i][: length - sum(len(p) for p in pieces)])
        return np.concatenate(pieces)


def bad(path, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"token file '{path}' {problem}; {fix}")


def read_index(idx: Path) -> tuple[np.dtype, np.ndarray, np.ndarray, int]:
    """(dtype, sequence lengths, byte pointers, documents) of a Megatron .idx; ConfigError when damaged."""
    remake = "rewrite it with Megatron's preprocess_data.py or `python -m titanlite.data.prepare`"
    with open(idx, "rb") as f:
        head = f.read(len(INDEX_HEADER) + INDEX_HEAD.size)
    if head[: len(INDEX_HEADER)] != INDEX_HEADER:
        raise bad(idx, "is not a Megatron index (no MMIDIDX header)", remake)
    if len(head) < len(INDEX_HEADER) + INDEX_HEAD.size:
        raise bad(idx, f"is {len(head)} bytes, shorter than a Megatron index's header", remake)
    version, code, sequences, document_entries = INDEX_HEAD.unpack(head[len(INDEX_HEADER) :])
    if version != INDEX_VERSION:
        raise bad(idx, f"has index version {version}; titanlite reads version {INDEX_VERSION}", remake)
    if code not in DTYPE_CODES or code in FLOAT_CODES:
        raise bad(idx, f"has dtype code {code}, not one of integer token ids", remake)
    expected = len(head) + sequences * (4 + 8) + document_entries * 8
    size = idx.stat().st_size
    if size not in (expected, expected + sequences):  # + one int8 mode per sequence when multimodal
        raise bad(idx, f"is {size} bytes, but its counts ({sequences} sequences) need {expected}", remake)
    if size > expected and np.memmap(idx, dtype=np.int8, mode="r", offset=expected, shape=(sequences,)).any():
        raise bad(idx, "holds multimodal sequences (a mode other than text)", "give text-only token files")
    lengths = np.memmap(idx, dtype=np.int32, mode="r", offset=len(head), shape=(sequences,))
    pointers = np.memmap(idx, dtype=np.int64, mode="r", offset=len(head) + 4 * sequences, shape=(sequences,))
    return np.dtype(DTYPE_CODES[code]), lengths, pointers, max(document_entries - 1, 0)


def open_megatron(prefix: str, name: str) -> TokenStream:
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    for path in (idx, bin_):
        if not path.is_file():
            raise bad(path, "does not exist", "a Megatron dataset is the pair PREFIX.bin and PREFIX.idx")
    dtype, lengths, pointers, documents = read_index(idx)
    tokens = int(lengths.sum(dtype=np.int64))
    size = bin_.stat().st_size
    contiguous = len(pointers) == 0 or int(pointers[-1]) + int(lengths[-1]) * dtype.itemsize == size
    if tokens * dtype.itemsize != size or not contiguous:
        raise bad(
            bin_, f"is {size} bytes, but {idx.name} counts {tokens} tokens of {dtype.itemsize} bytes",
            "the pair is truncated or mismatched: rewrite both files",
        )
    return TokenStream(name, [bin_], dtype, [tokens], documents)


def olmo_dtype(vocab_size: int) -> np.dtype:
    """OLMo-core's default: the smallest unsigned dtype that holds every token id."""
    return next(np.dtype(t) for t in (np.uint8, np.uint16, np.uint32, np.uint64) if vocab_size - 1 <= np.iinfo(t).max)


def open_numpy(files: list[str], name: str, vocab_size: int) -> TokenStream:
    dtype = olmo_dtype(vocab_size)
    sizes, documents = [], 0
    for file in map(Path, files):
        size = file.stat().st_size
        with open(file, "rb") as f:
            if f.read(6) == b"\x93NUMPY":
                raise bad(file, "is a numpy array with a header (np.save), not OLMo's raw token file",
                          "write the ids raw (array.tofile), as OLMo-core does")
        if size % dtype.itemsize:
            raise bad(file, f"is {size} bytes, not a whole number of {dtype} tokens (the vocabulary's size "
                      f"{vocab_size} gives {dtype})", "it is truncated, or was written for another tokenizer")
        sizes.append(size // dtype.itemsize)
        documents += numpy_documents(file, sizes[-1])
    return TokenStream(name, [Path(f) for f in files], dtype, sizes, documents)


def numpy_documents(file: Path, tokens: int) -> int:
    """Documents listed by the `.csv.gz` beside an OLMo file (0 when there is none: EOS marks them)."""
    metadata = file.with_suffix(".csv.gz")
    if not metadata.is_file():
        return 0
    try:
        with gzip.open(metadata, "rt") as f:
            rows = [row for row in csv.reader(f) if row]
        end = max((int(row[1]) for row in rows), default=0)
    except (OSError, EOFError, ValueError, IndexError) as e:
        raise bad(metadata, f"is not OLMo's document list ({type(e).__name__}: {str(e)[:100]})",
                  "it holds gzip-compressed 'start,end' lines, one per document; fix or remove it")
    if end > tokens:
        raise bad(file, f"holds {tokens} tokens, but {metadata.name} lists a document ending at {end}",
                  "the file is truncated: rewrite it")
    return len(rows)


def read_manifest(folder: Path) -> dict:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise bad(folder / MANIFEST, f"cannot be read ({e})", "prepare the folder again")
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise bad(folder / MANIFEST, "is not a titanlite manifest", "prepare the folder again")
    return manifest


def open_prepared(folder: Path, name: str) -> TokenStream:
    manifest = read_manifest(folder)
    try:
        shards = [(shard["name"], shard["tokens"]) for shard in manifest["shards"]]
        dtype, documents = np.dtype(manifest["dtype"]), manifest["documents"]
        made_with = {key: manifest["tokenizer"][key] for key in ("vocab_size", "sha256", "location")}
    except (KeyError, TypeError) as e:
        raise bad(folder / MANIFEST, f"lacks {e}", "prepare the folder again")
    streams = [open_megatron(str(folder / shard), name) for shard, _ in shards]
    for stream, (_, tokens) in zip(streams, shards):
        if stream.tokens != tokens or stream.dtype != dtype:
            raise bad(stream.files[0], f"holds {stream.tokens} {stream.dtype} tokens, the manifest says {tokens} {dtype}",
                      "prepare the folder again")
    return TokenStream(name, [s.files[0] for s in streams], dtype, [s.tokens for s in streams], documents, made_with)


def write_index(path: Path, dtype: np.dtype, lengths: np.ndarray) -> None:
    """A Megatron .idx for sequences of `lengths` tokens stored end to end, one document each."""
    lengths = np.asarray(lengths, dtype=np.int32)
    code = next(c for c, t in DTYPE_CODES.items() if np.dtype(t) == dtype)
    pointers = (np.cumsum(lengths, dtype=np.int64) - lengths) * dtype.itemsize
    documents = np.arange(len(lengths) + 1, dtype=np.int64)
    with open(path, "wb") as f:
        f.write(INDEX_HEADER + INDEX_HEAD.pack(INDEX_VERSION, code, len(lengths), len(documents)))
        for array in (lengths, pointers, documents):
            f.write(array.tobytes())
