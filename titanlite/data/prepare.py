"""Tokenize a dataset once into token shards: `python -m titanlite.data.prepare OUT [config options]`.

Reads what training would read (`--training.dataset`, `--training.dataset_path`, the run's
tokenizer `--model.hf_assets_path`, or a `--job.config_file`), tokenizes over `--workers`
processes, and writes OUT/part-NNNNN.bin/.idx (Megatron's indexed format: uint16 ids where the
vocabulary fits, else uint32; one sequence per document, BOS and EOS included) and, last,
OUT/manifest.json (tokenizer hash, vocabulary, token and document counts, sha256 per file).
Shards appear by atomic rename and progress.json records the finished ones, so a killed run
resumes where it stopped; the same input gives the same bytes. `--verify OUT` checks the sums.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import sys
import time
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from titanlite.config import JobConfig, parse_args
from titanlite.data.formats import MANIFEST, MANIFEST_FORMAT, read_manifest, write_index
from titanlite.data.sources import TOKEN_KINDS, split_source
from titanlite.data.tokenizer import build_tokenizer
from titanlite.errors import ConfigError

PROGRESS = "progress.json"
CHUNK = 256  # documents per task handed to a worker

_tokenizer = None


def _start_worker(location: str, key: str) -> None:
    global _tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    _tokenizer = build_tokenizer(location, key)


def _encode(texts: list[str]) -> list[list[int]]:
    return [_tokenizer.encode(text) for text in texts]


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


class ShardWriter:
    """Collects documents' tokens and writes a shard once it holds `shard_tokens`."""

    def __init__(self, out: Path, dtype: np.dtype, shard_tokens: int, done: dict):
        self.out, self.dtype, self.shard_tokens = out, dtype, shard_tokens
        self.shards, self.documents = done["shards"], done["documents"]  # finished ones
        self.pending: list[np.ndarray] = []

    def add(self, ids: list[int]) -> None:
        self.pending.append(np.asarray(ids, dtype=self.dtype))
        if sum(len(p) for p in self.pending) >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        name = f"part-{len(self.shards):05d}"
        atomic_write(self.out / f"{name}.bin", np.concatenate(self.pending).tobytes())
        tmp = self.out / f"{name}.idx.tmp"
        write_index(tmp, self.dtype, np.array([len(p) for p in self.pending]))
        tmp.replace(self.out / f"{name}.idx")
        tokens = sum(len(p) for p in self.pending)
        self.shards.append({
            "name": name, "tokens": tokens, "documents": len(self.pending),
            "bin_sha256": sha256(self.out / f"{name}.bin"), "idx_sha256": sha256(self.out / f"{name}.idx"),
        })
        self.documents += len(self.pending)
        self.pending = []
        atomic_write(self.out / PROGRESS, json.dumps({"shards": self.shards, "documents": self.documents}).encode())


def prepare(config: JobConfig, out: Path, split: str, workers: int, shard_tokens: int) -> dict:
    """Writes the shards and manifest of `split` into `out` (resuming a stopped run); the manifest."""
    from tqdm import tqdm

    from titanlite.data.dataset import open_source, readable

    if (out / MANIFEST).is_file():
        print(f"{out} is already prepared ({MANIFEST} present)", file=sys.stderr)
        return read_manifest(out)
    source = split_source(config, split)
    if source.kind in TOKEN_KINDS:
        raise ConfigError(f"training.dataset: '{source.name}' is token files already; train from it directly")
    location, key = config.tokenizer
    tokenizer = build_tokenizer(location, key)
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.tmp"):  # a write the last run did not finish
        stale.unlink()
    done = json.loads((out / PROGRESS).read_text()) if (out / PROGRESS).is_file() else {"shards": [], "documents": 0}
    writer = ShardWriter(out, dtype, shard_tokens, done)
    field = config.training.dataset_text_field
    documents = readable(open_source(source, split), source.name if source.kind == "files" else None)

    def texts():
        for doc in itertools.islice(documents, writer.documents, None):  # past those already written
            if field not in doc:
                raise ConfigError(f"training.dataset_text_field='{field}' is not a column of the dataset; columns: {sorted(doc)}")
            yield doc[field]

    chunks = iter(lambda: list(itertools.islice(texts_iter, CHUNK)), [])
    texts_iter = texts()
    bar = tqdm(unit="tok", unit_scale=True, desc=f"prepare {out.name}", file=sys.stderr, mininterval=1.0)
    start = time.perf_counter()
    if workers > 1:
        pool = get_context("spawn").Pool(workers, initializer=_start_worker, initargs=(location, key))
        encoded = pool.imap(_encode, chunks)  # in order: the shards do not depend on the worker count
    else:
        _start_worker(location, key)
        pool, encoded = None, map(_encode, chunks)
    tokens = 0
    try:
        for batch in encoded:
            for ids in batch:
                writer.add(ids)
            tokens += sum(len(ids) for ids in batch)
            bar.update(sum(len(ids) for ids in batch))
        writer.flush()
    finally:
        if pool is not None:
            pool.terminate()
        bar.close()
    seconds = time.perf_counter() - start
    manifest = {
        "format": MANIFEST_FORMAT, "version": 1, "source": source.name, "split": split, "text_field": field,
        "tokenizer": {"location": location, "vocab_size": tokenizer.vocab_size, "sha256": tokenizer.fingerprint,
                      "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id},
        "dtype": dtype.name, "tokens": sum(s["tokens"] for s in writer.shards), "documents": writer.documents,
        "shards": writer.shards,
    }
    atomic_write(out / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    (out / PROGRESS).unlink(missing_ok=True)
    print(f"prepared {out}: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens ({dtype.name}) in "
          f"{len(writer.shards)} shard(s); this run tokenized {tokens:,} tokens in {seconds:.1f}s "
          f"({tokens / max(seconds, 1e-9):,.0f} tokens/s, {workers} process(es))", file=sys.stderr)
    return manifest


def verify(out: Path) -> None:
    manifest = read_manifest(out)
    for shard in manifest["shards"]:
        for suffix in ("bin", "idx"):
            path = out / f"{shard['name']}.{suffix}"
            if not path.is_file() or sha256(path) != shard[f"{suffix}_sha256"]:
                raise ConfigError(f"token file '{path}' is missing or does not match its sha256 in {MANIFEST}; prepare "
                                  "the folder again")
    print(f"{out}: {len(manifest['shards'])} shard(s) match the manifest's sha256", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m titanlite.data.prepare", description=__doc__.split("\n\n")[0],
        epilog="Other options are the run's config keys (--job.config_file, --training.dataset, ...).",
    )
    parser.add_argument("out", type=Path, help="the folder to write (train from it with --training.dataset_path OUT)")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="tokenizing processes (default: all cores)")
    parser.add_argument("--split", default="train", choices=("train", "validation"),
                        help="validation: the dataset's held-out part (or validation.dataset)")
    parser.add_argument("--shard_tokens", type=int, default=1 << 28, help="tokens per shard file (default 2^28)")
    parser.add_argument("--verify", action="store_true", help="only check a prepared folder's files against its sha256")
    args, rest = parser.parse_known_args(argv)
    try:
        if args.verify:
            return verify(args.out)
        if args.workers < 1 or args.shard_tokens < 1:
            raise ConfigError(f"--workers={args.workers} and --shard_tokens={args.shard_tokens} must be >= 1")
        prepare(parse_args(rest), args.out, args.split, args.workers, args.shard_tokens)
    except ConfigError as e:
        print(f"prepare: {e}", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
