"""Reading a DCP checkpoint without trusting it.

DCP's `.metadata` file is a pickle, and DCP's own reader unpickles it with no limits. Here it is read
with an allow-list unpickler that builds DCP's metadata classes and nothing else, and sets state only
on instances it has just created (so a crafted file cannot change a class, an enum member or any
other object the process already holds). Then the metadata is checked against the folder before a
byte of tensor data is allocated or read:
  - every storage entry names a shard file DCP's writer would name (`__<rank>_<n>.distcp`), inside
    the checkpoint folder (a link may not lead out of it), with no transforms (titanlite writes none);
  - every shard file exists and is long enough for the entries it holds (a truncated or missing shard
    is refused, naming the file);
  - every tensor's chunks lie inside the tensor, cover it exactly once, and each fits in its stored
    bytes, and no two entries share bytes of a file, so no declared size can make loading allocate
    more than the files hold, or leave any of it unwritten.
Anything else is refused with a ConfigError naming the file; a damaged folder raises
DamagedCheckpoint, which the checkpointer turns into a line naming an earlier whole step.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from titanlite.checkpoint.paths import complete_steps, is_hf_checkpoint
from titanlite.errors import ConfigError

# The shard files DCP's FileSystemWriter writes: `__{rank}_{file index}.distcp`.
SHARD_FILE = re.compile(r"__[0-9]+_[0-9]+\.distcp")  # matched whole (fullmatch)

# What a DCP metadata pickle references: DCP's metadata classes, sizes, dtypes, layouts, paths.
METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata", "BytesStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # a layout by its name
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}
TORCH_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
# The classes whose fresh instances may take state (BUILD): DCP's metadata dataclasses.
BUILDABLE = (
    Metadata, MetadataIndex, ChunkStorageMetadata, TensorStorageMetadata, BytesStorageMetadata,
    dcp_metadata.TensorProperties, StorageMeta, _StorageInfo,
)


class DamagedCheckpoint(ConfigError):
    """A checkpoint folder whose files do not hold what its metadata says (missing, truncated, unreadable)."""

    def __init__(self, folder: Path, reason: str):
        super().__init__(f"checkpoint '{folder}' is damaged: {reason}")
        self.folder, self.reason = folder, reason


class _MetadataUnpickler(pickle._Unpickler):
    """The pure-Python unpickler (its opcodes can be overridden), limited to METADATA_GLOBALS. It sets
    state (BUILD) only on an instance of DCP's metadata classes that it created itself (NEWOBJ) in this
    file, and only that class's own fields: BUILD on anything else would change an object the whole
    process shares (a class, an enum member such as the memory-format encoding DCP saves with)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file):
        super().__init__(file)
        self._fresh: dict[int, object] = {}  # id -> instance NEWOBJ made (held, so ids stay unique)

    def find_class(self, module: str, name: str):
        if module == "torch" and name in TORCH_DTYPES:
            return TORCH_DTYPES[name]
        if name in METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it references {module}.{name}")

    def _remember_fresh(self) -> None:
        instance = self.stack[-1]
        if type(instance) in BUILDABLE:
            self._fresh[id(instance)] = instance

    def load_newobj(self):
        super().load_newobj()
        self._remember_fresh()

    def load_newobj_ex(self):
        super().load_newobj_ex()
        self._remember_fresh()

    def load_build(self):
        state, instance = self.stack[-1], self.stack[-2]
        if id(instance) not in self._fresh:
            raise pickle.UnpicklingError(f"it sets attributes of {instance!r}, which is not a DCP record it just made")
        if hasattr(type(instance), "__setstate__"):
            ok = isinstance(state, tuple)  # TensorProperties: its own __setstate__ unpacks a tuple
        else:
            fields = {f.name for f in dataclasses.fields(instance)}
            ok = isinstance(state, dict) and set(state) <= fields
        if not ok:
            raise pickle.UnpicklingError(f"it sets state {state!r} that {type(instance).__name__} does not have")
        super().load_build()

    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.BUILD[0]] = load_build


# Parsed and checked metadata by (file, modification time, size): preflight's check on each rank and
# the load that follows read it once (the pure-Python unpickler takes ~70 us a chunk).
_CHECKED: dict[tuple[Path, int, int], tuple[Metadata, dict[str, int]]] = {}


def read_metadata_safely(path: Path) -> Metadata:
    """DCP's metadata from `path` through the allow-list, checked against its folder (check_metadata);
    ConfigError naming the file for anything else (a crafted file could run code through pickle)."""
    try:
        stat = path.stat()
    except OSError:
        return _read_and_check(path)[0]  # refuses the missing or unreadable file, naming it
    key = (path.resolve(), stat.st_mtime_ns, stat.st_size)
    if key not in _CHECKED:
        _CHECKED[key] = _read_and_check(path)
    metadata, shard_ends = _CHECKED[key]
    check_shard_files(path.parent, shard_ends, path)  # every time: the shards may change, not the metadata
    return metadata


def _read_and_check(path: Path) -> tuple[Metadata, dict[str, int]]:
    if path.is_symlink() and path.resolve().parent != path.parent.resolve():
        _refuse(path, f"links outside its folder (to {path.resolve()})")
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise ConfigError(f"checkpoint path '{path.parent}' holds no complete DCP checkpoint (no {path.name})")
    except Exception as e:  # a malformed or hostile pickle fails in many ways; each one is refused
        if isinstance(e, EOFError) or "pickle exhausted" in str(e):  # the pickle stops mid-way
            raise DamagedCheckpoint(path.parent, f"its {path.name} file is truncated") from None
        metadata = e
    if not isinstance(metadata, Metadata):
        reason = metadata if isinstance(metadata, Exception) else f"it holds a {type(metadata).__name__}"
        raise ConfigError(
            f"checkpoint metadata '{path}' is not plain DCP metadata ({reason}); refusing to load it, since "
            "unpickling it could run code. Use a checkpoint written by torch.distributed.checkpoint"
        )
    return metadata, check_metadata(metadata, path)


def _refuse(path: Path, what: str):
    raise ConfigError(f"checkpoint metadata '{path}' {what}; refusing to load it. Use a checkpoint written by "
                      "torch.distributed.checkpoint")


def _is_size(value) -> bool:
    return isinstance(value, torch.Size) and all(isinstance(n, int) and n >= 0 for n in value)


def check_metadata(metadata: Metadata, path: Path) -> dict[str, int]:
    """The metadata's entries are DCP's, in shard files of the folder, and no tensor declares more
    bytes than its stored chunks hold (checked before anything is allocated). Returns each shard
    file's name and the byte its entries reach."""
    storage = metadata.storage_data
    if not isinstance(storage, dict) or not isinstance(metadata.state_dict_metadata, dict):
        _refuse(path, "has no storage table")
    ranges: dict[str, list[tuple[int, int, str]]] = {}  # shard file -> (start, end, entry) of its entries
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo) or not isinstance(index.fqn, str):
            _refuse(path, f"has a storage entry {index!r} that is not DCP's")
        name = info.relative_path
        if not isinstance(name, str) or not SHARD_FILE.fullmatch(name):
            _refuse(path, f"points entry '{index.fqn}' at '{name}', not a shard file of this folder (__<rank>_<n>.distcp)")
        if not (isinstance(info.offset, int) and isinstance(info.length, int) and info.offset >= 0 and info.length >= 0):
            _refuse(path, f"gives entry '{index.fqn}' the byte range {info.offset!r}+{info.length!r}")
        if info.transform_descriptors:
            _refuse(path, f"asks for transforms {info.transform_descriptors!r} on entry '{index.fqn}' (titanlite writes none)")
        ranges.setdefault(name, []).append((info.offset, info.offset + info.length, index.fqn))
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(key, str):
            _refuse(path, f"has an entry named {key!r}, not a string")
        if isinstance(entry, TensorStorageMetadata):
            _check_tensor(path, key, entry, storage)
        elif not isinstance(entry, BytesStorageMetadata):
            _refuse(path, f"describes entry '{key}' as a {type(entry).__name__}")
    for name, entries in sorted(ranges.items()):
        entries.sort()
        for (_, end, first), (start, _, second) in zip(entries, entries[1:]):
            if start < end:  # each entry its own bytes: shared bytes would load (and allocate) twice
                _refuse(path, f"stores entries '{first}' and '{second}' in overlapping bytes of {name}")
    return {name: max(end for _, end, _ in entries) for name, entries in ranges.items()}


def check_shard_files(folder: Path, shard_ends: dict[str, int], path: Path) -> None:
    """Every shard file is in the folder (a link may not lead out of it) and reaches its entries' end."""
    for name, end in sorted(shard_ends.items()):
        shard = folder / name
        if not shard.is_file():
            raise DamagedCheckpoint(folder, f"its shard file {name} is missing")
        if shard.resolve().parent != folder.resolve():  # a link may lead anywhere: the folder may not
            _refuse(path, f"has shard file {name} linking outside its folder (to {shard.resolve()})")
        have = shard.stat().st_size
        if have < end:
            raise DamagedCheckpoint(folder, f"its shard file {name} is truncated ({have} bytes; its entries reach byte {end})")


def _check_tensor(path: Path, key: str, entry: TensorStorageMetadata, storage: dict) -> None:
    dtype = getattr(entry.properties, "dtype", None)
    if not isinstance(dtype, torch.dtype) or not _is_size(entry.size) or not isinstance(entry.chunks, list):
        _refuse(path, f"describes tensor '{key}' with a malformed size or dtype")
    for chunk in entry.chunks:
        if not (isinstance(chunk, ChunkStorageMetadata) and _is_size(chunk.offsets) and _is_size(chunk.sizes)
                and len(chunk.offsets) == len(chunk.sizes) == len(entry.size)
                and all(o + s <= n for o, s, n in zip(chunk.offsets, chunk.sizes, entry.size))):
            _refuse(path, f"gives tensor '{key}' of size {list(entry.size)} a chunk outside it")
        info = storage.get(MetadataIndex(key, chunk.offsets))
        chunk_bytes = math.prod(chunk.sizes) * dtype.itemsize
        if info is None or chunk_bytes > info.length:
            stored = "no stored bytes" if info is None else f"{info.length} stored bytes"
            _refuse(path, f"declares {chunk_bytes} bytes for a chunk of tensor '{key}' with {stored}")
    if not _tiles_exactly(entry.size, entry.chunks):
        covered = sum(math.prod(chunk.sizes) for chunk in entry.chunks)
        _refuse(path, f"declares tensor '{key}' of size {list(entry.size)} but its chunks ({covered} elements) do not "
                      "cover it exactly once")


# DCP's chunks of one tensor cut it along a few boundaries per dim (one per shard); a finer grid is not DCP's.
MAX_GRID_CELLS = 1 << 24


def _tiles_exactly(size: torch.Size, chunks: list) -> bool:
    """Whether the chunks cover the tensor exactly once (no element missing, none twice): on the grid of
    every chunk boundary, each cell lies in exactly one chunk."""
    if len(chunks) == 1:
        return all(o == 0 for o in chunks[0].offsets) and tuple(chunks[0].sizes) == tuple(size)
    cuts = [sorted({0, n, *(c.offsets[d] for c in chunks), *(c.offsets[d] + c.sizes[d] for c in chunks)})
            for d, n in enumerate(size)]
    if math.prod(len(c) - 1 for c in cuts) > MAX_GRID_CELLS:
        return False
    where = [{cut: i for i, cut in enumerate(c)} for c in cuts]
    counts = torch.zeros([len(c) - 1 for c in cuts], dtype=torch.int32)
    for chunk in chunks:
        counts[tuple(slice(w[o], w[o + s]) for w, o, s in zip(where, chunk.offsets, chunk.sizes))] += 1
    return bool((counts == 1).all())


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader, with the metadata read by `read_metadata_safely` (DCP's own reader unpickles
    it with no limits); its parse is kept per process, so our entry check and dcp.load share one."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        metadata = read_metadata_safely(Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata"))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_tensor_metadata(path: Path, parts, reader: SafeFileSystemReader | None = None) -> tuple[SafeFileSystemReader, dict]:
    """(a safe reader of checkpoint `path`, its entries' metadata); ConfigError for an entry under
    one of `parts` that is not a tensor, since DCP would unpickle it. Pass the reader of an earlier
    call to read the metadata once."""
    reader = reader or SafeFileSystemReader(str(path))
    metadata = reader.read_metadata().state_dict_metadata
    for key, m in metadata.items():
        if key.split(".", 1)[0] in parts and not isinstance(m, TensorStorageMetadata):
            raise ConfigError(f"checkpoint '{path}' entry '{key}' is not a tensor; refusing to unpickle it")
    return reader, metadata


def load_checked(state: dict, reader: SafeFileSystemReader, path: Path, **kwargs) -> None:
    """dcp.load, with a failure to read the shards (a damaged file: DCP raises CheckpointException, a
    BaseException) as DamagedCheckpoint naming the folder."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=reader, **kwargs)
    except CheckpointException as e:
        failure = next(iter(e.failures.values()), e)  # one rank's: an exception, or (exception, traceback)
        cause = failure[0] if isinstance(failure, tuple) else getattr(failure, "exc", failure)
        first_sentence = re.split(r"(?<=\.) |\n", str(cause).strip(), maxsplit=1)[0][:160]
        raise DamagedCheckpoint(path, f"reading its shards failed: {type(cause).__name__}: {first_sentence}") from None


def damaged_checkpoint_line(damage: DamagedCheckpoint, run_folder: Path, own: bool) -> str:
    """The line for a damaged checkpoint: what is wrong, that nothing was deleted, and the newest
    earlier step of the run (in `run_folder`) whose files pass the same checks."""
    if not own:
        return f"{damage}; nothing was deleted. Point checkpoint.initial_load_path at a whole checkpoint"
    step = int(damage.folder.name.removeprefix("step-"))
    for earlier in reversed([s for s in complete_steps(run_folder) if s < step]):
        candidate = run_folder / f"step-{earlier}"
        try:
            if not is_hf_checkpoint(candidate):
                read_metadata_safely(candidate / ".metadata")
        except ConfigError:
            continue
        return (f"checkpoint step {step} is damaged ({damage.reason}); nothing was deleted. The newest whole "
                f"checkpoint is step {earlier}: resume from it with --checkpoint.load_step {earlier}")
    return (f"checkpoint step {step} is damaged ({damage.reason}); nothing was deleted, and no earlier checkpoint "
            f"in {run_folder} is whole. Move {damage.folder} aside to start from step 0")


def check_checkpoint_files(path: Path, run_folder: Path, own: bool) -> None:
    """The checkpoint a run will load, checked as loading checks it (preflight and every rank, before
    they join the process group); a damaged one gives damaged_checkpoint_line."""
    if not path.exists():
        return  # moved aside by a crash (step-N.replaced): rank 0 puts it back at start, and loading checks it
    if is_hf_checkpoint(path):
        from titanlite.checkpoint.hf import check_hf_files

        check_hf_files(path)
        return
    try:
        read_metadata_safely(path / ".metadata")
    except DamagedCheckpoint as e:
        raise ConfigError(damaged_checkpoint_line(e, run_folder, own)) from None
