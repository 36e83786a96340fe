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

from helpers import REPO, documents_file, launch, synthetic_documents, tiny_args
from token_helpers import OFFLINE, config, loader


def prepare(out: Path, dataset: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "titanlite.data.prepare", str(out), "--training.dataset", str(dataset),
           "--model.hf_assets_path", "byte", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=OFFLINE, timeout=300)


def test_prepared_shards_give_the_text_paths_windows(token_folders):
    """Shuffle off, one rank: the prepared folder's batches are the text path's, through three epochs
    of the source (both read it as an endless loop, documents carrying over the epoch's end)."""
    text = config("--training.dataset", str(token_folders["web_text"]), "--training.data_split", "sequences")
    shards = config("--training.dataset_path", str(token_folders["web"]), "--training.dataset_shuffle", "false")
    tokens = json.loads((token_folders["web"] / "manifest.json").read_text())["tokens"]
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


def test_each_epoch_of_a_source_is_a_new_permutation_of_all_its_windows(token_folders):
    """Over three epochs of the math source, each epoch starts every whole window once, in an order
    of its own."""
    from titanlite.data.formats import open_prepared
    from titanlite.data.windows import SourceWindows

    windows = SourceWindows(open_prepared(token_folders["math"], "math"), 2, 33, shuffle=True, seed=0)
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


def test_a_mixture_reads_the_same_global_batches_on_every_layout_and_shuffles_each_source(token_folders):
    """Three sources, shuffled: 1 rank with batch 8, 2 ranks with 4 and 4 ranks with 2 read the same
    global batches. Over the math source's first epoch each of its windows comes exactly once."""
    mixture = "0.7 {web},0.2 {code},0.1 {math}".format(**token_folders)
    one, _ = global_rows(config("--training.dataset_mixture", mixture, "--training.local_batch_size", "8"), 1, 30)
    for ranks in (2, 4):
        cfg = config("--training.dataset_mixture", mixture, "--training.local_batch_size", str(8 // ranks))
        rows, _ = global_rows(cfg, ranks, 30)
        assert all(torch.equal(a, b) for a, b in zip(one, rows)) and len(rows) == len(one) == 30, ranks
    math = np.fromfile(token_folders["math"] / "part-00000.bin", dtype=np.uint16).astype(np.int64)
    windows = {tuple(math[i * 33 : i * 33 + 32]) for i in range(len(math) // 33)}
    seen = [tuple(row.tolist()) for batch in one for row in batch if tuple(row.tolist()) in windows]
    assert len(seen) == 24 == round(0.1 * 30 * 8) and len(set(seen)) == len(seen)  # no window twice in its epoch
    in_order = [tuple(math[i * 33 : i * 33 + 32]) for i in range(len(seen))]
    assert seen != in_order  # shuffled


def test_the_data_position_survives_a_change_of_data_parallel_degree(token_folders):
    """Saved by 2 ranks (batch 4, no loader worker) after 3 global batches, loaded by 4 ranks (batch
    2, one worker each) through the checkpointer's own loader restore: the global sequence goes on as
    1 process reads it, no sample repeated or skipped."""
    from titanlite.checkpoint.checkpointer import Checkpointer, json_tensor
    from titanlite.rollback import Batches

    mixture = "0.5 {web},0.3 {code},0.2 {math}".format(**token_folders)
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


def test_a_rollback_reads_token_files_again_from_the_checkpoints_position(token_folders):
    """A loader that read 6 microbatches, set back to the position after 3 (as a rollback does through
    the checkpointer), reads the 4th next, with no worker and with a persistent one."""
    from titanlite.checkpoint.checkpointer import Checkpointer, json_tensor
    from titanlite.rollback import Batches

    mixture = "0.6 {web},0.4 {math}".format(**token_folders)
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


TIMINGS = {"tps", "tflops", "mfu", "memory_gib", "step_time_s", "data_share", "elapsed_s"}


def metrics(folder: Path) -> list[dict]:
    """metrics.jsonl's rows without the timings (no two runs share those)."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMINGS} for row in rows]


def test_training_from_shards_logs_the_text_paths_losses(token_folders, tmp_path):
    """Shuffle off, 1 process: 4 steps from the prepared folder log the text path's losses bitwise."""
    text = tmp_path / "text"
    launch(1, tiny_args(token_folders["web_text"], text, "--training.steps", "4", "--training.data_split", "sequences"))
    shards = tmp_path / "shards"
    launch(1, tiny_args(token_folders["web"], shards, "--training.steps", "4", "--training.dataset_shuffle", "false"))
    a, b = ([r["loss"] for r in metrics(f) if "loss" in r] for f in (text, shards))
    assert len(a) == len(b) == 4 and a == b and all(x == x for x in a), (a, b)


def test_a_three_source_mixture_on_fsdp2_resumes_bitwise_and_reports_each_source(token_folders, tmp_path):
    """FSDP 2, three shuffled sources, validation on two held-out ones: stopped at step 3 and resumed,
    steps 4-6 log what the straight run logs, bit for bit; each source's tokens seen follow its weight
    and each validation source has its loss, the validation loss their weighted mean."""
    import shutil

    mixture = "0.6 {web},0.3 {code},0.1 {math}".format(**token_folders)
    args = ["--training.steps", "6", "--training.dataset_mixture", mixture, "--checkpoint.enable", "--checkpoint.interval", "3",
            "--lr_scheduler.decay_ratio", "0", "--validation.enable", "true", "--validation.freq", "3", "--validation.steps", "2",
            "--validation.dataset_mixture", "0.25 {code},0.75 {math}".format(**token_folders), "--training.local_batch_size", "5"]
    straight = tmp_path / "straight"
    launch(2, tiny_args(token_folders["web"], straight, *args))
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoint" / "step-6")
    rows = metrics(straight)
    kept = [line for line in (straight / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= 3]
    (resumed / "metrics.jsonl").write_text("".join(line + "\n" for line in kept))
    out = launch(2, tiny_args(token_folders["web"], resumed, *args))
    assert "loaded checkpoint" in out.stdout + out.stderr
    assert metrics(resumed) == rows  # every row of steps 4-6 bitwise, timings aside
    train_rows = [r for r in rows if "loss" in r]
    last = train_rows[-1]
    assert [last[f"tokens_seen_{n}"] for n in ("web", "code", "math")] == [6 * 10 * 32 * w for w in (0.6, 0.3, 0.1)]
    validation = [r for r in rows if "val_loss" in r]
    assert len(validation) == 2
    for r in validation:
        assert r["val_loss"] == pytest.approx(0.25 * r["val_loss_code"] + 0.75 * r["val_loss_math"], rel=1e-6)


def test_loader_workers_read_the_main_process_batches_and_resume_exactly(token_folders):
    """Two loader workers (each reads every other microbatch) give the batches of none, and a loader
    restored from their state after 5 batches goes on with batch 6."""
    mixture = "0.7 {web},0.3 {math}".format(**token_folders)
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
