"""Token files: prepare once, read by memory map, mixed by weight, shuffled by a seeded permutation,
resumed on any data-parallel degree. Each result is checked against something apart from the code
under test: the text path's windows, a direct count, one process's sequence, a killed run's twin."""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers import REPO, synthetic_documents, tiny_args

OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def prepare(out: Path, dataset: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "titanlite.data.prepare", str(out), "--training.dataset", str(dataset),
           "--model.hf_assets_path", "byte", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=OFFLINE, timeout=300)


def documents_file(path: Path, n: int, seed: int) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in synthetic_documents(n, seed)))
    return path


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Three prepared folders (web, code, math) of different sizes, and their text."""
    from titanlite.data.prepare import prepare as prepare_folder

    root = tmp_path_factory.mktemp("token_sources")
    out = {}
    for name, n, seed in (("web", 120, 1), ("code", 40, 2), ("math", 15, 3)):
        text = documents_file(root / f"{name}.jsonl", n, seed)
        prepare_folder(config("--training.dataset", str(text)), root / name, "train", 1, 1 << 28)
        out[name], out[f"{name}_text"] = root / name, text
    return out


def config(*args: str):
    from titanlite.config import parse_args

    return parse_args(["--model.hf_assets_path", "byte", "--training.seq_len", "32", "--training.local_batch_size", "2", *args])


def loader(cfg, dp_rank: int = 0, dp_degree: int = 1):
    from titanlite.data.dataset import build_dataloader
    from titanlite.data.tokenizer import ByteTokenizer

    return build_dataloader(cfg, ByteTokenizer(), dp_rank, dp_degree)


def test_prepared_shards_give_the_text_paths_windows(sources):
    """Shuffle off, one rank: the prepared folder's batches are the text path's, through three epochs
    of the source (both read it as an endless loop, documents carrying over the epoch's end)."""
    text = config("--training.dataset", str(sources["web_text"]), "--training.data_split", "sequences")
    shards = config("--training.dataset_path", str(sources["web"]), "--training.dataset_shuffle", "false")
    tokens = json.loads((sources["web"] / "manifest.json").read_text())["tokens"]
    batches = 3 * tokens // (33 * 2) + 1
    pairs = list(itertools.islice(zip(loader(text), loader(shards)), batches))
    assert len(pairs) == batches
    for i, ((x, y), (x2, y2)) in enumerate(pairs):
        assert torch.equal(x, x2) and torch.equal(y, y2), f"batch {i}"


def test_prepare_is_the_same_bytes_on_any_process_count_and_resumes_after_a_kill(tmp_path):
    """A run killed mid-way leaves no manifest (the folder is not yet a dataset) and no visible half
    shard; run again, it tokenizes only the rest, and its files are byte for byte those of one
    uninterrupted process."""
    text = documents_file(tmp_path / "docs.jsonl", 3000, 7)
    whole = prepare(tmp_path / "whole", text, "--workers", "1", "--shard_tokens", "5000")
    assert whole.returncode == 0, whole.stderr
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "titanlite.data.prepare", str(out), "--training.dataset", str(text),
           "--model.hf_assets_path", "byte", "--workers", "2", "--shard_tokens", "5000"]
    run = subprocess.Popen(cmd, cwd=REPO, env=OFFLINE, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while not (out / "progress.json").exists() and time.time() < deadline and run.poll() is None:
        time.sleep(0.005)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    assert (out / "progress.json").exists() and not (out / "manifest.json").exists(), "the kill came too late"
    (out / "part-99999.bin.tmp").write_bytes(b"half a shard")  # as a kill inside a write leaves it
    again = prepare(out, text, "--workers", "2", "--shard_tokens", "5000")
    assert again.returncode == 0, again.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    tokenized = int(again.stderr.split("this run tokenized ")[1].split(" ")[0].replace(",", ""))
    assert 0 < tokenized < manifest["tokens"], again.stderr
    files = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert files == sorted(p.name for p in out.iterdir()) and "progress.json" not in files
    for name in files:
        assert (out / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    docs = synthetic_documents(3000, 7)
    assert manifest["documents"] == len(docs) and manifest["dtype"] == "uint16"
    assert manifest["tokens"] == sum(len(d.encode()) + 2 for d in docs)  # bytes + BOS + EOS each
    assert subprocess.run([sys.executable, "-m", "titanlite.data.prepare", "--verify", str(out)], env=OFFLINE, cwd=REPO).returncode == 0
    from titanlite.config import ConfigError
    from titanlite.data.prepare import prepare as prepare_folder

    with pytest.raises(ConfigError, match="manifest.json records tokenizer_sha256='byte', but this run has tokenizer_sha256='b067"):
        prepare_folder(config("--training.dataset", str(text), "--model.hf_assets_path", "shakespeare-bpe8k"), out, "train", 1, 5000)
    shard = out / "part-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2] + b"\x00\x00")  # one token changed, the size kept
    broken = subprocess.run([sys.executable, "-m", "titanlite.data.prepare", "--verify", str(out)], env=OFFLINE, cwd=REPO,
                            capture_output=True, text=True)
    assert broken.returncode == 2 and "part-00001.bin' is missing or does not match its sha256" in broken.stderr


def test_mixture_shares_are_exact_per_period_and_close_everywhere():
    """0.7/0.2/0.1 by batches of 8: every 100 consecutive global batches hold each source's share to
    within one window (here exactly). Random weights: any stretch of samples is within two windows of
    its share. counts() agrees with a direct count of locate()'s sources, and each source's samples
    come in order 0, 1, 2, ..."""
    from titanlite.data.mixture import Schedule, parse_mixture

    parts = parse_mixture(["0.7 /d/web", "0.2 /d/code", "0.1 /d/math"], "training.dataset_mixture")
    assert [p.name for p in parts] == ["web", "code", "math"] and sum(p.weight for p in parts) == 1
    schedule = Schedule([p.weight for p in parts])
    rows = 8
    sources, indices = schedule.locate(np.arange(300 * rows))
    for start in range(0, 200 * rows, rows):
        counts = np.bincount(sources[start : start + 100 * rows], minlength=3)
        assert all(abs(counts[i] - float(parts[i].weight) * 100 * rows) <= 1 for i in range(3)), (start, counts)
    for i in range(3):
        assert (indices[sources == i] == np.arange((sources == i).sum())).all()
    assert (schedule.counts(1234) == np.bincount(sources[:1234], minlength=3)).all()
    tiny = Schedule([Fraction(1, 10**9 + 1), Fraction(10**9, 10**9 + 1)])  # rounded to 1/65536, never to 0
    assert tiny.period == 1 << 16 and list(tiny.per_period) == [1, (1 << 16) - 1]
    rng = random.Random(0)
    for _ in range(20):
        weights = [Fraction(rng.randint(1, 40)) for _ in range(rng.randint(2, 5))]
        schedule = Schedule([w / sum(weights) for w in weights])
        sources, _ = schedule.locate(np.arange(schedule.period + 400))
        for length in (7, 100, 333):
            for start in range(0, schedule.period, 5):
                counts = np.bincount(sources[start : start + length], minlength=len(weights))
                deviation = max(abs(c - float(w / sum(weights)) * length) for c, w in zip(counts, weights))
                assert deviation < 2, (weights, start, length, counts)


def test_bad_weights_and_missing_sources_are_one_line():
    from titanlite.config import ConfigError
    from titanlite.data.mixture import parse_mixture

    for item in ("-1 /d/web", "0 /d/web", "nan /d/web", "heavy /d/web"):
        with pytest.raises(ConfigError, match="is not a positive number"):
            parse_mixture([item, "1 /d/code"], "training.dataset_mixture")


def test_the_shuffle_is_a_seeded_permutation_of_each_epoch():
    """Each epoch reads every window once; another seed or epoch gives another order."""
    from titanlite.data.windows import Permutation

    for size in (1, 2, 3, 5, 1000, 4097):
        order = Permutation(size, (0, 0, 0))(np.arange(size))
        assert sorted(order.tolist()) == list(range(size)), size
    a, b, c = (Permutation(1000, seed)(np.arange(1000)) for seed in ((0, 0, 0), (1, 0, 0), (0, 0, 1)))
    assert (a != b).mean() > 0.9 and (a != c).mean() > 0.9 and (a != np.arange(1000)).mean() > 0.9


def test_each_epoch_of_a_source_is_a_new_permutation_of_all_its_windows(sources):
    """Over three epochs of the math source, each epoch starts every whole window once, in an order
    of its own."""
    from titanlite.data.formats import open_prepared
    from titanlite.data.windows import SourceWindows

    windows = SourceWindows(open_prepared(sources["math"], "math"), 2, 33, shuffle=True, seed=0)
    m = windows.whole
    epochs = [windows.starts(np.arange(e * m, (e + 1) * m)) for e in range(3)]
    for starts in epochs:
        assert sorted(starts.tolist()) == [33 * i for i in range(m)]
    assert all((a != b).mean() > 0.9 for a, b in itertools.combinations(epochs, 2))


def global_rows(cfg, ranks: int, batches: int, states=None) -> tuple[list[torch.Tensor], list]:
    """The global microbatches (rows of every rank stacked in rank order) that `ranks` loaders read."""
    loaders = [loader(cfg, r, ranks) for r in range(ranks)]
    for r, state in enumerate(states or []):
        loaders[r].load_state_dict(state)
    iterators = [iter(l) for l in loaders]
    out = [torch.cat([next(it)[0] for it in iterators]) for _ in range(batches)]
    return out, loaders


def test_a_mixture_reads_the_same_global_batches_on_every_layout_and_shuffles_each_source(sources):
    """Three sources, shuffled: 1 rank with batch 8, 2 ranks with 4 and 4 ranks with 2 read the same
    global batches. Over the math source's first epoch each of its windows comes exactly once."""
    mixture = "0.7 {web},0.2 {code},0.1 {math}".format(**sources)
    one, _ = global_rows(config("--training.dataset_mixture", mixture, "--training.local_batch_size", "8"), 1, 30)
    for ranks in (2, 4):
        cfg = config("--training.dataset_mixture", mixture, "--training.local_batch_size", str(8 // ranks))
        rows, _ = global_rows(cfg, ranks, 30)
        assert all(torch.equal(a, b) for a, b in zip(one, rows)) and len(rows) == len(one) == 30, ranks
    math = np.fromfile(sources["math"] / "part-00000.bin", dtype=np.uint16).astype(np.int64)
    windows = {tuple(math[i * 33 : i * 33 + 32]) for i in range(len(math) // 33)}
    seen = [tuple(row.tolist()) for batch in one for row in batch if tuple(row.tolist()) in windows]
    assert len(seen) == 24 == round(0.1 * 30 * 8) and len(set(seen)) == len(seen)  # no window twice in its epoch
    in_order = [tuple(math[i * 33 : i * 33 + 32]) for i in range(len(seen))]
    assert seen != in_order  # shuffled


def test_the_data_position_survives_a_change_of_data_parallel_degree(sources):
    """Saved by 2 ranks (batch 4, no loader worker) after 3 global batches, loaded by 4 ranks (batch
    2, one worker each) through the checkpointer's own loader restore: the global sequence goes on as
    1 process reads it, no sample repeated or skipped."""
    from titanlite.checkpoint.checkpointer import Checkpointer, json_tensor
    from titanlite.rollback import Batches

    mixture = "0.5 {web},0.3 {code},0.2 {math}".format(**sources)
    reference, _ = global_rows(config("--training.dataset_mixture", mixture, "--training.local_batch_size", "8"), 1, 6)
    first, loaders = global_rows(config("--training.dataset_mixture", mixture, "--training.local_batch_size", "4"), 2, 3)
    saved = {f"dp{r}": json_tensor({"dp_degree": 2, "num_workers": 0, "state": l.state_dict(), "step": 3, "token_files": True,
                                    "sample": 3 * 8}) for r, l in enumerate(loaders)}  # as the trainer counts them
    cfg = config("--training.dataset_mixture", mixture, "--training.local_batch_size", "2",
                 "--training.dataloader.num_workers", "1")  # and from 0 loader workers to 1
    resumed = []
    for rank in range(4):
        trainer = SimpleNamespace(config=cfg, dp_rank=rank, dp_degree=4, dataloader=loader(cfg, rank, 4), samples_read=0, spikes=None,
                                  batches=Batches(cfg), step=3)
        Checkpointer.load_dataloader(SimpleNamespace(trainer=trainer), saved)
        resumed.append(trainer.dataloader)
    iterators = [iter(l) for l in resumed]
    after = [torch.cat([next(it)[0] for it in iterators]) for _ in range(3)]
    assert len(first + after) == len(reference)
    assert all(torch.equal(a, b) for a, b in zip(first + after, reference))


def test_a_rollback_reads_token_files_again_from_the_checkpoints_position(sources):
    """A loader that read 6 microbatches, set back to the position after 3 (as a rollback does through
    the checkpointer), reads the 4th next, with no worker and with a persistent one."""
    from titanlite.checkpoint.checkpointer import Checkpointer, json_tensor
    from titanlite.rollback import Batches

    mixture = "0.6 {web},0.4 {math}".format(**sources)
    for workers in ([], ["--training.dataloader.num_workers", "1", "--training.dataloader.persistent_workers", "true"]):
        cfg = config("--training.dataset_mixture", mixture, *workers)
        reference, _ = global_rows(cfg, 1, 6)
        trainer = SimpleNamespace(config=cfg, dp_rank=0, dp_degree=1, dataloader=loader(cfg), samples_read=0, spikes=None,
                                  batches=Batches(cfg), step=3)
        it = iter(trainer.dataloader)
        assert all(torch.equal(next(it)[0], r) for r in reference)
        saved = {"dp0": json_tensor({"dp_degree": 1, "num_workers": len(workers) // 4, "state": {}, "step": 3,
                                     "token_files": True, "sample": 3 * 2})}
        Checkpointer.load_dataloader(SimpleNamespace(trainer=trainer), saved)
        assert torch.equal(next(iter(trainer.dataloader))[0], reference[3]), workers


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


def test_megatron_files_read_as_megatron_core_reads_them_and_ours_read_in_megatron_core(sources, tmp_path):
    """megatron-core's own IndexedDatasetBuilder writes a dataset (a document of two sequences, then
    documents of one) and its IndexedDataset reads it back: titanlite's stream is those sequences end
    to end, and its windows are cut from that stream. The other way, megatron-core reads a prepared
    shard as the byte tokenizer's documents (BOS, bytes, EOS)."""
    from titanlite.data.formats import open_megatron

    rng = random.Random(0)
    documents = [[rng.randrange(256) for _ in range(rng.randint(5, 80))] + [258] for _ in range(40)]
    out = subprocess.run([sys.executable, "-c", MEGATRON, str(tmp_path / "mega"), str(sources["code"] / "part-00000"),
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
    text = [json.loads(line)["text"] for line in sources["code_text"].read_text().splitlines()]
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


def damaged_token_files(root: Path, sources: dict[str, Path]) -> dict[str, Path]:
    """Copies of a prepared folder, each damaged in one way."""
    import shutil
    import struct

    made = {}
    for name in ("truncated", "counts", "version"):
        made[name] = root / name
        shutil.copytree(sources["math"], made[name])
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
    shutil.copytree(sources["math"], made["half"])
    (made["half"] / "manifest.json").rename(made["half"] / "progress.json")  # as a killed prepare leaves it
    shutil.copytree(sources["math"], made["floats"])
    index = made["floats"] / "part-00000.idx"
    index.write_bytes(index.read_bytes()[:17] + bytes([7]) + index.read_bytes()[18:])  # float32
    shutil.copytree(sources["math"], made["multimodal"])
    index = made["multimodal"] / "part-00000.idx"
    sequences = struct.unpack("<Q", index.read_bytes()[18:26])[0]
    index.write_bytes(index.read_bytes() + b"\x01" * sequences)  # one mode per sequence: not text
    shutil.copytree(sources["math"], made["manifest"])
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


def test_damaged_or_mismatched_token_files_are_one_line_each(sources, tmp_path):
    """preflight (before any process starts) names the file or key, the value and the fix."""
    from titanlite.config import ConfigError
    from titanlite.data.prepare import prepare as prepare_folder
    from titanlite.preflight import check

    bad = damaged_token_files(tmp_path, sources)
    bpe = tmp_path / "bpe"
    prepare_folder(config("--training.dataset", str(sources["math_text"]), "--model.hf_assets_path", "shakespeare-bpe8k"), bpe, "train", 1, 1 << 20)
    web, math = sources["web"], sources["math"]
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


def test_ids_past_the_vocabulary_stop_the_loader_in_one_line(sources, tmp_path):
    """Ids a size check cannot see (Megatron files of another tokenizer): the first batch that holds
    one stops the run, naming the source, not an index error deep in the embedding."""
    from titanlite.config import ConfigError

    bad = damaged_token_files(tmp_path, sources)
    with pytest.raises(ConfigError, match="source 'wide_ids' hold ids outside this run's vocabulary of 259 .from 60000"):
        next(iter(loader(config("--training.dataset_path", str(bad["wide_ids"]), "--training.seq_len", "8"))))


def test_a_damaged_shard_stops_run_train_sh_and_every_torchrun_rank_in_one_line(sources, tmp_path):
    from test_bad_inputs import assert_one_line, assert_the_rank_said, plain_torchrun, run_train_sh

    bad = damaged_token_files(tmp_path, sources)
    args = ["--job.dump_folder", str(tmp_path / "run"), "--model.hf_assets_path", "byte", "--training.seq_len", "32"]
    assert_one_line(run_train_sh([*args, "--training.dataset_path", str(bad["truncated"])]), "part-00000.bin' is")
    out = plain_torchrun(tiny_args(sources["web"], tmp_path / "run", "--training.dataset_path", str(bad["version"])), nproc=2)
    assert_the_rank_said(out, "has index version 2")


TIMINGS = {"tps", "tflops", "mfu", "memory_gib", "step_time_s", "data_share", "elapsed_s"}


def metrics(folder: Path) -> list[dict]:
    """metrics.jsonl's rows without the timings (no two runs share those)."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMINGS} for row in rows]


def train(nproc: int, args: list[str]):
    from helpers import run_command

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "titanlite.train", *args]
    out = run_command(cmd, timeout=300, cwd=REPO, env=OFFLINE)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_training_from_shards_logs_the_text_paths_losses(sources, tmp_path):
    """Shuffle off, 1 process: 4 steps from the prepared folder log the text path's losses bitwise."""
    text = tmp_path / "text"
    train(1, tiny_args(sources["web_text"], text, "--training.steps", "4", "--training.data_split", "sequences"))
    shards = tmp_path / "shards"
    train(1, tiny_args(sources["web"], shards, "--training.steps", "4", "--training.dataset_shuffle", "false"))
    a, b = ([r["loss"] for r in metrics(f) if "loss" in r] for f in (text, shards))
    assert len(a) == len(b) == 4 and a == b and all(x == x for x in a), (a, b)


def test_a_three_source_mixture_on_fsdp2_resumes_bitwise_and_reports_each_source(sources, tmp_path):
    """FSDP 2, three shuffled sources, validation on two held-out ones: stopped at step 3 and resumed,
    steps 4-6 log what the straight run logs, bit for bit; each source's tokens seen follow its weight
    and each validation source has its loss, the validation loss their weighted mean."""
    import shutil

    mixture = "0.6 {web},0.3 {code},0.1 {math}".format(**sources)
    args = ["--training.steps", "6", "--training.dataset_mixture", mixture, "--checkpoint.enable", "--checkpoint.interval", "3",
            "--lr_scheduler.decay_ratio", "0", "--validation.enable", "true", "--validation.freq", "3", "--validation.steps", "2",
            "--validation.dataset_mixture", "0.25 {code},0.75 {math}".format(**sources), "--training.local_batch_size", "5"]
    straight = tmp_path / "straight"
    train(2, tiny_args(sources["web"], straight, *args))
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoint" / "step-6")
    rows = metrics(straight)
    kept = [line for line in (straight / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= 3]
    (resumed / "metrics.jsonl").write_text("".join(line + "\n" for line in kept))
    out = train(2, tiny_args(sources["web"], resumed, *args))
    assert "loaded checkpoint" in out.stdout + out.stderr
    assert metrics(resumed) == rows  # every row of steps 4-6 bitwise, timings aside
    train_rows = [r for r in rows if "loss" in r]
    last = train_rows[-1]
    assert [last[f"tokens_seen_{n}"] for n in ("web", "code", "math")] == [6 * 10 * 32 * w for w in (0.6, 0.3, 0.1)]
    validation = [r for r in rows if "val_loss" in r]
    assert len(validation) == 2
    for r in validation:
        assert r["val_loss"] == pytest.approx(0.25 * r["val_loss_code"] + 0.75 * r["val_loss_math"], rel=1e-6)


def test_loader_workers_read_the_main_process_batches_and_resume_exactly(sources):
    """Two loader workers (each reads every other microbatch) give the batches of none, and a loader
    restored from their state after 5 batches goes on with batch 6."""
    mixture = "0.7 {web},0.3 {math}".format(**sources)
    plain = [x for x, _ in itertools.islice(loader(config("--training.dataset_mixture", mixture)), 10)]
    workers = config("--training.dataset_mixture", mixture, "--training.dataloader.num_workers", "2")
    first = loader(workers)
    it = iter(first)
    head = [next(it)[0] for _ in range(5)]
    state = first.state_dict()
    again = loader(workers)
    again.load_state_dict(state)
    tail = [x for x, _ in itertools.islice(again, 5)]
    assert len(head + tail) == len(plain) == 10 and all(torch.equal(a, b) for a, b in zip(head + tail, plain))
