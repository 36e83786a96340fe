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


def documents_file(path: Path, n: int = 200, seed: int = 0) -> Path:
    """synthetic_documents(n, seed) as a JSON-lines file at `path`, one {"text": ...} per line."""
    import json

    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in synthetic_documents(n, seed)))
    return path


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


def train_losses(config_file: str, steps: int, runs: dict[str, list[str]], dump_folder: str) -> dict[str, list[float]]:
    """Each run's logged loss per step: `steps` steps of train_configs/`config_file` on its built-in
    corpus (seq 64, batch 4, the same batches for every run) with the run's extra args."""
    import json

    import torch

    from titanlite.config import parse_args
    from titanlite.train import train
    from titanlite.trainer import Trainer

    losses = {}
    for name, extra in runs.items():
        config = parse_args([
            "--job.config_file", str(REPO / "train_configs" / config_file),
            "--job.dump_folder", f"{dump_folder}/{name}", "--training.steps", str(steps), "--training.seq_len", "64",
            "--training.local_batch_size", "4", "--lr_scheduler.warmup_steps", "5", "--metrics.log_freq", "1",
            "--metrics.enable_tensorboard", "false", "--validation.enable", "false", "--metrics.peak_flops", "1e12", *extra,
        ])
        train(Trainer(config, torch.device("cpu")))
        rows = [json.loads(line) for line in open(f"{dump_folder}/{name}/metrics.jsonl")]
        losses[name] = [r["loss"] for r in rows if "loss" in r]
    return losses


def run_train_env_vars() -> set[str]:
    """The environment variables run_train.sh reads (${NAME...}), less the process ids it records itself."""
    import re

    script = (Path(__file__).resolve().parent.parent / "run_train.sh").read_text()
    own = set(re.findall(r"(\w+)=\$!", script))
    return set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)(?::[-?+]|\})", script)) - own


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


def launch(nproc: int, args: list[str], expect: int | None = 0, timeout: float = 300, env: dict | None = None,
           restarts: int = 0, agent: bool = False):
    """titanlite.launch.trainer_command (torchrun for several ranks, restarts or `agent`; one process
    runs the trainer itself) on CPU ranks of one thread each. Asserts the exit code is `expect` (None:
    any); returns the CompletedProcess. Tests of the launcher itself pass agent=True or run run_train.sh."""
    import os

    from titanlite.launch import trainer_command

    cmd = trainer_command(nproc, args, max_restarts=restarts, agent=agent)
    out = run_command(cmd, timeout=timeout, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert expect is None or out.returncode == expect, (out.returncode, out.stderr[-3000:])
    return out


def mtp_reference_loss(model, x, y, weight: float, token_inputs: dict | None = None, bos_id: int | None = None,
                       eos_id: int | None = None):
    """(objective, the model's own loss), both summed over tokens, of a model with DeepSeek-V3's
    multi-token prediction, by DeepSeek's formula: depth k reads the token k ahead of each position
    and predicts the one after, from the hidden state the previous head read (after the model's final
    norm, or depth k-1's), and its loss counts the T-k
    positions whose target lies in the window; objective = own + weight/D sum_k depth k's. The last
    k positions still run (reading token 0: causal attention keeps them from the others' outputs)
    because titanlite runs them: their tokens count in the MTP block's MoE balance. With `bos_id`
    (document masks; a document starts at each BOS and after each EOS) a depth's target in another
    document than its position does not count."""
    import torch

    from titanlite.loss import cross_entropy_sum

    tokens = torch.cat([x, y[:, -1:]], dim=1)
    s = x.shape[1]
    positions = (token_inputs or {}).get("positions")
    document_ids = (token_inputs or {}).get("document_ids")

    h = model.tok_embeddings(x)
    rope, mask = model.position_inputs(positions, document_ids, s)
    for layer in model.layers.values():
        h = layer(h, rope, mask)
    h = model.norm(h)
    own = cross_entropy_sum(model.output(h), y)
    depths = []
    for k, module in enumerate(model.mtp.values(), 1):
        ahead = torch.cat([tokens[:, k : s + 1], torch.zeros_like(tokens[:, : k - 1])], dim=1)
        h = module.norm(module(h, model.tok_embeddings(ahead), rope, mask))
        targets = tokens[:, k + 1 : s + 1]
        if bos_id is not None:  # documents numbered by the starts seen so far
            starts = tokens == bos_id
            if eos_id is not None:
                starts[:, 1:] |= tokens[:, :-1] == eos_id
            documents = starts.cumsum(dim=1)
            targets = targets.masked_fill(documents[:, k + 1 : s + 1] != documents[:, : s - k], -100)
        logits = model.output(h)[:, : s - k]
        depths.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum"))
    return own + weight / len(depths) * sum(depths), own


def random_hf_model(model_class, config):
    """A transformers model of `config` in eval mode, seeded, its norm weights drawn from [0.5, 1.5]
    (away from 1, so a norm misplaced or ignored on our side shows in the logits)."""
    import torch

    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model
