"""Shared fixtures. Tests never touch the Hugging Face hub: offline flags are set for every process."""

import gzip
import json
import os
from pathlib import Path

import pytest

from helpers import synthetic_documents

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("RAYON_NUM_THREADS", "2")

@pytest.fixture(scope="session")
def corpus_jsonl(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in synthetic_documents()))
    return path


@pytest.fixture(scope="session")
def corpus_formats(tmp_path_factory) -> dict[str, Path]:
    """The same documents as .jsonl, .jsonl.gz, .parquet, .txt files and an 8-shard folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("formats")
    docs = synthetic_documents()
    lines = "".join(json.dumps({"text": d}) + "\n" for d in docs)
    (root / "docs.jsonl").write_text(lines)
    with gzip.open(root / "docs.jsonl.gz", "wt") as f:
        f.write(lines)
    pq.write_table(pa.table({"text": docs}), root / "docs.parquet")
    (root / "txt").mkdir()
    for i, d in enumerate(docs):
        (root / "txt" / f"{i:04d}.txt").write_text(d)
    (root / "shards").mkdir()
    for shard in range(8):
        (root / "shards" / f"part-{shard}.jsonl").write_text(
            "".join(json.dumps({"text": d}) + "\n" for d in docs[shard::8])
        )
    return {
        "jsonl": root / "docs.jsonl",
        "jsonl.gz": root / "docs.jsonl.gz",
        "parquet": root / "docs.parquet",
        "txt": root / "txt",
        "shards": root / "shards",
    }
