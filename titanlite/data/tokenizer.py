"""Tokenizers: byte-level (no files), Hugging Face tokenizer.json, and tiktoken files.

All expose encode(text, bos, eos) -> list[int], decode(ids), vocab_size, bos_id, eos_id.
The default is a byte-level BPE (vocab 8192) trained on the built-in corpus; it ships with the
package and `scripts/train_tokenizer.py` rebuilds it bit for bit.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from titanlite.errors import ConfigError

ASSETS = Path(__file__).resolve().parent.parent / "assets"
BUILTIN = {"shakespeare-bpe8k": ASSETS / "shakespeare_bpe8k" / "tokenizer.json"}
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
# Llama 3's pre-tokenizer split (the cl100k pattern), without possessive quantifiers.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_NUM_SPECIAL = 256


class Tokenizer:
    vocab_size: int
    bos_id: int
    eos_id: int
    fingerprint: str = "byte"  # sha256 of its files: a prepared folder records the one it was made with

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        ids = self._encode(text)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def _encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    """IDs 0-255 are UTF-8 bytes; then BOS, EOS, PAD."""

    bos_id, eos_id, pad_id, vocab_size = 256, 257, 258, 259

    def _encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json` (Llama 3's loads as is); BOS/EOS found among its added tokens."""

    def __init__(self, path: Path, key: str = "model.hf_assets_path"):
        from tokenizers import Tokenizer as _HF

        try:
            self.tok = _HF.from_file(str(path))
        except Exception as e:  # tokenizers raises its own Exception for bad JSON or a wrong schema
            raise unreadable(key, path, e, "a tokenizer.json saved by Hugging Face tokenizers")
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        if self.tok.get_vocab_size(with_added_tokens=False) == 0:
            raise ConfigError(f"{key}: tokenizer '{path}' has no vocabulary; use a trained tokenizer.json, or 'byte'")
        config = path.parent / "tokenizer_config.json"
        try:
            named = json.loads(config.read_text()) if config.exists() else {}
        except (ValueError, UnicodeDecodeError) as e:
            raise unreadable(key, config, e, "valid JSON (or remove it)")
        self.bos_id = self._special(named.get("bos_token"), (BOS, "<s>", "<|endoftext|>"))
        self.eos_id = self._special(named.get("eos_token"), (EOS, "</s>", "<|endoftext|>", "<|eot_id|>"))

    def _special(self, configured, candidates) -> int:
        if isinstance(configured, dict):
            configured = configured.get("content")
        for token in ([configured] if configured else []) + list(candidates):
            token_id = self.tok.token_to_id(token)
            if token_id is not None:
                return token_id
        raise ConfigError(f"tokenizer has none of the special tokens {candidates}; add one to its tokenizer_config.json")

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


class TiktokenTokenizer(Tokenizer):
    """A tiktoken ranks file (e.g. Llama 3's tokenizer.model): Llama 3 split pattern and special tokens."""

    def __init__(self, path: Path, key: str = "model.hf_assets_path"):
        try:
            import tiktoken
            from tiktoken.load import load_tiktoken_bpe
        except ImportError:
            raise ConfigError(f"{key}: '{path}' is a tiktoken file; pip install tiktoken to read it")
        try:
            ranks = load_tiktoken_bpe(str(path))  # a local path: tiktoken only fetches strings containing '://'
        except (ValueError, UnicodeDecodeError) as e:  # binascii.Error is a ValueError
            raise unreadable(key, path, e, "a tiktoken ranks file (base64 token and rank per line)")
        n = len(ranks)
        if n == 0:
            raise ConfigError(f"{key}: tokenizer '{path}' has no vocabulary; use a trained tiktoken file, or 'byte'")
        names = [BOS, EOS] + [f"<|reserved_special_token_{i}|>" for i in range(LLAMA3_NUM_SPECIAL - 2)]
        specials = {name: n + i for i, name in enumerate(names)}
        self.enc = tiktoken.Encoding(path.name, pat_str=SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
        self.bos_id, self.eos_id = specials[BOS], specials[EOS]
        self.vocab_size = n + LLAMA3_NUM_SPECIAL

    def _encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode([i for i in ids if i < self.bos_id])


def unreadable(key: str, path: Path, error: Exception, expected: str) -> ConfigError:
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    return ConfigError(f"{key}: '{path}' cannot be read as a tokenizer ({reason}); it must be {expected}")


def build_tokenizer(location: str, key: str = "model.hf_assets_path") -> Tokenizer:
    """The tokenizer at `location` (the value of config key `key`, named in errors)."""
    path = tokenizer_file(location, key)
    if path is None:
        return ByteTokenizer()
    tokenizer = HFTokenizer(path, key) if path.suffix == ".json" else TiktokenTokenizer(path, key)
    digest = hashlib.sha256(path.read_bytes())
    if (path.parent / "tokenizer_config.json").is_file():  # it can rename BOS and EOS
        digest.update((path.parent / "tokenizer_config.json").read_bytes())
    tokenizer.fingerprint = digest.hexdigest()
    return tokenizer


def tokenizer_file(location: str, key: str = "model.hf_assets_path") -> Path | None:
    """The file behind a tokenizer location (None for 'byte'): a bundled name, a file, or a folder with
    tokenizer.json or tokenizer.model (Llama 3's original/ folder too); ConfigError if there is none."""
    if location == "byte":
        return None
    path = BUILTIN.get(location) or Path(location).expanduser()
    if path.is_dir():
        for name in ("tokenizer.json", "tokenizer.model", "original/tokenizer.model"):
            if (path / name).exists():
                path = path / name
                break
    if not path.is_file():
        raise ConfigError(
            f"{key}='{location}' is not a tokenizer file or a folder with tokenizer.json or tokenizer.model; "
            f"use 'byte', one of {sorted(BUILTIN)}, or a local Hugging Face assets folder"
        )
    return path


def train_bpe(texts, vocab_size: int):
    """Train a Llama-3-shaped byte-level BPE (regex split, ByteLevel, BOS/EOS/PAD). Deterministic."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as _HF

    tok = _HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok
