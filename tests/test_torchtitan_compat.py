"""TorchTitan v0.2.2's keys that titanlite implements, through the real CLI: float8 as a converter,
Hugging Face assets, the stage split's less_layers, config printing and saving, debug.seed, the
comm.mode dry run, full bf16, FSDP CPU offload, loader workers, first-step / load-only checkpoints,
the lr schedule's total_steps, colours, and Weights & Biases (offline)."""

import glob
import json
import os
import struct
import sys

import pytest
import torch

from helpers import REPO, launch, run_command, tiny_args

pytestmark = pytest.mark.slow


def run_train_sh(ngpu: int, args: list[str]):
    """Through run_train.sh: a rank's config error comes back as one line and exit code 2."""
    env = {**os.environ, "NGPU": str(ngpu), "PYTHON": sys.executable}
    return run_command(["./run_train.sh", *args[2:]], cwd=REPO, env=env)  # it passes --job.config_file itself


def losses(folder) -> list[float]:
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def test_float8_converter_config_printing_all_ranks_metrics_and_whole_validation_on_two_ranks(corpus_jsonl, tmp_path):
    small = tmp_path / "validation.jsonl"
    small.write_text("".join(corpus_jsonl.read_text().splitlines(keepends=True)[:20]))
    out = launch(2, tiny_args(corpus_jsonl, tmp_path, "--training.steps", "2", "--model.converters", "float8",
                              "--quantize.linear.float8.emulate", "true", "--job.print_config",
                              "--job.save_config_file", "resolved/config.json", "--model.print_after_conversion",
                              "--metrics.enable_tensorboard", "true", "--metrics.save_for_all_ranks",
                              "--validation.enable", "--validation.dataset", str(small), "--validation.steps", "-1"))
    assert sorted(p.relative_to(tmp_path / "tb").parts[0] for p in (tmp_path / "tb").rglob("events.out.tfevents.*")) == [
        "rank_0", "rank_1"]
    (validation,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if "val_loss" in line]
    assert validation["step"] == 2 and validation["val_loss"] > 0  # the whole (finite) set, then on
    assert "float8 tensorwise: 42 linear layers (emulated in high precision)" in out.stdout  # 6 blocks x 7; output filtered
    assert "Float8Linear(" in out.stdout  # print_after_conversion
    saved = json.loads((tmp_path / "resolved" / "config.json").read_text())
    assert saved["model"]["converters"] == ["float8"] and saved["quantize"]["linear"]["float8"]["emulate"] is True
    printed = out.stdout.split("titanlite: config: ", 1)[1]
    assert json.loads(printed[: printed.index("\n}") + 2]) == saved
    assert len(losses(tmp_path)) == 2


def test_hf_assets_folder_gives_the_tokenizer(corpus_jsonl, tmp_path):
    from titanlite.data.tokenizer import BUILTIN

    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "tokenizer.json").write_bytes(BUILTIN["shakespeare-bpe8k"].read_bytes())
    (assets / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}))
    args = tiny_args(corpus_jsonl, tmp_path / "run", "--training.steps", "1")
    args[args.index("--model.hf_assets_path") + 1] = str(assets)
    launch(1, args)
    # The deprecated model.tokenizer_path still works, wins over hf_assets_path, and says so.
    out = launch(1, [*args, "--model.tokenizer_path", "byte", "--job.dump_folder", str(tmp_path / "old")])
    assert "model.tokenizer_path is deprecated" in out.stdout
    assert losses(tmp_path / "old")[0] < losses(tmp_path / "run")[0]  # 259 byte tokens vs 8192: a lower first loss


def test_debug_seed_none_draws_one_shared_seed_and_a_seed_repeats_a_run(corpus_jsonl, tmp_path):
    same = ["--training.steps", "1", "--training.data_split", "sequences"]
    out = launch(2, tiny_args(corpus_jsonl, tmp_path / "drawn", *same, "--debug.seed", "none"))
    seed = int(out.stdout.split("debug.seed is none: seed ")[1].split()[0])
    assert f"seed = {seed}" in (tmp_path / "drawn" / "config.toml").read_text()  # the saved config repeats the run
    again = launch(1, tiny_args(corpus_jsonl, tmp_path / "set", *same, "--debug.seed", str(seed), "--training.local_batch_size", "4"))
    assert "drawn at random" not in again.stdout
    # FSDP ranks initialize their own shards: only one seed shared by both gives 1 process's weights.
    assert abs(losses(tmp_path / "drawn")[0] - losses(tmp_path / "set")[0]) < 1e-5


@pytest.mark.full  # in scripts/test_full.sh: the default suite stays under 20 minutes
def test_full_bf16_and_loader_workers_train(corpus_formats, tmp_path):
    from titanlite.checkpoint.reader import read_tensor_metadata

    launch(1, tiny_args(corpus_formats["shards"], tmp_path / "bf16", "--training.steps", "2", "--training.dtype", "bfloat16",
                        "--checkpoint.enable"))
    assert len(losses(tmp_path / "bf16")) == 2 and all(torch.isfinite(torch.tensor(losses(tmp_path / "bf16"))))
    _, saved = read_tensor_metadata(tmp_path / "bf16" / "checkpoint" / "step-2", ())
    weights = [m for key, m in saved.items() if key.startswith("model.")]
    moments = [m for key, m in saved.items() if key.startswith("optimizer.") and key.endswith(("exp_avg", "exp_avg_sq"))]
    assert weights and moments and {m.properties.dtype for m in weights + moments} == {torch.bfloat16}
    common = ["--training.steps", "3", "--training.data_split", "documents"]
    launch(2, tiny_args(corpus_formats["shards"], tmp_path / "plain", *common))
    launch(2, tiny_args(corpus_formats["shards"], tmp_path / "worker", *common, "--training.dataloader.num_workers", "1",
                        "--training.dataloader.prefetch_factor", "4"))
    assert losses(tmp_path / "worker") == losses(tmp_path / "plain")  # one worker reads what the rank itself would


def test_two_loader_workers_resume_exactly(corpus_formats, tmp_path):
    """Each worker reads whole files of the rank's share; the loader's state holds every worker's."""
    workers = ["--training.dataloader.num_workers", "2", "--checkpoint.enable", "--checkpoint.interval", "2",
               "--lr_scheduler.decay_ratio", "0"]
    launch(1, tiny_args(corpus_formats["shards"], tmp_path / "whole", *workers, "--training.steps", "4"))
    launch(1, tiny_args(corpus_formats["shards"], tmp_path / "split", *workers, "--training.steps", "2"))
    out = launch(1, tiny_args(corpus_formats["shards"], tmp_path / "split", *workers, "--training.steps", "4"))
    assert "loaded checkpoint" in out.stdout and "at step 2" in out.stdout
    assert losses(tmp_path / "split") == losses(tmp_path / "whole")
    # Another worker count reads the files in another order: the data restarts, said so, the rest resumes.
    out = launch(1, tiny_args(corpus_formats["shards"], tmp_path / "split", *workers[2:], "--training.steps", "6"))
    assert "data position NOT restored: saved with training.dataloader.num_workers=2, now 0" in out.stdout
    assert "at step 4" in out.stdout
    one_file = run_train_sh(1, tiny_args(corpus_formats["jsonl"], tmp_path / "one", "--training.dataloader.num_workers", "2"))
    assert one_file.returncode == 2 and one_file.stderr.strip().count("\n") == 0, one_file.stderr
    assert "training.dataloader.num_workers=2 but the train data has 1 file(s)" in one_file.stderr


def test_first_step_checkpoint_load_only_and_total_steps(corpus_jsonl, tmp_path):
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "100", "--checkpoint.enable_first_step_checkpoint"]
    launch(1, tiny_args(corpus_jsonl, tmp_path, *ckpt, "--training.steps", "3"))
    folder = tmp_path / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == ["step-1", "step-3"]
    out = launch(1, tiny_args(corpus_jsonl, tmp_path, *ckpt, "--training.steps", "5", "--checkpoint.load_only"))
    assert "loaded checkpoint" in out.stdout and sorted(p.name for p in folder.iterdir()) == ["step-1", "step-3"]

    from titanlite.config import parse_args
    from titanlite.optim.schedule import build_lr_scheduler

    def lrs(steps, *extra):
        config = parse_args(["--training.steps", str(steps), "--lr_scheduler.warmup_steps", "1", *extra])
        scheduler = build_lr_scheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), config)
        values = []
        for _ in range(steps):
            values.append(scheduler.get_last_lr()[0])
            scheduler.optimizer.step()
            scheduler.step()
        return values

    # A 4-step run on an 8-step schedule follows the first half of the 8-step run's lr.
    assert lrs(4, "--lr_scheduler.total_steps", "8") == lrs(8)[:4] != lrs(4)


def test_pipeline_stage_split_counts_the_embedding_and_output_as_torchtitan_does():
    from titanlite.config import ConfigError, parse_args
    from titanlite.models import FAMILIES
    from titanlite.parallel.pipeline import stage_module_names

    def split(n_layers, pp, multi, *extra):
        return stage_module_names(parse_args(list(extra)), FAMILIES["llama3"].plan, n_layers, pp, multi)

    layers = lambda *ids: [f"layers.{i}" for i in ids]
    assert split(6, 2, True) == [["tok_embeddings", *layers(0)], layers(1, 2), layers(3, 4), [*layers(5), "norm", "output"]]
    assert split(6, 2, False, "--parallelism.pipeline_parallel_first_stage_less_layers", "0",
                 "--parallelism.pipeline_parallel_last_stage_less_layers", "2") == [
        ["tok_embeddings", *layers(0, 1, 2, 3)], [*layers(4, 5), "norm", "output"]]
    assert split(6, 2, False, "--parallelism.pipeline_parallel_layers_per_stage", "3") == [
        ["tok_embeddings", *layers(0, 1)], layers(2, 3, 4), [*layers(5), "norm", "output"]]
    with pytest.raises(ConfigError, match="leave 1 per stage, fewer than the first/last stage give up"):
        split(2, 2, True, "--parallelism.pipeline_parallel_first_stage_less_layers", "2")


def test_console_colours_on_a_terminal_only(monkeypatch):
    from titanlite.config import parse_args
    from titanlite.metrics import RESET, colorize, use_color

    class Terminal:
        def isatty(self):
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    assert use_color(parse_args([]), Terminal())
    assert not use_color(parse_args(["--metrics.disable_color_printing"]), Terminal())
    assert not use_color(parse_args([]), open(os.devnull, "w"))
    monkeypatch.setenv("NO_COLOR", "1")
    assert not use_color(parse_args([]), Terminal())
    line = "step      3 | loss   5.1234 | grad_norm   0.500 | lr 1.00e-03 | tps     1,234 | mfu 12.50% | mem   0.50 GiB"
    assert colorize(line).count(RESET) == 5 and colorize("titanlite: done") == "titanlite: done"


def read_terminal(cmd: list[str], env: dict, timeout: float = 300) -> str:
    """What a command writes to a terminal (a pseudo-terminal as its stdout)."""
    import pty
    import select
    import subprocess
    import time

    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, stdout=slave, stderr=subprocess.DEVNULL, cwd=REPO, env=env, start_new_session=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([master], [], [], 1)[0]:
            try:
                data = os.read(master, 65536)
            except OSError:  # the command closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    proc.kill()
    proc.wait()
    os.close(master)
    return b"".join(chunks).decode(errors="replace")


def test_console_line_is_coloured_on_a_terminal_and_plain_in_a_file(corpus_jsonl, tmp_path):
    env = {**os.environ, "NGPU": "1", "PYTHON": sys.executable}
    env.pop("NO_COLOR", None)
    args = tiny_args(corpus_jsonl, tmp_path, "--training.steps", "1")[2:]
    terminal = read_terminal(["./run_train.sh", *args], env)
    assert "\033[36mloss" in terminal and "done: 1 steps" in terminal, terminal[-2000:]
    plain = read_terminal(["./run_train.sh", *args, "--metrics.disable_color_printing"], env)
    assert "done: 1 steps" in plain and "\033[" not in plain
    piped = run_command(["./run_train.sh", *args], cwd=REPO, env=env)
    assert piped.returncode == 0 and "step      1 | loss" in piped.stdout and "\033[" not in piped.stdout


def wandb_history(run_folder) -> list[dict]:
    """The logged rows of an offline W&B run, read from its .wandb file (LevelDB-log records of
    wandb's protobuf Record, after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(str(run_folder / "wandb" / "offline-run-*" / "run-*.wandb"))
    data, pos, block, pending, rows = open(path, "rb").read(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending, pos = pending + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
        elif kind == 0:
            break
    return rows


def test_wandb_offline_run_logs_the_tensorboard_scalars(corpus_jsonl, tmp_path):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install -e '.[wandb]')")
    launch(1, tiny_args(corpus_jsonl, tmp_path, "--training.steps", "3", "--metrics.enable_wandb"), env={"WANDB_MODE": "offline"})
    rows = [r for r in wandb_history(tmp_path) if "loss/loss" in r]  # TensorBoard's grouped tags
    assert [r["_step"] for r in rows] == [1, 2, 3]
    assert [r["loss/loss"] for r in rows] == losses(tmp_path)
    for key in ("optimizer/grad_norm", "optimizer/lr", "throughput/tps", "throughput/mfu", "memory/peak_gib"):
        assert all(key in r for r in rows), key


def test_missing_wandb_is_one_line_before_launch(tmp_path):
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(  # as if wandb were not installed
        "import importlib.util as u\n_f = u.find_spec\nu.find_spec = lambda n, *a: None if n == 'wandb' else _f(n, *a)\n"
    )
    env = {**os.environ, "NGPU": "1", "PYTHON": sys.executable, "PYTHONPATH": str(hide)}
    out = run_command(["./run_train.sh", "--metrics.enable_wandb"], cwd=REPO, env=env)
    assert out.returncode == 2
    assert out.stderr.strip() == "titanlite: config error: metrics.enable_wandb=true needs the wandb package: pip install -e '.[wandb]' (or set it false)"


@pytest.mark.parametrize("config, ngpu", [("llama3_8b", 8), ("llama3_70b", 64), ("llama3_405b", 128)])
def test_big_configs_pass_a_fake_backend_dry_run(config, ngpu):
    env = {**os.environ, "NGPU": str(ngpu), "COMM_MODE": "fake_backend", "PYTHON": sys.executable,
           "CONFIG_FILE": f"train_configs/{config}.toml"}
    out = run_command(["./run_train.sh"], cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dry run OK" in out.stdout and f"world {ngpu}" in out.stdout


def test_async_tensor_parallel_on_cpu_is_refused_in_one_line(corpus_jsonl, tmp_path):
    out = run_train_sh(2, tiny_args(corpus_jsonl, tmp_path, "--parallelism.tensor_parallel_degree", "2", "--compile.enable",
                                    "--parallelism.enable_async_tensor_parallel"))
    assert out.returncode == 2 and out.stderr.strip() == (
        "titanlite: config error: parallelism.enable_async_tensor_parallel=true needs CUDA GPUs (symmetric memory), "
        "not cpu; set it false"), out.stderr
