"""Data benchmarks (docs/benchmarks.md): prepare's tokens/s on 1 and N processes, the loader's tokens/s
from token files (a 3-source mixture, shuffled, seq_len 8192, 0 workers), and the loader's resident
memory on a small and a 500M-token synthetic dataset (generated here, deleted after).

    python scripts/benchmark_data.py [--work /tmp/titanlite_data_bench] [--tokens 500e6]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from titanlite.data.formats import write_index  # noqa: E402


def synthetic_text(path: Path, documents: int) -> Path:
    rng = np.random.default_rng(0)
    words = "the king queen lord lady sword crown night day love death heart blood fair foul speak hear see".split()
    with open(path, "w") as f:
        for _ in range(documents):
            text = " ".join(rng.choice(words, size=int(rng.integers(50, 800))))
            f.write(json.dumps({"text": text}) + "\n")
    return path


def prepare_speed(work: Path, documents: int, workers: list[int]) -> dict[int, float]:
    """Tokens/s of `python -m titanlite.data.prepare` with the default tokenizer, per process count."""
    text = synthetic_text(work / "text.jsonl", documents)
    speeds = {}
    for n in workers:
        out = work / f"prepared_{n}"
        shutil.rmtree(out, ignore_errors=True)
        cmd = [sys.executable, "-m", "titanlite.data.prepare", str(out), "--training.dataset", str(text), "--workers", str(n)]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "HF_DATASETS_OFFLINE": "1"})
        if done.returncode:
            raise SystemExit(done.stderr)
        line = done.stderr.strip().splitlines()[-1]
        speeds[n] = float(re.search(r"\(([\d,]+) tokens/s", line).group(1).replace(",", ""))
        print(f"prepare, {n} process(es): {line}", flush=True)
    return speeds


def token_source(prefix: Path, tokens: int, vocab: int = 8192) -> str:
    """A Megatron pair of random ids, written in pieces (documents of 2,000 tokens)."""
    rng = np.random.default_rng(len(str(prefix)))
    with open(f"{prefix}.bin", "wb") as f:
        left = tokens
        while left:
            n = min(left, 1 << 24)
            f.write(rng.integers(0, vocab, size=n, dtype=np.uint16).tobytes())
            left -= n
    lengths = np.full(tokens // 2000, 2000, dtype=np.int64)
    lengths[-1] += tokens - lengths.sum()
    write_index(Path(f"{prefix}.idx"), np.dtype(np.uint16), lengths)
    return str(prefix)


def rss_mib() -> tuple[float, float]:
    """(anonymous, file-backed) resident memory of this process, MiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return tuple(int(fields[k].split()[0]) / 1024 for k in ("RssAnon", "RssFile"))


def loader_run(mixture: str, batches: int, seq_len: int, batch: int) -> tuple[float, tuple[float, float]]:
    from titanlite.config import parse_args
    from titanlite.data.dataset import build_dataloader
    from titanlite.data.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    tokenizer.vocab_size = 8192  # the synthetic ids' range (only the files' dtype depends on it)
    config = parse_args(["--training.dataset_mixture", mixture, "--training.seq_len", str(seq_len),
                         "--training.local_batch_size", str(batch)])
    loader = build_dataloader(config, tokenizer, 0, 1)
    it = iter(loader)
    next(it)
    start = time.perf_counter()
    for _ in range(batches):
        x, y = next(it)
    seconds = time.perf_counter() - start
    return batches * batch * seq_len / seconds, rss_mib()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/titanlite_data_bench"))
    parser.add_argument("--tokens", type=float, default=500e6, help="tokens of the large synthetic dataset")
    parser.add_argument("--documents", type=int, default=20000, help="documents of prepare's synthetic text")
    parser.add_argument("--batches", type=int, default=400)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    try:
        speeds = prepare_speed(args.work, args.documents, [1, os.cpu_count() or 1])
        results = {"prepare_tokens_per_s": speeds}
        for label, total in (("small", int(args.tokens) // 10), ("large", int(args.tokens))):
            prefixes = [token_source(args.work / f"{label}_{name}", int(total * share), 8192)
                        for name, share in (("web", 0.7), ("code", 0.2), ("math", 0.1))]
            mixture = ",".join(f"{w} {p}" for w, p in zip((0.6, 0.3, 0.1), prefixes))
            # Each measurement in a fresh process, so one's memory is not the other's.
            code = (f"import sys; sys.path.insert(0, {str(REPO / 'scripts')!r}); import benchmark_data as b; "
                    f"print(b.loader_run({mixture!r}, {args.batches}, 8192, 8))")
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
            if out.returncode:
                raise SystemExit(out.stderr)
            speed, (anon, file_backed) = eval(out.stdout.strip().splitlines()[-1])
            results[label] = {"tokens": total, "loader_tokens_per_s": speed, "rss_anon_mib": anon, "rss_file_mib": file_backed}
            print(f"loader, {label} ({total / 1e6:.0f}M tokens, 3 sources, shuffled, seq_len 8192, batch 8, 0 workers): "
                  f"{speed / 1e6:.1f}M tokens/s; resident {anon:.0f} MiB anonymous + {file_backed:.0f} MiB of mapped "
                  f"files after {args.batches} batches", flush=True)
        print(json.dumps(results))
    finally:
        shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
