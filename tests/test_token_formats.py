"""Token files in the formats users already have (megatron-core's indexed datasets, OLMo-core's numpy
files), checked against those libraries' own writers and specs, and damaged token files, each stopped
in one line."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import launch, tiny_args
from token_helpers import OFFLINE, config, loader

MEGATRON = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
import numpy, torch
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
prefix, prepared = sys.argv[1], sys.argv[2]
builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
builder.add_item(torch.tensor([5, 6, 7, 258])); builder.add_item(torch.tensor([8, 9, 258])); builder.end_document()
for document in json.loads(sys.argv[3]):
    builder.add_document(torch.tensor(document), lengths=[len(document)])
builder.finalize(prefix + ".idx")
written, ours = IndexedDataset(prefix), IndexedDataset(prepared)
print(json.dumps({"written": [written[i].copy().tolist() for i in range(len(written))],
                  "documents": len(written.document_indices) - 1,
                  "ours": [ours[i].copy().tolist() for i in range(len(ours))]}))
"""


def test_megatron_files_read_as_megatron_core_reads_them_and_ours_read_in_megatron_core(token_folders, tmp_path):
    """megatron-core's own IndexedDatasetBuilder writes a dataset (a document of two sequences, then
    documents of one) and its IndexedDataset reads it back: titanlite's stream is those sequences end
    to end, and its windows are cut from that stream. The other way, megatron-core reads a prepared
    shard as the byte tokenizer's documents (BOS, bytes, EOS)."""
    from titanlite.data.formats import open_megatron

    rng = random.Random(0)
    documents = [[rng.randrange(256) for _ in range(rng.randint(5, 80))] + [258] for _ in range(40)]
    out = subprocess.run([sys.executable, "-c", MEGATRON, str(tmp_path / "mega"), str(token_folders["code"] / "part-00000"),
                          json.dumps(documents)], capture_output=True, text=True, env=OFFLINE, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    read = json.loads(out.stdout.strip().splitlines()[-1])
    assert read["documents"] == 41 and read["written"][2:] == documents
    stream = open_megatron(str(tmp_path / "mega"), "mega")
    flat = [t for sequence in read["written"] for t in sequence]
    assert stream.tokens == len(flat) and stream.documents == 41 and stream.read(0, len(flat)).tolist() == flat
    windows = loader(config("--training.dataset_path", str(tmp_path / "mega"), "--training.dataset_shuffle", "false"))
    for k, (x, y) in enumerate(itertools.islice(windows, 10)):
        for row in range(2):
            start = (2 * k + row) * 33
            assert x[row].tolist() == flat[start : start + 32] and y[row].tolist() == flat[start + 1 : start + 33]
    text = [json.loads(line)["text"] for line in token_folders["code_text"].read_text().splitlines()]
    assert read["ours"] == [[256, *d.encode(), 257] for d in text]


def olmo_file(path: Path, documents: list[list[int]], dtype) -> Path:
    """An OLMo-core token file by its spec (olmo_core/data/utils.py: write_array_to_disk writes the ids
    as a raw memmap, no header; write_document_indices writes PATH.csv.gz, one 'start,end' line per
    document, end exclusive, found from the EOS that ends each)."""
    import gzip

    flat = np.array([t for d in documents for t in d], dtype=dtype)
    flat.tofile(path)
    ends = np.cumsum([len(d) for d in documents])
    with gzip.open(path.with_suffix(".csv.gz"), "wt") as f:
        f.writelines(f"{end - len(d)},{end}\n" for d, end in zip(documents, ends))
    return path


def test_olmo_numpy_files_give_their_documents(tmp_path):
    """OLMo-core's dtype rule (NumpyDatasetConfig.get_dtype: the smallest unsigned type holding
    vocab_size - 1), files read end to end with their documents counted from the .csv.gz, EOS
    splitting them again; a file cut short or a .csv.gz past its end is one line."""
    from titanlite.config import ConfigError
    from titanlite.data.formats import olmo_dtype, open_numpy

    assert [olmo_dtype(v).name for v in (256, 1000, 65536, 65537, 100352)] == ["uint8", "uint16", "uint16", "uint32", "uint32"]
    rng = random.Random(1)
    eos = 100277  # dolma2's
    documents = [[rng.randrange(eos) for _ in range(rng.randint(3, 50))] + [eos] for _ in range(30)]
    (tmp_path / "olmo").mkdir()
    files = [olmo_file(tmp_path / "olmo" / f"part-0-0000{i}.npy", documents[i * 15 : (i + 1) * 15], np.uint32) for i in range(2)]
    (tmp_path / "olmo" / "part-0-00000b.npy").write_bytes(b"")  # an empty file between two: nothing to read in it
    files.insert(1, tmp_path / "olmo" / "part-0-00000b.npy")
    stream = open_numpy([str(f) for f in files], "olmo", vocab_size=100352)
    flat = np.array([t for d in documents for t in d])
    assert stream.documents == 30 and (stream.read(0, stream.tokens) == flat).all()
    ends = np.flatnonzero(stream.read(0, stream.tokens) == eos) + 1
    assert [stream.read(a, b - a).tolist() for a, b in zip([0, *ends[:-1]], ends)] == documents
    with open(files[2], "ab") as f:
        f.write(b"\x01\x02")
    with pytest.raises(ConfigError, match=r"part-0-00001.npy' is \d+ bytes, not a whole number of uint32 tokens"):
        open_numpy([str(f) for f in files], "olmo", vocab_size=100352)
    files[2].write_bytes(files[2].read_bytes()[:-10])
    with pytest.raises(ConfigError, match="lists a document ending at"):
        open_numpy([str(f) for f in files], "olmo", vocab_size=100352)


def damaged_token_files(root: Path, token_folders: dict[str, Path]) -> dict[str, Path]:
    """Copies of a prepared folder, each damaged in one way."""
    import shutil
    import struct

    made = {}
    for name in ("truncated", "counts", "version"):
        made[name] = root / name
        shutil.copytree(token_folders["math"], made[name])
    shard = made["truncated"] / "part-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-100])
    index = made["counts"] / "part-00000.idx"
    raw = bytearray(index.read_bytes())
    raw[18:26] = struct.pack("<Q", struct.unpack("<Q", raw[18:26])[0] - 1)  # one sequence fewer than the file holds
    index.write_bytes(bytes(raw))
    index = made["version"] / "part-00000.idx"
    index.write_bytes(index.read_bytes()[:9] + struct.pack("<Q", 2) + index.read_bytes()[17:])
    for name in ("half", "floats", "multimodal", "manifest", "saved_npy", "csv", "wide_ids"):
        made[name] = root / name
    shutil.copytree(token_folders["math"], made["half"])
    (made["half"] / "manifest.json").rename(made["half"] / "progress.json")  # as a killed prepare leaves it
    shutil.copytree(token_folders["math"], made["floats"])
    index = made["floats"] / "part-00000.idx"
    index.write_bytes(index.read_bytes()[:17] + bytes([7]) + index.read_bytes()[18:])  # float32
    shutil.copytree(token_folders["math"], made["multimodal"])
    index = made["multimodal"] / "part-00000.idx"
    sequences = struct.unpack("<Q", index.read_bytes()[18:26])[0]
    index.write_bytes(index.read_bytes() + b"\x01" * sequences)  # one mode per sequence: not text
    shutil.copytree(token_folders["math"], made["manifest"])
    (made["manifest"] / "manifest.json").write_text('{"format": "titanlite-tokens"}')
    made["saved_npy"].mkdir()
    np.save(made["saved_npy"] / "tokens.npy", np.arange(100, dtype=np.uint16))
    made["csv"].mkdir()
    np.arange(100, dtype=np.uint16).tofile(made["csv"] / "part-0.npy")
    (made["csv"] / "part-0.csv.gz").write_text("0,100\n")  # not gzip-compressed
    ids = np.full(100, 60000, dtype=np.uint16)
    ids.tofile(made["wide_ids"].with_suffix(".bin"))
    from titanlite.data.formats import write_index

    write_index(made["wide_ids"].with_suffix(".idx"), np.dtype(np.uint16), np.array([100]))
    return made


def test_damaged_or_mismatched_token_files_are_one_line_each(token_folders, tmp_path):
    """preflight (before any process starts) names the file or key, the value and the fix."""
    from titanlite.config import ConfigError
    from titanlite.data.prepare import prepare as prepare_folder
    from titanlite.preflight import check

    bad = damaged_token_files(tmp_path, token_folders)
    bpe = tmp_path / "bpe"
    prepare_folder(config("--training.dataset", str(token_folders["math_text"]), "--model.hf_assets_path", "shakespeare-bpe8k"), bpe, "train", 1, 1 << 20)
    web, math = token_folders["web"], token_folders["math"]
    for extra, words in [
        (["--training.dataset_path", str(bpe)], "was prepared with another tokenizer (vocabulary 8192"),
        (["--training.dataset_path", str(bad["truncated"])], "part-00000.bin' is"),
        (["--training.dataset_path", str(bad["counts"])], "part-00000.idx' is"),
        (["--training.dataset_path", str(bad["version"])], "has index version 2; titanlite reads version 1"),
        (["--training.dataset_mixture", f"0.5 {web},-0.5 {math}"], "weight '-0.5' of '-0.5"),
        (["--training.dataset_mixture", f"0.5 {web},0.5 {tmp_path / 'nowhere'}"], "nowhere' does not exist"),
        (["--training.dataset_mixture", f"0.5 {web},0.5 {bpe}"], "were prepared with different tokenizers (vocabulary 259 vs 8192)"),
        (["--training.dataset_path", str(web), "--validation.enable", "true"], "or validation.dataset_mixture"),
        (["--training.dataset_path", str(math), "--training.seq_len", "100000"], "less than one window of seq_len + 1"),
        (["--validation.enable", "true", "--validation.dataset_path", str(math), "--validation.seq_len", "32",
          "--validation.local_batch_size", "1000"], "less than one global batch of 1000"),
        (["--training.dataset_path", str(bad["half"])], "has not finished (no manifest.json, a progress.json); run the same"),
        (["--training.dataset_path", str(bad["floats"])], "has dtype code 7, not one of integer token ids"),
        (["--training.dataset_path", str(bad["multimodal"])], "holds multimodal sequences"),
        (["--training.dataset_path", str(bad["manifest"])], "manifest.json' lacks 'shards'"),
        (["--training.dataset_path", str(bad["saved_npy"])], "is a numpy array with a header (np.save)"),
        (["--training.dataset_path", str(bad["csv"])], "part-0.csv.gz' is not OLMo's document list"),
    ]:
        cfg = config("--job.dump_folder", str(tmp_path / "run"), *extra)
        with pytest.raises(ConfigError) as caught:
            check(cfg, 1)
        assert words in str(caught.value) and "\n" not in str(caught.value), (extra, str(caught.value))


def test_ids_past_the_vocabulary_stop_the_loader_in_one_line(token_folders, tmp_path):
    """Ids a size check cannot see (Megatron files of another tokenizer): the first batch that holds
    one stops the run, naming the source, not an index error deep in the embedding."""
    from titanlite.config import ConfigError

    bad = damaged_token_files(tmp_path, token_folders)
    with pytest.raises(ConfigError, match="source 'wide_ids' hold ids outside this run's vocabulary of 259 .from 60000"):
        next(iter(loader(config("--training.dataset_path", str(bad["wide_ids"]), "--training.seq_len", "8"))))


def test_a_damaged_shard_stops_run_train_sh_and_every_torchrun_rank_in_one_line(token_folders, tmp_path):
    from test_bad_inputs import assert_one_line, assert_the_rank_said, run_train_sh

    bad = damaged_token_files(tmp_path, token_folders)
    args = ["--job.dump_folder", str(tmp_path / "run"), "--model.hf_assets_path", "byte", "--training.seq_len", "32"]
    assert_one_line(run_train_sh([*args, "--training.dataset_path", str(bad["truncated"])]), "part-00000.bin' is")
    out = launch(2, tiny_args(token_folders["web"], tmp_path / "run", "--training.dataset_path", str(bad["version"])), expect=None)
    assert_the_rank_said(out, "has index version 2")
