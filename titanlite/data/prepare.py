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
import collections
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
from titanlite.data.formats import MANIFEST, MANIFEST_FORMAT, PROGRESS, read_manifest, write_index
from titanlite.data.sources import TOKEN_KINDS, split_source
from titanlite.data.tokenizer import build_tokenizer
from titanlite.errors import ConfigError

CHUNK = 256  # documents per task handed to a worker

IN_FLIGHT = 4  # chunks per worker handed out ahead: the workers stay busy, memory stays bounded

_tokenizer, _dtype = None, None


def _start_worker(location: str, key: str, dtype: str) -> None:
    global _tokenizer, _dtype
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    _tokenizer, _dtype = build_tokenizer(location, key), np.dtype(dtype)


def _encode(texts: list[str]) -> list[np.ndarray]:
    return [np.asarray(_tokenizer.encode(text), dtype=_dtype) for text in texts]


def in_order(pool, chunks, workers: int):
    """Each chunk's tokens, in the chunks' order, with at most IN_FLIGHT x workers chunks out at once."""
    pending = collections.deque()
    for chunk in chunks:
        pending.append(pool.apply_async(_encode, (chunk,)))
        if len(pending) >= IN_FLIGHT * workers:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


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
        self.shards, self.documents, self.inputs = done["shards"], done["documents"], done["inputs"]  # finished ones
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0

    def add(self, ids: np.ndarray) -> None:
        self.pending.append(ids)
        self.pending_tokens += len(ids)
        if self.pending_tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        name = f"part-{len(self.shards):05d}"
        atomic_write(self.out / f"{name}.bin", np.concatenate(self.pending).tobytes())
        tmp = self.out / f"{name}.idx.tmp"
        write_index(tmp, self.dtype, np.array([len(p) for p in self.pending]))
        tmp.replace(self.out / f"{name}.idx")
        self.shards.append({
            "name": name, "tokens": self.pending_tokens, "documents": len(self.pending),
            "bin_sha256": sha256(self.out / f"{name}.bin"), "idx_sha256": sha256(self.out / f"{name}.idx"),
        })
        self.documents += len(self.pending)
        self.pending, self.pending_tokens = [], 0
        progress = {"shards": self.shards, "documents": self.documents, "inputs": self.inputs}
        atomic_write(self.out / PROGRESS, json.dumps(progress).encode())


def prepare(config: JobConfig, out: Path, split: str, workers: int, shard_tokens: int) -> dict:
    """Writes the shards and manifest of `split` into `out` (resuming a stopped run); the manifest."""
    from tqdm import tqdm

    from titanlite.data.dataset import open_source, readable

    source = split_source(config, split)
    if source.kind in TOKEN_KINDS:
        raise ConfigError(f"training.dataset: '{source.name}' is token files already; train from it directly")
    location, key = config.tokenizer
    tokenizer = build_tokenizer(location, key)
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    field = config.training.dataset_text_field
    # What the folder's bytes depend on: a resumed or repeated run must be given the same.
    where = str(Path(source.name).resolve()) if source.kind == "files" else source.name
    inputs = {"source": where, "split": split, "text_field": field, "tokenizer_sha256": tokenizer.fingerprint,
              "dtype": dtype.name, "shard_tokens": shard_tokens}
    if out.exists() and not out.is_dir():
        raise ConfigError(f"'{out}' is a file; give a folder to write the shards into")
    if (out / MANIFEST).is_file():
        check_same_inputs(out / MANIFEST, read_manifest(out).get("inputs"), inputs)
        print(f"{out} is already prepared from these inputs ({MANIFEST} present)", file=sys.stderr)
        return read_manifest(out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.tmp"):  # a write the last run did not finish
        stale.unlink()
    done = {"shards": [], "documents": 0, "inputs": inputs}
    if (out / PROGRESS).is_file():
        done = json.loads((out / PROGRESS).read_text())
        check_same_inputs(out / PROGRESS, done.get("inputs"), inputs)
    writer = ShardWriter(out, dtype, shard_tokens, done)
    documents = readable(open_source(source, split), source.name if source.kind == "files" else None)

    def texts():
        for doc in itertools.islice(documents, writer.documents, None):  # past those already written
            if field not in doc:
                raise ConfigError(f"training.dataset_text_field='{field}' is not a column of the dataset; columns: {sorted(doc)}")
            yield doc[field]

    remaining = texts()
    chunks = iter(lambda: list(itertools.islice(remaining, CHUNK)), [])
    bar = tqdm(unit="tok", unit_scale=True, desc=f"prepare {out.name}", file=sys.stderr, mininterval=1.0)
    start = time.perf_counter()
    if workers > 1:
        pool = get_context("spawn").Pool(workers, initializer=_start_worker, initargs=(location, key, dtype.name))
        encoded = in_order(pool, chunks, workers)  # the shards do not depend on the worker count
    else:
        _start_worker(location, key, dtype.name)
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
        "format": MANIFEST_FORMAT, "version": 1,
        "tokenizer": {"location": location, "vocab_size": tokenizer.vocab_size, "sha256": tokenizer.fingerprint,
                      "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id},
        "dtype": dtype.name, "tokens": sum(s["tokens"] for s in writer.shards), "documents": writer.documents,
        "shards": writer.shards, "inputs": inputs,
    }
    atomic_write(out / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    (out / PROGRESS).unlink(missing_ok=True)
    print(f"prepared {out}: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens ({dtype.name}) in "
          f"{len(writer.shards)} shard(s); this run tokenized {tokens:,} tokens in {seconds:.1f}s "
          f"({tokens / max(seconds, 1e-9):,.0f} tokens/s, {workers} process(es))", file=sys.stderr)
    return manifest


def check_same_inputs(path: Path, recorded: dict | None, inputs: dict) -> None:
    changed = [key for key in inputs if (recorded or {}).get(key) != inputs[key]]
    if changed:
        was = ", ".join(f"{key}={(recorded or {}).get(key)!r}" for key in changed)
        now = ", ".join(f"{key}={inputs[key]!r}" for key in changed)
        raise ConfigError(f"{path} records {was}, but this run has {now}; give the same inputs, or another folder")


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
