"""The checkpoint reader accepts only what DCP writes: crafted `.metadata` files for each hole a
review found (a shard path outside the folder, state set on a shared object, sizes with no bound)
and damaged folders (a shard missing, truncated or overwritten) are refused before anything is
allocated or read. Each hole is first shown open through DCP's own reader or plain pickle, so the
test proves that our check is what closes it."""

import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

from titanlite.checkpoint.reader import DamagedCheckpoint, SafeFileSystemReader, load_checked, read_metadata_safely
from titanlite.config import ConfigError


def save(folder: Path, value: float) -> Path:
    dcp.save({"model": {"w": torch.full((4, 8), value)}}, checkpoint_id=str(folder), no_dist=True)
    return folder


def rewrite_metadata(folder: Path, change) -> None:
    """Our own file, so plain pickle may read it; `change(metadata)` crafts it."""
    path = folder / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    change(metadata)
    path.write_bytes(pickle.dumps(metadata))


def point_storage_at(target: str):
    def change(metadata):
        for info in metadata.storage_data.values():
            info.relative_path = target
    return change


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("target", ["../other_run/__0_0.distcp", "ABSOLUTE"])
def test_a_shard_path_outside_the_folder_is_refused(tmp_path, target):
    mine, other = save(tmp_path / "run", 0.0), save(tmp_path / "other_run", 7.0)
    target = str(other / "__0_0.distcp") if target == "ABSOLUTE" else target
    rewrite_metadata(mine, point_storage_at(target))
    # The hole: DCP's own reader follows the path and loads the other run's weights.
    state = {"model": {"w": torch.zeros(4, 8)}}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(mine)), no_dist=True)
    assert torch.equal(state["model"]["w"], torch.full((4, 8), 7.0))
    with pytest.raises(ConfigError, match=r"points entry 'model.w' at '.*__0_0.distcp', not a shard file of this folder"):
        read_metadata_safely(mine / ".metadata")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("name", ["__0_0.distcp.bak", "notes.txt", "__0_0/../__0_0.distcp"])
def test_only_dcp_shard_names_are_accepted(tmp_path, name):
    mine = save(tmp_path / "run", 0.0)
    rewrite_metadata(mine, point_storage_at(name))
    with pytest.raises(ConfigError, match="not a shard file of this folder"):
        read_metadata_safely(mine / ".metadata")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_links_out_of_the_folder_are_refused(tmp_path):
    """A shard or a .metadata that is a link to another run's file: the names are DCP's, the bytes are
    not this folder's. A folder that is itself a link is fine."""
    mine, other = save(tmp_path / "run", 0.0), save(tmp_path / "other_run", 7.0)
    (tmp_path / "linked").symlink_to(mine)
    read_metadata_safely(tmp_path / "linked" / ".metadata")
    (mine / "__0_0.distcp").unlink()
    (mine / "__0_0.distcp").symlink_to(other / "__0_0.distcp")
    with pytest.raises(ConfigError, match=r"has shard file __0_0.distcp linking outside its folder"):
        read_metadata_safely(mine / ".metadata")
    (mine / ".metadata").unlink()
    (mine / ".metadata").symlink_to(other / ".metadata")
    with pytest.raises(ConfigError, match=r"links outside its folder"):
        read_metadata_safely(mine / ".metadata")


# Protocol 2: _MEM_FORMAT_ENCODING(0) (the enum member DCP encodes contiguous tensors with), then
# BUILD {'_value_': 7} on it: state set on a member every later DCP save of the process uses.
ENUM_BUILD = (
    b"\x80\x02ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\nK\x00\x85R"
    b"}X\x07\x00\x00\x00_value_K\x07sb."
)


def test_state_set_on_a_shared_enum_member_is_refused():
    # The hole: plain unpickling changes the member for the whole process (in a process of its own).
    code = ("import pickle, sys; from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING as E; "
            f"pickle.loads({ENUM_BUILD!r}); print(E.TORCH_CONTIGUOUS_FORMAT.value)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "7"
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / ".metadata"
        path.write_bytes(ENUM_BUILD)
        with pytest.raises(ConfigError, match="sets attributes of <_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT: 0>"):
            read_metadata_safely(path)
    assert _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT.value == 0


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_state_outside_a_records_fields_is_refused(tmp_path):
    """A fresh DCP record may take only its own fields: not '__class__' or made-up names."""
    mine = save(tmp_path / "run", 0.0)
    data = (mine / ".metadata").read_bytes()
    assert data.count(b"\x8c\x0drelative_path") == 1  # SHORT_BINUNICODE 'relative_path': rename it
    (mine / ".metadata").write_bytes(data.replace(b"\x8c\x0drelative_path", b"\x8c\x0drelative_pbth"))
    with pytest.raises(ConfigError, match="that _StorageInfo does not have"):
        read_metadata_safely(mine / ".metadata")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("craft, message", [
    ("huge", r"declares 4398046511104 bytes for a chunk of tensor 'model.w' with \d+ stored bytes"),
    ("uncovered", r"declares tensor 'model.w' of size \[1099511627776, 1\] but its chunks \(32 elements\) do not cover it"),
    ("outside", r"gives tensor 'model.w' of size \[4, 8\] a chunk outside it"),
])
def test_sizes_beyond_the_stored_bytes_are_refused_before_allocating(tmp_path, craft, message):
    mine = save(tmp_path / "run", 0.0)
    shard_bytes = (mine / "__0_0.distcp").stat().st_size

    def change(metadata):
        entry = metadata.state_dict_metadata["model.w"]
        if craft == "huge":  # one chunk as large as the tensor: 4 TiB of float32 from a file of a few KiB
            entry.size = entry.chunks[0].sizes = torch.Size([2**40, 1])
        elif craft == "uncovered":  # the tensor grows, its stored chunk does not
            entry.size = torch.Size([2**40, 1])
            entry.chunks[0].sizes = torch.Size([32, 1])
        else:
            entry.chunks[0].offsets = torch.Size([1, 0])
    rewrite_metadata(mine, change)
    assert 2**40 * 4 > shard_bytes  # what loading would allocate against what the folder holds
    with pytest.raises(ConfigError, match=message):
        read_metadata_safely(mine / ".metadata")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_damaged_shards_are_named(tmp_path):
    """Missing, truncated and overwritten shard files each raise DamagedCheckpoint naming the folder."""
    mine = save(tmp_path / "run", 1.0)
    shard = mine / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(DamagedCheckpoint, match=r"its shard file __0_0.distcp is truncated \(\d+ bytes; its entries reach byte \d+\)"):
        read_metadata_safely(mine / ".metadata")
    shard.unlink()
    with pytest.raises(DamagedCheckpoint, match="its shard file __0_0.distcp is missing"):
        read_metadata_safely(mine / ".metadata")
    shard.write_bytes(b"\x00" * len(data))  # whole length, garbage bytes: found only when read
    state = {"model": {"w": torch.zeros(4, 8)}}
    with pytest.raises(DamagedCheckpoint, match=rf"checkpoint '{mine}' is damaged: reading its shards failed"):
        load_checked(state, SafeFileSystemReader(str(mine)), mine, no_dist=True)
    (mine / ".metadata").write_bytes((mine / ".metadata").read_bytes()[:100])
    with pytest.raises(DamagedCheckpoint, match="its .metadata file is truncated"):
        read_metadata_safely(mine / ".metadata")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_what_dcp_writes_is_accepted(tmp_path):
    mine = save(tmp_path / "run", 3.0)
    state = {"model": {"w": torch.zeros(4, 8)}}
    load_checked(state, SafeFileSystemReader(str(mine)), mine, no_dist=True)
    assert torch.equal(state["model"]["w"], torch.full((4, 8), 3.0))


def save_two_tensors(folder: Path) -> Path:
    dcp.save({"model": {"a": torch.full((4, 8), 1.0), "b": torch.full((4, 8), 2.0)}}, checkpoint_id=str(folder), no_dist=True)
    return folder


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_chunks_that_overlap_and_bytes_read_twice_are_refused(tmp_path):
    """Chunk element counts that add up, but two chunks on the same rows (the rest left as whatever
    memory held); two entries on the same bytes of a shard (each allocates, the file holds one)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    mine = save_two_tensors(tmp_path / "twice")

    def same_rows_twice(metadata):
        entry = metadata.state_dict_metadata["model.a"]
        entry.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 8]))] * 2
    rewrite_metadata(mine, same_rows_twice)
    with pytest.raises(ConfigError, match=r"but its chunks \(32 elements\) do not cover it exactly once"):
        read_metadata_safely(mine / ".metadata")

    mine = save_two_tensors(tmp_path / "shared")

    def b_reads_as_bytes(metadata):
        a = metadata.storage_data[MetadataIndex("model.a", torch.Size([0, 0]))]
        b = metadata.storage_data[MetadataIndex("model.b", torch.Size([0, 0]))]
        b.offset, b.length = a.offset, a.length
    rewrite_metadata(mine, b_reads_as_bytes)
    with pytest.raises(ConfigError, match=r"stores entries 'model.a' and 'model.b' in overlapping bytes of __0_0.distcp"):
        read_metadata_safely(mine / ".metadata")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_an_entry_name_that_is_not_a_string_is_refused(tmp_path):
    mine = save(tmp_path / "run", 0.0)
    rewrite_metadata(mine, lambda m: m.state_dict_metadata.update({7: m.state_dict_metadata["model.w"]}))
    with pytest.raises(ConfigError, match="has an entry named 7, not a string"):
        read_metadata_safely(mine / ".metadata")


def test_shard_names_are_matched_whole():
    from titanlite.checkpoint.reader import SHARD_FILE

    assert SHARD_FILE.fullmatch("__0_12.distcp") and not SHARD_FILE.fullmatch("__0_0.distcp\n")
