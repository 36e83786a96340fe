"""Rebuild the bundled default tokenizer: a byte-level BPE trained on the built-in 'shakespeare' corpus.

    python scripts/train_tokenizer.py [--vocab-size 8192] [--out titanlite/assets/shakespeare_bpe8k/tokenizer.json]

Training is deterministic: the output equals the committed file byte for byte (checked by a test).
"""

import argparse
import time
from pathlib import Path

from titanlite.data.corpus import read_texts, shakespeare_files
from titanlite.data.tokenizer import BUILTIN, train_bpe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=BUILTIN["shakespeare-bpe8k"])
    args = parser.parse_args()
    start = time.time()
    texts = list(read_texts(shakespeare_files()["train"]))
    print(f"training a {args.vocab_size}-token BPE on {len(texts)} documents ...", flush=True)
    tok = train_bpe(texts, args.vocab_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out))
    print(f"wrote {args.out} (vocab {tok.get_vocab_size()}) in {time.time() - start:.1f}s")


if __name__ == "__main__":
    main()
