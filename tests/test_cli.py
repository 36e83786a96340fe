"""End to end through the real CLI: run_train.sh, torchrun or one process -> metrics.jsonl, TensorBoard, the saved
config; the same losses on 1 process and on parallel layouts; clear one-line errors; the dry run."""

import contextlib
import io
import json
import os
import re
import sys

import pytest

from helpers import REPO, launch, run_command, run_train_env_vars, tiny_args
from titanlite.launch import curve_difference

pytestmark = pytest.mark.slow


def metrics(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_torchrun_run_writes_metrics_tensorboard_and_config(corpus_jsonl, tmp_path):
    out = launch(1, tiny_args(corpus_jsonl, tmp_path, "--metrics.enable_tensorboard", "true", "--validation.enable",
                              "--validation.dataset", str(corpus_jsonl), "--validation.freq", "5"), agent=True)
    rows = metrics(tmp_path)
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5]
    for key in ("loss", "grad_norm", "lr", "tps", "tflops", "mfu", "memory_gib", "data_share", "elapsed_s"):
        assert all(isinstance(r[key], float) for r in train), key
    assert all(r["tps"] > 0 and r["mfu"] > 0 for r in train)
    (val,) = [r for r in rows if "val_loss" in r]
    assert val["step"] == 5 and val["val_perplexity"] > 1
    assert list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert "training.steps" not in (tmp_path / "config.toml").read_text() and "steps = 5" in (tmp_path / "config.toml").read_text()
    assert "done: 5 steps" in out.stdout


@pytest.mark.full  # in scripts/test_full.sh: the default suite stays under 20 minutes
def test_debug_moe_config_trains_on_two_expert_parallel_ranks(tmp_path):
    """CONFIG_FILE=train_configs/debug_moe.toml ./run_train.sh, as the README says, with the experts
    split over 2 ranks: the loss falls, and the load balance and aux loss reach every sink."""
    env = {**os.environ, "NGPU": "2", "CONFIG_FILE": "train_configs/debug_moe.toml", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    out = run_command(["./run_train.sh", "--parallelism.expert_parallel_degree", "2", "--training.steps", "30",
                       "--metrics.log_freq", "2", "--validation.freq", "30", "--job.dump_folder", str(tmp_path)], cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ep=2 (world 2)" in out.stdout and "MoE: FLOPs, TFLOPS and MFU count the" in out.stdout
    train = [r for r in metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in train] == [1, *range(2, 31, 2)]
    assert train[-1]["loss"] < train[0]["loss"] - 1.5, train
    # The busiest expert's load over the mean, worst layer: 1 is balanced, 4 (experts / top_k) is one
    # expert taking every token. Measured at these steps (seeds 42, the config's, and 1):
    #                        steps <= 10: max   steps >= 20: mean   all: mean
    #   expert bias          1.50, 1.50         2.81, 3.17          2.05, 2.10
    #   coeff 0 (no bias)    1.34, 1.26         3.43, 3.35          2.28, 2.21
    #   sign flipped         2.81, 2.70         4.00, 4.00          3.19, 3.18
    # A flipped update feeds the busiest expert until it takes every token; the bounds below sit
    # between it and the right update. No bound separates "no bias" in 30 steps: early it is the
    # more even (the bias's fixed step jitters), and late the gap (0.18 on seed 1) is below the
    # spread between seeds (0.36).
    loads = {r["step"]: r["moe_max_load"] for r in train}
    assert all(1.0 <= load < 4.0 for load in loads.values()) and sum(loads.values()) / len(loads) < 3.0, loads
    assert all(load < 2.0 for step, load in loads.items() if step <= 10), loads
    late = [load for step, load in loads.items() if step >= 20]
    assert sum(late) / len(late) < 3.7, loads
    assert all(0 < r["moe_aux_loss"] < 0.01 for r in train)
    assert "moe_max_load" in out.stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {p.parent for p in (tmp_path / "tb").rglob("events.out.tfevents.*")}
    assert "moe/max_load" in EventAccumulator(str(events)).Reload().Tags()["scalars"]


def test_run_train_sh_passes_overrides(corpus_jsonl, tmp_path):
    env = {**os.environ, "NGPU": "1", "CONFIG_FILE": "train_configs/debug_model.toml", "PYTHON": sys.executable}
    args = tiny_args(corpus_jsonl, tmp_path)[2:]  # run_train.sh passes --job.config_file itself
    out = run_command(["./run_train.sh", *args, "--training.steps", "2"], cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2]


MOE = ["--model.name", "moe", "--model.flavor", "debugmoe"]


def test_bad_config_exits_2_with_one_line(tmp_path):
    for ngpu, args, words in [
        (4, ["--training.stepz", "3"], "did you mean 'training.steps'"),
        (4, ["--parallelism.tensor_parallel_degree", "3"], "do not divide the world size 4"),
        (4, ["--parallelism.data_parallel_shard_degree", "3"], "multiply to 3, not the world size 4"),
        (8, ["--parallelism.tensor_parallel_degree", "8", "--model.flavor", "debugmodel_gqa"], "does not divide the model's n_kv_heads=4"),
        (2, ["--training.seq_len", "255", "--parallelism.tensor_parallel_degree", "2"], "seq_len=255 must be divisible by 2"),
        (2, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "Nope"], "choose one of: GPipe, 1F1B"),
        (4, ["--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "12"],
         "seq_len=12 must be divisible by 8 (tp=2 x 2 x cp=2)"),
        (2, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
             "--parallelism.pipeline_parallel_layers_per_stage", "2"], "runs one stage per rank, but the split gives 2"),
        (2, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble",
             "--parallelism.pipeline_parallel_layers_per_stage", "1"], "needs exactly 2 stages per rank"),
        # Mixture of experts: experts over EP, EP over the data ranks (and cp and tp), TP with SP.
        (6, MOE + ["--parallelism.expert_parallel_degree", "3"], "does not divide the model's num_experts=8"),
        (2, MOE + ["--parallelism.expert_parallel_degree", "4"], "must be context_parallel_degree x tensor_parallel_degree=1 times a divisor of"),
        (2, MOE + ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel", "false"],
         "set parallelism.enable_sequence_parallel=true"),
        (1, MOE + ["--checkpoint.enable", "--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only", "true"],
         "shared experts, an expert bias"),
        (1, ["--model.reset_position_ids"], "set model.attn_mask_type='block_causal', or reset_position_ids=false"),
        (1, ["--model.attn_mask_type", "document"], "choose from: none, causal, block_causal"),
        # The run's inputs, checked before launch too.
        (1, ["--training.dataset", str(tmp_path / "missing.jsonl")], "missing.jsonl' matches no files"),
        (1, ["--model.hf_assets_path", str(tmp_path / "tokenizer.json")], "is not a tokenizer file or a folder with tokenizer.json"),
        (1, ["--training.dataset", "allenai/c4"], "is a Hugging Face hub dataset, but HF_HUB_OFFLINE"),
        (2, ["--training.global_batch_size", "12"], "not a multiple of local_batch_size x dp = 8 x 2"),
        (1, ["--checkpoint.enable", "--checkpoint.load_step", "7", "--job.dump_folder", str(tmp_path)], "load_step=7 has no complete checkpoint"),
        (1, ["--checkpoint.initial_load_path", str(tmp_path / "step-3")], "step-3' holds no complete DCP checkpoint"),
    ]:
        env = {**os.environ, "NGPU": str(ngpu), "PYTHON": sys.executable}
        out = run_command(["./run_train.sh", *args], timeout=120, cwd=REPO, env=env)
        assert out.returncode == 2, (args, out.stderr)
        assert out.stderr.strip().count("\n") == 0 and words in out.stderr, (args, out.stderr)


def test_an_error_only_a_rank_sees_is_one_line_and_exit_2(tmp_path):
    """A dataset without the text column is found by the ranks, not before launch: run_train.sh shows
    the rank's line once, without torchrun's traceback, and exits 2."""
    data = tmp_path / "body.jsonl"
    data.write_text("".join(json.dumps({"body": "words " * 50}) + "\n" for _ in range(20)))
    env = {**os.environ, "NGPU": "2", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    out = run_command(["./run_train.sh", "--training.dataset", str(data), "--validation.enable", "false",
                       "--job.dump_folder", str(tmp_path / "run")], cwd=REPO, env=env)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip() == "titanlite: config error: training.dataset_text_field='text' is not a column of the dataset; columns: ['body']"


def test_dry_run_checks_a_512_gpu_layout_in_one_process():
    env = {**os.environ, "NGPU": "64", "NNODES": "8", "COMM_MODE": "fake_backend", "PYTHON": sys.executable,
           "CONFIG_FILE": "train_configs/llama3_405b.toml"}
    out = run_command(["./run_train.sh"], cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dry run OK" in out.stdout and "world 512" in out.stdout and "tp=8" in out.stdout


def test_dry_run_checks_a_moe_layout_with_expert_and_pipeline_parallel():
    """Qwen3-235B-A22B on 256 ranks: 4 pipeline stages x 64 data ranks, the experts over 32 of them."""
    env = {**os.environ, "NGPU": "8", "NNODES": "32", "COMM_MODE": "fake_backend", "PYTHON": sys.executable,
           "CONFIG_FILE": "train_configs/debug_moe.toml"}
    out = run_command(["./run_train.sh", "--model.flavor", "qwen3_235b_a22b", "--model.hf_assets_path", "byte",
                       "--parallelism.pipeline_parallel_degree", "4", "--parallelism.pipeline_parallel_schedule", "1F1B",
                       "--parallelism.expert_parallel_degree", "32", "--training.seq_len", "4096", "--training.local_batch_size", "4",
                       "--validation.enable", "false"], cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dry run OK" in out.stdout and "pp=4 x dp_replicate=1 x dp_shard=64 x cp=1 x tp=1, ep=32 (world 256)" in out.stdout
    assert "235,093,634,560 params" in out.stdout


def test_dry_run_checks_deepseek_v3_671b_on_the_planners_layout():
    """DeepSeek-V3 (671B + its 11.6B MTP module) on 1,024 H100: the planner's best layout (expert and
    pipeline parallel) goes through run_train.sh as the flags plan.py prints, in a fake_backend dry run."""
    from titanlite.hardware import find_gpu
    from titanlite.models import model_args
    from titanlite.planner import plan, run_flags

    model = model_args("deepseek_v3", "671B", 0, 4096)
    best = plan(model, 4096, 8192, find_gpu("H100"), 1024)[0][0].layout
    assert best.ep >= 8 and best.pp > 1, best
    env = {**os.environ, "NGPU": "8", "NNODES": "128", "COMM_MODE": "fake_backend", "PYTHON": sys.executable,
           "CONFIG_FILE": "train_configs/debug_deepseek_v3.toml"}
    out = run_command(["./run_train.sh", "--model.flavor", "671B", "--model.hf_assets_path", "byte", "--training.seq_len", "4096",
                       *run_flags(best, model, 8192), "--validation.enable", "false"], cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    layout = f"pp={best.pp} x dp_replicate={best.dp_replicate} x dp_shard={best.dp_shard} x cp={best.cp} x tp={best.tp}, ep={best.ep} (world 1024)"
    assert "dry run OK" in out.stdout and layout in out.stdout, out.stdout[-2000:]
    assert "682,636,472,320 params" in out.stdout  # 671,026,404,352 + 11,610,067,968 for MTP


# The same global batches on every layout: 4 sequences of training and of validation per step.
LAYOUT_RUNS = {
    "single": (1, ["--training.local_batch_size", "4"]),
    "single_compiled": (1, ["--training.local_batch_size", "4", "--compile.enable"]),
    "fsdp2": (2, ["--training.local_batch_size", "2"]),
    "pp2": (2, ["--training.local_batch_size", "4", "--parallelism.pipeline_parallel_degree", "2",
                "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]),
    "fsdp2_tp2": (4, ["--training.local_batch_size", "2", "--parallelism.tensor_parallel_degree", "2"]),
}


def layout_curve(name: str, corpus_jsonl, folder) -> list[float]:
    """8 steps and 2 validations of LAYOUT_RUNS[name]: the training losses, then the validation losses."""
    common = ["--training.steps", "8", "--training.data_split", "sequences", "--model.flavor", "debugmodel_gqa",
              "--validation.enable", "--validation.dataset", str(corpus_jsonl), "--validation.freq", "4"]
    nproc, extra = LAYOUT_RUNS[name]
    launch(nproc, tiny_args(corpus_jsonl, folder, *common, *extra, "--validation.local_batch_size", extra[1]))
    rows = metrics(folder)
    return [r["loss"] for r in rows if "loss" in r] + [r["val_loss"] for r in rows if "val_loss" in r]


@pytest.fixture(scope="module")
def one_process_curve(corpus_jsonl, tmp_path_factory) -> list[float]:
    """The curve every layout below must follow: run once for all of them."""
    curve = layout_curve("single", corpus_jsonl, tmp_path_factory.mktemp("single"))
    assert len(curve) == 8 + 2 and curve[7] < curve[0]
    return curve


@pytest.mark.parametrize("layouts", [
    pytest.param(["pp2", "fsdp2_tp2"], id="pp2_fsdp2_tp2"),
    pytest.param(["single_compiled", "fsdp2"], marks=pytest.mark.full, id="compiled_fsdp2"),
])
def test_parallel_layouts_match_one_process_through_the_cli(layouts, one_process_curve, corpus_jsonl, tmp_path):
    """Free-running loss curves of 8 steps and 2 validations against 1 process's (same global batches)."""
    for name in layouts:
        curve = layout_curve(name, corpus_jsonl, tmp_path / name)
        diff = curve_difference(curve, one_process_curve)
        assert diff < 1e-4, f"{name}: {curve} vs {one_process_curve} (max diff {diff:.2e})"


def test_the_launcher_reports_the_latest_attempt_only():
    """torchrun restarts a failed job: a config error of attempt 0 must not stand for attempt 1's
    death by a signal, which keeps torchrun's own report (and exit code 1)."""
    launcher = [sys.executable, "-m", "titanlite.torchrun", "--standalone", "--nproc_per_node", "1"]
    worker = str(REPO / "tests" / "fail_by_attempt.py")
    once = run_command([*launcher, "--max-restarts", "0", worker], cwd=REPO)
    assert once.returncode == 2 and once.stderr.strip() == "titanlite: config error: attempt 0 says so", once.stderr
    restarted = run_command([*launcher, "--max-restarts", "1", worker], cwd=REPO)
    assert restarted.returncode == 1 and "attempt 0 says so" not in restarted.stderr, restarted.stderr
    assert "Signal 9 (SIGKILL)" in restarted.stderr, restarted.stderr


def test_the_launcher_reports_the_lowest_ranks_error():
    """Three ranks each leave a different line, then exit rank 2 first and rank 0 last: the launcher
    shows rank 0's, once (tests/fail_by_rank.py)."""
    launcher = [sys.executable, "-m", "titanlite.torchrun", "--standalone", "--nproc_per_node", "3", "--max-restarts", "0"]
    out = run_command([*launcher, str(REPO / "tests" / "fail_by_rank.py")], cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 2 and out.stderr.strip() == "titanlite: config error: rank 0 says so", out.stderr


def test_first_error_picks_the_lowest_rank_by_number(tmp_path, monkeypatch):
    from titanlite.torchrun import ERROR_DIR, first_error, start_attempt, write_error

    monkeypatch.setenv(ERROR_DIR, str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    start_attempt()
    for rank in (10, 3, 2, 11):
        monkeypatch.setenv("RANK", str(rank))
        write_error(f"rank {rank} failed", 2)
    assert first_error(str(tmp_path)) == {"rank": 2, "code": 2, "message": "rank 2 failed"}


def test_debug_deepseek_v3_config_trains_and_its_mtp_loss_falls(tmp_path):
    """CONFIG_FILE=train_configs/debug_deepseek_v3.toml ./run_train.sh, as the README says, on 1 process:
    the model's loss and multi-token prediction's loss both fall, and mtp_loss reaches every sink."""
    env = {**os.environ, "NGPU": "1", "CONFIG_FILE": "train_configs/debug_deepseek_v3.toml", "PYTHON": sys.executable}
    out = run_command(["./run_train.sh", "--training.steps", "30", "--metrics.log_freq", "5", "--validation.freq", "30",
                       "--job.dump_folder", str(tmp_path)], cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    train = [r for r in metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in train] == [1, 5, 10, 15, 20, 25, 30]
    assert train[-1]["loss"] < train[0]["loss"] - 1.5 and train[-1]["mtp_loss"] < train[0]["mtp_loss"] - 1.5, train
    assert "mtp_loss" in out.stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {p.parent for p in (tmp_path / "tb").rglob("events.out.tfevents.*")}
    assert "loss/mtp_loss" in EventAccumulator(str(events)).Reload().Tags()["scalars"]


def test_debug_llama4_config_trains_with_a_falling_loss(tmp_path):
    """CONFIG_FILE=train_configs/debug_llama4.toml ./run_train.sh, as the README says, on 1 process:
    chunked attention (4 chunks per window), NoPE blocks and interleaved top-1 MoE train, and the loss falls."""
    env = {**os.environ, "NGPU": "1", "CONFIG_FILE": "train_configs/debug_llama4.toml", "PYTHON": sys.executable}
    out = run_command(["./run_train.sh", "--training.steps", "20", "--metrics.log_freq", "5", "--validation.freq", "20",
                       "--job.dump_folder", str(tmp_path)], cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    train = [r for r in metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in train] == [1, 5, 10, 15, 20]
    assert train[-1]["loss"] < train[0]["loss"] - 1.5, train
    assert "model llama4 debugmodel" in out.stdout


# --help: in-process through parse_args (it prints and exits 0), and once through run_train.sh.
KEY_LINE = re.compile(r"^[ *] --([\w.]+) = ")


def help_of(*argv: str) -> str:
    from titanlite.config import parse_args

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        parse_args(list(argv))
    assert stop.value.code == 0
    return out.getvalue()


def headers(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.fullmatch(r"\[[\w.]+\]", line)]


def shown_keys(text: str) -> set[str]:
    return {m.group(1) for line in text.splitlines() if (m := KEY_LINE.match(line))}


def unimplemented() -> list[str]:
    from titanlite.config import LEAVES

    return [key for key, (f, _) in LEAVES.items() if f.metadata["not_implemented"]]


def test_help_section_shows_that_section_only():
    from titanlite.config import LEAVES

    out = help_of("--help", "training")
    assert headers(out) == ["[training]", "[training.dataloader]"], headers(out)
    assert shown_keys(out) == {k for k in LEAVES if k.startswith("training.")}
    quantize = help_of("--help", "quantize")  # nested sections; the MX ones hold unimplemented keys only
    assert headers(quantize) == ["[quantize.linear.float8]", "[quantize.grouped_mm.float8]"], headers(quantize)
    assert all(f"  {k}: " in quantize for k in unimplemented() if k.startswith("quantize.")), quantize


def test_help_word_finds_keys_by_name_or_help_text_in_any_case():
    from titanlite.config import LEAVES

    for word in ("Pinned", "SEED"):
        out = help_of("--help", word)
        found = {k for k, (f, _) in LEAVES.items() if word.lower() in k.lower() or word.lower() in f.metadata["help"].lower()}
        ni = {k for k in unimplemented() if k in found}
        assert len(found) >= 2 and shown_keys(out) == found - ni, (word, out)
        assert all(f"  {k}: " in out for k in ni)  # an unimplemented key with what to use instead
    rdzv = help_of("--help", "rdzv")
    assert "RDZV_ENDPOINT" in rdzv and "RDZV_ID" in rdzv and not shown_keys(rdzv) and not headers(rdzv)


def test_help_for_an_unknown_word_is_one_line_listing_the_sections():
    from titanlite.config import ConfigError, parse_args

    with pytest.raises(ConfigError) as error:
        parse_args(["--help", "zzqx"])
    message = str(error.value)
    assert "\n" not in message and "'zzqx'" in message and "sections: model, training, parallelism, checkpoint" in message


def test_help_lists_the_environment_first():
    out = help_of("--help")
    lines = out.splitlines()
    start, first_section = lines.index("Environment variables:"), lines.index("[model]")
    block = "\n".join(lines[start:first_section])
    read = run_train_env_vars()
    assert {"NGPU", "NNODES", "NODE_RANK", "RDZV_ENDPOINT", "CONFIG_FILE", "COMM_MODE", "MAX_RESTARTS"} <= read
    for name in read | {"TITANLITE_CACHE", "WANDB_PROJECT", "TORCHFT_LIGHTHOUSE"}:
        assert re.search(rf"^  {name}\s+\S", block, re.MULTILINE), name
    from titanlite.config.help import ENVIRONMENT

    assert [name for name, _ in ENVIRONMENT] == re.findall(r"^  ([A-Z][A-Z0-9_]+)\s", block, re.MULTILINE)


def test_help_sections_come_model_first_each_once_nested_after_their_parent():
    from titanlite.config import LEAVES

    found = [h.strip("[]") for h in headers(help_of("--help"))]
    assert found[:5] == ["model", "training", "training.dataloader", "parallelism", "checkpoint"], found
    assert len(found) == len(set(found)) and set(found) == {k.rsplit(".", 1)[0] for k in LEAVES if k not in unimplemented()}
    tops = [s.split(".")[0] for s in found]
    assert [t for i, t in enumerate(tops) if i == 0 or t != tops[i - 1]] == list(dict.fromkeys(tops))  # one run each
    for i, section in enumerate(found):
        parent = section.rsplit(".", 1)[0]
        assert "." not in section or parent not in found or found.index(parent) < i, section


def test_help_closes_with_the_unimplemented_keys_only_there():
    out = help_of("--help")
    head, _, tail = out.partition("\nNot implemented")
    assert tail and not headers(tail) and not shown_keys(tail)
    listed = set(re.findall(r"[\w.]+", tail.split(":\n", 1)[1]))
    assert listed == set(unimplemented())
    assert "[not implemented]" not in head and not any(f"--{k} " in head for k in unimplemented())


def test_help_shows_the_config_files_values_and_marks_what_differs(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('[training]\nsteps = 7\nseq_len = 512\n[model]\nflavor = "debugmodel_gqa"\n')
    out = help_of("--job.config_file", str(toml), "--training.seq_len", "64", "--help", "training")
    lines = out.splitlines()
    assert any(line.startswith("* --training.steps = 7 ") for line in lines), out
    assert any(line.startswith("* --training.seq_len = 64 ") for line in lines), out
    assert "  --training.max_norm = 1.0" in lines and str(toml) in out
    assert '* --model.flavor = "debugmodel_gqa"' in help_of("--job.config_file", str(toml), "--help", "model")


def test_help_fits_100_columns(tmp_path):
    stages = json.dumps([[f"layers.{i}" for i in range(s, s + 20)] for s in range(0, 80, 20)])
    for argv in (["--help"], ["--job.config_file", "train_configs/llama3_405b.toml", "--help"],
                 ["--parallelism.module_fqns_per_model_part", stages, "--help", "parallelism"]):
        out = help_of(*argv)
        assert max(len(line) for line in out.splitlines()) <= 100, [line for line in out.splitlines() if len(line) > 100][:3]


def test_run_train_sh_help_shows_a_section_with_the_config_files_values():
    import tomllib

    env = {**os.environ, "NGPU": "1", "CONFIG_FILE": "train_configs/debug_moe.toml", "PYTHON": sys.executable}
    out = run_command(["./run_train.sh", "--help", "model", "--model.n_layers", "3"], timeout=120, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr
    assert headers(out.stdout) == ["[model]"], out.stdout
    name = tomllib.loads((REPO / "train_configs" / "debug_moe.toml").read_text())["model"]["name"]
    assert f'* --model.name = "{name}"' in out.stdout and "* --model.n_layers = 3 " in out.stdout
