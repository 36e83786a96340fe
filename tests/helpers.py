"""Helpers shared by tests and their spawned worker processes (importable, unlike conftest)."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

WORDS = (
    "the king queen lord lady sword crown night day love death heart blood fair foul speak hear see "
    "thou thee thy art hath doth shall will good noble sweet gentle brave true false honour grace"
).split()


def synthetic_documents(n: int = 200, seed: int = 0) -> list[str]:
    """Seeded pseudo-English documents of 20-200 words: exact control over content, no downloads."""
    import random

    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(20, 200))]
        docs.append(" ".join(words).capitalize() + ".")
    return docs


def tiny_args(dataset: Path, dump_folder: Path, *extra: str) -> list[str]:
    """CLI args of a tiny, fast run: byte tokenizer, short sequences, no TensorBoard, fixed MFU peak."""
    return [
        "--job.config_file", str(REPO / "train_configs" / "debug_model.toml"),
        "--model.hf_assets_path", "byte",
        "--training.dataset", str(dataset),
        "--training.seq_len", "32",
        "--training.local_batch_size", "2",
        "--training.steps", "5",
        "--lr_scheduler.warmup_steps", "2",
        "--metrics.log_freq", "1",
        "--metrics.peak_flops", "1e12",
        "--metrics.enable_tensorboard", "false",
        "--validation.enable", "false",
        "--validation.seq_len", "32",
        "--validation.local_batch_size", "2",
        "--job.dump_folder", str(dump_folder),
        *extra,
    ]


def run_command(cmd: list[str], timeout: float = 300, **kwargs):
    """subprocess.run in its own process group, killed whole on timeout (torchrun's workers too)."""
    import os
    import signal
    import subprocess

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n{stdout[-2000:]}\n{stderr[-2000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
