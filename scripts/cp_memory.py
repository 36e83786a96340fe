"""Peak memory per rank of a long-sequence run with and without context parallel.

    python scripts/cp_memory.py [--seq-len 4096] [--cp 2] [--steps 3]

Runs the debug model through the real CLI (torchrun -m titanlite.train) at seq_len tokens with
CP 1 (one process) and CP N (N processes), reads each run's metrics.jsonl, and prints the peak
memory per rank (CUDA: max reserved; CPU: peak RSS, which includes ~0.5 GiB of process baseline).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(nproc: int, cp: int, seq_len: int, steps: int, folder: Path) -> dict:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        "-m", "titanlite.train", "--job.config_file", str(REPO / "train_configs/debug_model.toml"),
        "--training.seq_len", str(seq_len), "--training.local_batch_size", "1", "--training.steps", str(steps),
        "--parallelism.context_parallel_degree", str(cp), "--metrics.log_freq", "1",
        "--metrics.enable_tensorboard", "false", "--validation.enable", "false", "--job.dump_folder", str(folder),
    ]
    print(f"running CP {cp} on {nproc} process(es), seq_len {seq_len} ...", flush=True)
    subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return rows[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        single = run(1, 1, args.seq_len, args.steps, Path(tmp) / "cp1")
        split = run(args.cp, args.cp, args.seq_len, args.steps, Path(tmp) / f"cp{args.cp}")
    print(f"\nseq_len {args.seq_len}, debug model, batch 1")
    print(f"{'layout':<8} {'peak memory per rank (GiB)':>28} {'loss at last step':>18}")
    for name, row in (("CP 1", single), (f"CP {args.cp}", split)):
        print(f"{name:<8} {row['memory_gib']:>28.2f} {row['loss']:>18.4f}")
    print(f"CP {args.cp} uses {100 * (1 - split['memory_gib'] / single['memory_gib']):.0f}% less peak memory per rank")


if __name__ == "__main__":
    main()
