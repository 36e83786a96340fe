"""Data: local formats, the built-in corpus, packing, per-rank disjoint reads, exact loader resume,
and a fast, clear failure for hub names without network."""

import signal
import time

import pytest
import torch

from titanlite.config import ConfigError, parse_args
from titanlite.data.dataset import TokenWindows, build_dataloader, load_documents
from titanlite.data.tokenizer import ByteTokenizer

from helpers import synthetic_documents


def config_for(path, *extra):
    return parse_args(["--training.dataset", str(path), "--training.seq_len", "16", "--training.local_batch_size", "3", *extra])


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "parquet", "txt", "shards"])
def test_local_formats_yield_every_document(corpus_formats, fmt):
    docs = [d["text"] for d in load_documents(str(corpus_formats[fmt]), "", "train")]
    assert sorted(docs) == sorted(synthetic_documents())


def test_glob_and_dataset_path(corpus_formats):
    shards = corpus_formats["shards"]
    assert len(list(load_documents(str(shards / "part-[01].jsonl"), "", "train"))) == 50
    assert len(list(load_documents("anything", str(shards), "train"))) == 200  # dataset_path wins


def test_missing_local_path_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="matches no files"):
        load_documents(str(tmp_path / "none" / "*.jsonl"), "", "train")


def test_packing_concatenates_documents_with_bos_eos(corpus_formats):
    tok = ByteTokenizer()
    docs = load_documents(str(corpus_formats["jsonl"]), "", "train")
    windows = list(TokenWindows(docs, tok, seq_len=16, infinite=False))
    stream = []
    for text in synthetic_documents():
        stream += tok.encode(text)
    assert len(windows) == len(stream) // 17
    for i, (x, y) in enumerate(windows):
        chunk = torch.tensor(stream[i * 17 : (i + 1) * 17])
        assert torch.equal(x, chunk[:-1]) and torch.equal(y, chunk[1:])


def test_data_parallel_ranks_read_disjoint_documents(corpus_formats):
    seen = []
    for rank in range(4):
        docs = load_documents(str(corpus_formats["shards"]), "", "train")
        from datasets.distributed import split_dataset_by_node

        seen.append({d["text"] for d in split_dataset_by_node(docs, rank=rank, world_size=4)})
    assert sum(len(s) for s in seen) == 200
    assert len(set.union(*seen)) == 200


def test_loader_resumes_exactly_mid_epoch(corpus_jsonl):
    config = config_for(corpus_jsonl)
    tok = ByteTokenizer()
    straight = build_dataloader(config, tok, dp_rank=1, dp_degree=2)
    it = iter(straight)
    expected = [next(it) for _ in range(400)]  # several epochs: the stream repeats

    first = build_dataloader(config, tok, dp_rank=1, dp_degree=2)
    it = iter(first)
    for _ in range(137):
        next(it)
    state = first.state_dict()
    resumed = build_dataloader(config, tok, dp_rank=1, dp_degree=2)
    resumed.load_state_dict(state)
    it = iter(resumed)
    for want in expected[137:]:
        got = next(it)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_builtin_shakespeare_has_train_and_validation():
    train = [d["text"] for d in load_documents("shakespeare", "", "train")]
    validation = [d["text"] for d in load_documents("shakespeare", "", "validation")]
    assert 550 < len(train) < 700 and 20 < len(validation) < 50
    assert not set(train) & set(validation)
    assert any("Romeo" in t for t in train + validation)


def test_validation_of_local_files_needs_a_held_out_set(corpus_jsonl):
    with pytest.raises(ConfigError, match="validation.dataset"):
        build_dataloader(config_for(corpus_jsonl), ByteTokenizer(), 0, 1, split="validation")
    loader = build_dataloader(config_for(corpus_jsonl, "--validation.dataset", str(corpus_jsonl)), ByteTokenizer(), 0, 1, "validation")
    assert len(list(loader)) > 0  # finite


def test_hub_name_offline_fails_fast_naming_the_local_alternative():
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        load_documents("allenai/c4", "", "train")
    assert time.monotonic() - start < 5
    assert "allenai/c4" in str(err.value) and "shakespeare" in str(err.value)


def test_hub_name_without_network_fails_fast(monkeypatch):
    """No offline flag, but the endpoint does not answer: fail in seconds, not after minutes of retries."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    start = time.monotonic()
    with pytest.raises(ConfigError, match="unreachable"):
        load_documents("allenai/c4", "", "train")
    assert time.monotonic() - start < 5


def test_missing_text_field(corpus_jsonl):
    loader = build_dataloader(config_for(corpus_jsonl, "--training.dataset_text_field", "body"), ByteTokenizer(), 0, 1)
    with pytest.raises(ConfigError, match="dataset_text_field='body'.*columns: \\['text'\\]"):
        next(iter(loader))


def test_sequence_split_gives_every_layout_the_same_global_batches(corpus_jsonl):
    tok = ByteTokenizer()
    whole = iter(build_dataloader(config_for(corpus_jsonl, "--training.local_batch_size", "4"), tok, 0, 1))
    halves = [
        iter(build_dataloader(config_for(corpus_jsonl, "--training.local_batch_size", "2", "--training.data_split", "sequences"), tok, r, 2))
        for r in range(2)
    ]
    for _ in range(30):
        x, y = next(whole)
        parts = [next(h) for h in halves]
        assert torch.equal(x, torch.cat([p[0] for p in parts])) and torch.equal(y, torch.cat([p[1] for p in parts]))


def test_a_rank_without_documents_fails_instead_of_spinning(tmp_path):
    """One document over 2 data-parallel ranks with data_split='documents': rank 1 reads none, and
    reading the stream again and again would never give it a window (its peers would wait forever)."""
    one = tmp_path / "one.jsonl"
    one.write_text('{"text": "a single document"}\n')
    loader = build_dataloader(config_for(one), ByteTokenizer(), dp_rank=1, dp_degree=2)

    def spinning(signum, frame):
        raise AssertionError("the loader kept reading an empty stream")

    previous = signal.signal(signal.SIGALRM, spinning)  # a regression would spin, not fail: bound it
    signal.alarm(60)
    try:
        with pytest.raises(ConfigError, match="holds no document for this data-parallel rank"):
            next(iter(loader))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_file_damaged_past_its_first_bytes_stops_with_one_line(tmp_path):
    """The sniff reads 64 KiB; a line broken after that stops the loader with a ConfigError naming the
    file and how far it got, not a traceback from inside `datasets`."""
    import json

    from titanlite.data.dataset import open_source
    from titanlite.data.sources import resolve_source

    path = tmp_path / "late.jsonl"
    good = "".join(json.dumps({"text": f"document {i} " * 8}) + "\n" for i in range(1000))
    assert len(good) > 1 << 16
    path.write_text(good + '{"text": "cut off\n' + good)
    windows = TokenWindows(open_source(resolve_source(str(path), None), "train"), ByteTokenizer(), 64, files=str(path))
    with pytest.raises(ConfigError, match=rf"dataset '{path}' could not be read after \d+ documents \("):
        for _ in windows:
            pass
