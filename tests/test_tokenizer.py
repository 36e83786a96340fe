"""Tokenizers: byte, tokenizer.json (trained here and the bundled one), tiktoken files."""

import base64

import pytest

from titanlite.config import ConfigError
from titanlite.data.tokenizer import BUILTIN, ByteTokenizer, build_tokenizer, train_bpe

from helpers import synthetic_documents

TEXT = "To be, or not to be: that is the question.\nWhether 'tis nobler — ünïcödé 123456."


def test_byte_round_trip():
    tok = build_tokenizer("byte")
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids) == TEXT
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 259
    assert tok.encode("a", bos=False, eos=False) == [97]


def test_trained_bpe_round_trip(tmp_path):
    tok = train_bpe(synthetic_documents(), vocab_size=400)
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = build_tokenizer(str(tmp_path))  # a folder holding tokenizer.json
    ids = loaded.encode(TEXT)
    assert loaded.decode(ids) == TEXT
    assert (loaded.bos_id, loaded.eos_id) == (0, 1)
    assert len(loaded.encode("the king and the queen", bos=False, eos=False)) < len("the king and the queen")


def test_bpe_training_is_deterministic():
    a = train_bpe(synthetic_documents(), vocab_size=400).to_str()
    b = train_bpe(synthetic_documents(), vocab_size=400).to_str()
    assert a == b


def test_bundled_tokenizer():
    tok = build_tokenizer("shakespeare-bpe8k")
    assert tok.vocab_size == 8192
    assert tok.decode(tok.encode(TEXT)) == TEXT
    line = "O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name."
    assert len(tok.encode(line, bos=False, eos=False)) < len(line) / 3  # ~3.8 bytes/token on its corpus


@pytest.mark.slow
def test_bundled_tokenizer_is_reproducible(tmp_path):
    """Retraining on the default corpus (as scripts/train_tokenizer.py does) gives the committed file."""
    from titanlite.data.corpus import read_texts, shakespeare_files

    train_bpe(list(read_texts(shakespeare_files()["train"])), 8192).save(str(tmp_path / "tokenizer.json"))
    assert (tmp_path / "tokenizer.json").read_bytes() == BUILTIN["shakespeare-bpe8k"].read_bytes()


def test_tiktoken_file(tmp_path):
    pytest.importorskip("tiktoken")
    # Write the ranks of a small trained BPE in tiktoken's format: base64(token bytes) rank.
    bpe = train_bpe(synthetic_documents(), vocab_size=400)
    byte_decoder = {c: b for b, c in _bytes_to_unicode().items()}
    lines = []
    for token, rank in sorted(bpe.get_vocab().items(), key=lambda kv: kv[1]):
        if token.startswith("<|"):
            continue
        raw = bytes(byte_decoder[c] for c in token)
        lines.append(f"{base64.b64encode(raw).decode()} {len(lines)}")
    path = tmp_path / "tokenizer.model"
    path.write_text("\n".join(lines) + "\n")
    tok = build_tokenizer(str(path))
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert tok.bos_id == len(lines) and tok.vocab_size == len(lines) + 256


def _bytes_to_unicode():
    """GPT-2's reversible byte <-> printable-unicode table used by ByteLevel BPEs."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="model.hf_assets_path='.*nope' is not a tokenizer file"):
        build_tokenizer(str(tmp_path / "nope"))
