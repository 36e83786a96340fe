"""Where a dataset's documents come from, decided without torch or `datasets`, so `run_train.sh`
can check a config before any process starts: the built-in corpus, local files, the hub, or token
files (a prepared folder, a Megatron prefix, OLMo numpy files: formats.py reads them)."""

from __future__ import annotations

import codecs
import glob
import gzip
import json
import os
import socket
import zlib
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from urllib.parse import urlparse

from titanlite.config import JobConfig
from titanlite.data.formats import MANIFEST, PROGRESS, TokenStream, open_megatron, open_numpy, open_prepared
from titanlite.data.mixture import Part, parse_mixture, source_name
from titanlite.errors import ConfigError

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".npy": "numpy"}
TOKEN_KINDS = ("prepared", "megatron", "numpy")  # read by offset from token files, not tokenized


@dataclass(frozen=True)
class Source:
    kind: str  # "builtin", "files", "hub", or one of TOKEN_KINDS
    name: str  # the dataset name, or the local location
    files: tuple[str, ...] = ()
    builder: str = ""  # the `datasets` builder of local files
    subset: str | None = None  # the hub dataset's configuration (e.g. allenai/c4's "en")
    split: str | None = None  # the hub split to read, where the name fixes it


# TorchTitan's dataset names: c4 streams from the hub; c4_test is a file in TorchTitan's own repo.
TORCHTITAN_DATASETS = {
    "c4": Source("hub", "allenai/c4", subset="en", split="train"),
    "c4_validation": Source("hub", "allenai/c4", subset="en", split="validation"),
}


def local_files(path: str) -> list[str]:
    """A file, a folder (every supported file in it) or a glob -> sorted file list."""
    if os.path.isdir(path):
        return [str(p) for p in sorted(Path(path).rglob("*")) if p.is_file() and file_builder(str(p))]
    return sorted(glob.glob(path))


def file_builder(path: str) -> str | None:
    if path.endswith((".jsonl.gz", ".json.gz")):
        return "json"
    return BUILDERS.get(Path(path).suffix)


SNIFF_BYTES = 1 << 16


def format_problem(path: str, builder: str) -> str | None:
    """What is wrong with a local data file, judged from its first bytes (its name says its format), or
    None: unreadable, empty, binary, not gzip, not UTF-8, not JSON lines, not parquet."""
    try:
        return _content_problem(Path(path), builder)
    except (OSError, EOFError, zlib.error) as e:
        return f"unreadable ({getattr(e, 'strerror', None) or e})"


def _content_problem(raw: Path, builder: str) -> str | None:
    size = raw.stat().st_size
    if size == 0:
        return "empty"
    with open(raw, "rb") as f:
        head = f.read(SNIFF_BYTES)
        if builder == "parquet":
            f.seek(max(size - 4, 0))
            marks = head[:4] == f.read(4) == b"PAR1" and size >= 8
            return None if marks else "not a parquet file (no PAR1 marks at its start and end)"
    if raw.name.endswith(".gz"):
        if head[:2] != b"\x1f\x8b":
            return "not gzip-compressed, though its name ends in .gz"
        with gzip.open(raw, "rb") as f:
            head = f.read(SNIFF_BYTES)
        if not head:
            return "empty once decompressed"
    if b"\0" in head:
        return "binary, not text"
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < SNIFF_BYTES)
    except UnicodeDecodeError as e:
        return f"not UTF-8 text (byte {e.start})"
    text = text.removeprefix("\ufeff")  # a byte-order mark: pyarrow's JSON reader skips it
    if builder == "json":
        first = text.lstrip()[:1]
        if first not in ("{", "["):
            return f"not JSON lines (it starts with {text.lstrip()[:20]!r})"
        line = text.lstrip().split("\n", 1)
        if first == "{" and len(line) == 2:
            try:
                json.loads(line[0])
            except ValueError as e:
                return f"not JSON lines (its first line: {e})"
    return None


def check_files_readable(files: list[str], key: str) -> None:
    for path in files:
        problem = format_problem(path, file_builder(path))
        if problem:
            raise ConfigError(
                f"{key}: data file '{path}' is {problem}; give .jsonl/.json (JSON lines), .jsonl.gz, .parquet or UTF-8 "
                ".txt files whose contents match their names"
            )


def check_hub_reachable(name: str, section: str = "training") -> None:
    """Fail in seconds, not minutes, when the hub cannot be reached (datasets retries for ~6 minutes)."""
    hint = f"{section}.dataset='{name}' is a Hugging Face hub dataset"
    fix = "use a local path (file, folder or glob of .jsonl/.jsonl.gz/.parquet/.txt) or the built-in 'shakespeare'"
    if any(os.environ.get(flag, "0") not in ("0", "") for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        raise ConfigError(f"{hint}, but HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set; {fix}")
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=3).close()
    except OSError as e:
        raise ConfigError(f"{hint}, but {endpoint.hostname} is unreachable ({e}); {fix}")


def resolve_source(name: str, path: str | None, section: str = "training") -> Source:
    """The source of dataset `name` (read from local `path` when given); ConfigError (naming the keys of
    `section`) when a local path matches nothing, mixes file types, or the hub is out of reach."""
    if name == "shakespeare" and not path:
        return Source("builtin", name)
    if name == "c4_test" and not path:
        raise ConfigError(
            f"{section}.dataset='c4_test' is a test file of TorchTitan's repository (tests/assets/c4_test); point "
            f"{section}.dataset_path at a copy of it, or use the built-in 'shakespeare'"
        )
    if name in TORCHTITAN_DATASETS and not path:
        check_hub_reachable(name, section)
        return TORCHTITAN_DATASETS[name]
    location = os.path.expanduser(path or name)
    if os.path.isfile(os.path.join(location, MANIFEST)):
        return Source("prepared", location)
    if os.path.isfile(os.path.join(location, PROGRESS)):
        raise ConfigError(
            f"{section}.dataset_path='{location}' is a folder `python -m titanlite.data.prepare` has not finished (no "
            f"{MANIFEST}, a {PROGRESS}); run the same prepare command again to finish it"
        )
    prefix = location.removesuffix(".bin").removesuffix(".idx")
    if os.path.isfile(prefix + ".idx") or os.path.isfile(prefix + ".bin"):
        return Source("megatron", prefix)
    files = local_files(location)
    if files:
        builders = {file_builder(f) for f in files}
        if len(builders) != 1 or None in builders:
            raise ConfigError(
                f"{section}.dataset_path='{location}' mixes or lacks supported file types {sorted(builders, key=str)}; "
                "use one of .jsonl, .jsonl.gz, .parquet, .txt, or .npy token files"
            )
        if builders == {"numpy"}:
            return Source("numpy", location, tuple(files), "numpy")
        check_files_readable(files, f"{section}.dataset_path" if path else f"{section}.dataset")
        return Source("files", location, tuple(files), builders.pop())
    looks_local = name.startswith(("/", ".", "~")) or any(c in name for c in "*?[") or file_builder(name)
    if path or looks_local:
        raise ConfigError(f"{section}.dataset_path='{location}' matches no files; give an existing file, folder or glob")
    check_hub_reachable(name, section)
    return Source("hub", name)


def token_parts(config: JobConfig, split: str, source: Source | None = None) -> list[tuple[Part, Source]] | None:
    """The weighted token-file sources of the split (dataset_mixture's parts, or its one dataset at
    weight 1), or None where the split reads text (tokenized as it streams). `source`: the split's
    dataset, where the caller has resolved it already."""
    settings = config.training if split == "train" else config.validation
    key = f"{'training' if split == 'train' else 'validation'}.dataset_mixture"
    if not settings.dataset_mixture:
        source = source or split_source(config, split)
        return [(Part(source_name(source.name), Fraction(1), source.name), source)] if source.kind in TOKEN_KINDS else None
    parts = []
    for part in parse_mixture(settings.dataset_mixture, key):
        if not os.path.exists(part.path) and not glob.glob(part.path + "*"):
            raise ConfigError(f"{key}: source '{part.path}' does not exist; fix the path or drop the part")
        source = resolve_source(part.path, part.path, key.split(".")[0])
        if source.kind not in TOKEN_KINDS:
            raise ConfigError(
                f"{key}: source '{part.path}' is text ({source.kind}); a mixture reads token files: prepare it first "
                "with `python -m titanlite.data.prepare`, or give a Megatron prefix or OLMo .npy files"
            )
        parts.append((part, source))
    return parts


def split_source(config: JobConfig, split: str) -> Source:
    """The source of the training or validation split. Validation reads `validation.dataset(_path)`,
    else the held-out part of the training dataset, which only the built-in corpus and the hub have."""
    t, v = config.training, config.validation
    if split == "validation" and (v.dataset or v.dataset_path):
        return resolve_source(v.dataset or t.dataset, v.dataset_path, "validation")
    source = resolve_source(t.dataset, t.dataset_path)
    if split == "validation" and (source.kind == "files" or source.kind in TOKEN_KINDS):
        raise ConfigError(
            f"validation.enable=true but validation.dataset is empty and training.dataset='{t.dataset}' is local "
            "files with no held-out part; set validation.dataset, validation.dataset_path or validation.dataset_mixture"
        )
    return source


def open_token_parts(parts: list[tuple[Part, Source]], tokenizer, seq_len: int, key: str) -> list[TokenStream]:
    """Each part's token stream, checked against the run: a prepared folder's tokenizer and vocabulary,
    the same tokenizer across a mixture, at least one whole window per source; ConfigError naming `key`."""
    streams = []
    for part, source in parts:
        if source.kind == "prepared":
            stream = open_prepared(Path(source.name), part.name)
        elif source.kind == "megatron":
            stream = open_megatron(source.name, part.name)
        else:
            stream = open_numpy(list(source.files), part.name, tokenizer.vocab_size)
        if stream.tokens < seq_len + 1:
            raise ConfigError(
                f"{key}: source '{part.path}' holds {stream.tokens} tokens, less than one window of seq_len + 1 = "
                f"{seq_len + 1}; give more data or a shorter seq_len"
            )
        streams.append(stream)
    prepared = [(part, s.made_with) for (part, _), s in zip(parts, streams) if s.made_with]
    for (part, made_with), (other, other_made_with) in zip(prepared, prepared[1:]):
        if (made_with["vocab_size"], made_with["sha256"]) != (other_made_with["vocab_size"], other_made_with["sha256"]):
            raise ConfigError(
                f"{key}: sources '{part.path}' and '{other.path}' were prepared with different tokenizers (vocabulary "
                f"{made_with['vocab_size']} vs {other_made_with['vocab_size']}); prepare them with one tokenizer"
            )
    for part, made_with in prepared:
        if (made_with["vocab_size"], made_with["sha256"]) != (tokenizer.vocab_size, tokenizer.fingerprint):
            raise ConfigError(
                f"{key}: '{part.path}' was prepared with another tokenizer (vocabulary {made_with['vocab_size']}, "
                f"sha256 {made_with['sha256'][:12]}) than this run's (vocabulary {tokenizer.vocab_size}, sha256 "
                f"{tokenizer.fingerprint[:12]}); set model.hf_assets_path='{made_with['location']}' or prepare it again"
            )
    return streams
