"""Peak memory per rank of the real trainer with and without a memory-saving feature.

    python scripts/memory.py cp [--seq-len 4096] [--steps 3]     # context parallel 1 vs 2
    python scripts/memory.py ac [--seq-len 2048] [--batch 4]     # activation checkpointing none / op / full

Each variant runs the debug model for a few steps (titanlite.launch.trainer_command: torchrun for several
ranks); the script reads its metrics.jsonl and prints peak memory per rank (CUDA: max reserved; CPU: peak RSS,
including ~0.5 GiB of process baseline) and the last loss (which must not change).
"""

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from titanlite.launch import trainer_command

REPO = Path(__file__).resolve().parent.parent
VARIANTS = {
    "cp": [("CP 1", 1, []), ("CP 2", 2, ["--parallelism.context_parallel_degree", "2"])],
    "ac": [
        ("AC none", 1, []),
        ("AC selective op", 1, ["--activation_checkpoint.mode", "selective"]),
        ("AC full", 1, ["--activation_checkpoint.mode", "full"]),
    ],
}


def run(nproc: int, extra: list[str], args, folder: Path) -> dict:
    cmd = trainer_command(nproc, [
        "--job.config_file", str(REPO / "train_configs/debug_model.toml"),
        "--training.seq_len", str(args.seq_len), "--training.local_batch_size", str(args.batch),
        "--training.steps", str(args.steps), "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
        "--validation.enable", "false", "--job.dump_folder", str(folder), *extra,
    ])
    subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()][-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("feature", choices=sorted(VARIANTS))
    parser.add_argument("--seq-len", type=int, default=None, help="default: 4096 for cp, 2048 for ac")
    parser.add_argument("--batch", type=int, default=None, help="default: 1 for cp, 4 for ac")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    args.seq_len = args.seq_len or (4096 if args.feature == "cp" else 2048)
    args.batch = args.batch or (1 if args.feature == "cp" else 4)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, nproc, extra) in enumerate(VARIANTS[args.feature]):
            print(f"running {name} ({nproc} process(es)), seq_len {args.seq_len}, batch {args.batch} ...", flush=True)
            rows.append((name, run(nproc, extra, args, Path(tmp) / str(i))))
    print(f"\n{'variant':<18} {'peak memory per rank (GiB)':>28} {'loss at last step':>18}")
    for name, row in rows:
        print(f"{name:<18} {row['memory_gib']:>28.2f} {row['loss']:>18.4f}")


if __name__ == "__main__":
    main()
