"""Shared fixtures. Tests never touch the Hugging Face hub: offline flags are set for every process."""

import gzip
import json
import os
from pathlib import Path

import pytest

from helpers import documents_file, synthetic_documents

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("RAYON_NUM_THREADS", "2")

# Files whose tests race one process against another (a killed group restarts while the survivor
# trains on, a straggler, a hang's timeout, a host's death): scripts/test_full.sh runs them alone on
# the machine, after the others, which it runs two at a time.
RACES = {"test_fault_tolerance.py", "test_fault_tolerance_semi_sync.py", "test_fault_tolerance_netns.py",
         "test_multinode_netns.py", "test_health.py", "test_runtime.py"}


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in RACES:
            item.add_marker(pytest.mark.serial)
    # The parity launches first: two at a time, the longest file then starts at once, not last and alone.
    # Not every long file first: then they ran side by side (63e316e), and the parity launches took
    # 4-45% longer (two ranks 1292 s against 1083 in collection order).
    items.sort(key=lambda item: item.path.name != "test_parallel_parity.py")


@pytest.fixture(scope="session")
def corpus_jsonl(tmp_path_factory) -> Path:
    return documents_file(tmp_path_factory.mktemp("corpus") / "docs.jsonl")


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


@pytest.fixture(scope="session")
def token_folders(tmp_path_factory) -> dict[str, Path]:
    """Three prepared folders (web, code, math) of different sizes, and their text."""
    from titanlite.data.prepare import prepare as prepare_folder
    from token_helpers import config

    root = tmp_path_factory.mktemp("token_folders")
    out = {}
    for name, n, seed in (("web", 120, 1), ("code", 40, 2), ("math", 15, 3)):
        text = documents_file(root / f"{name}.jsonl", n, seed)
        prepare_folder(config("--training.dataset", str(text)), root / name, "train", 1, 1 << 28)
        out[name], out[f"{name}_text"] = root / name, text
    return out
