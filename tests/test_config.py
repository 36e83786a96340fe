"""Config: TOML loading, CLI overrides and their precedence, errors (exit 2, one line), --help."""

import json
import re
import subprocess
import sys

import pytest

from titanlite.config import ConfigError, JobConfig, load_toml, parse_args

from helpers import REPO

DEBUG = str(REPO / "train_configs" / "debug_model.toml")


def test_defaults_toml_and_cli_precedence(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 0.01\n')
    config = parse_args(["--job.config_file", str(toml), "--training.steps", "3"])
    assert config.training.steps == 3  # CLI beats TOML
    assert config.training.seq_len == 64  # TOML beats default
    assert config.optimizer.lr == 0.01
    assert config.training.local_batch_size == JobConfig().training.local_batch_size  # default


def test_cli_forms():
    config = parse_args(
        [
            "--training.steps=12",
            "--validation.enable",  # bare boolean
            "--metrics.enable_tensorboard", "false",
            "--compile.components", "model",
            "--quantize.linear.float8.filter_fqns=output,attention.wq",
            "--checkpoint.no_initial_load_model_only",  # TorchTitan's negated boolean
            "--parallelism.module_fqns_per_model_part", '[["tok_embeddings", "layers.0"], ["norm", "output"]]',
            "--lr_scheduler.decay_ratio", "0.2",
        ]
    )
    assert config.training.steps == 12
    assert config.validation.enable is True
    assert config.metrics.enable_tensorboard is False
    assert config.compile.components == ["model"]
    assert config.quantize.linear.float8.filter_fqns == ["output", "attention.wq"]
    assert config.checkpoint.initial_load_model_only is False
    assert config.parallelism.module_fqns_per_model_part == [["tok_embeddings", "layers.0"], ["norm", "output"]]
    assert config.lr_scheduler.decay_ratio == 0.2
    assert parse_args(["--lr_scheduler.decay_ratio", "none"]).lr_scheduler.decay_ratio is None


@pytest.mark.parametrize(
    "old, new",
    [
        ("--float8.enable", 'model.converters = ["float8"]'),
        ("--float8.emulate", "quantize.linear.float8.emulate"),
        ("--training.seed=3", "debug.seed"),
        ("--job.dry_run", 'comm.mode = "fake_backend"'),
        ("--parallelism.mixed_precision_param=float32", "training.mixed_precision_param"),
    ],
)
def test_names_outside_the_torchtitan_schema_point_to_theirs(old, new):
    with pytest.raises(ConfigError, match=re.escape(f"is not in the TorchTitan v0.2 schema titanlite uses; use {new}")):
        parse_args([old])


def test_schema_has_every_torchtitan_v0_2_2_key_with_its_default():
    """tests/torchtitan_v0_2_2_keys.json is scripts/torchtitan_schema.py's list of TorchTitan v0.2.2's
    keys and defaults. Defaults differ only where the behaviour does, for the reason given."""
    from titanlite.config.keys import LEAVES, default_value

    torchtitan = json.loads((REPO / "tests" / "torchtitan_v0_2_2_keys.json").read_text())
    assert len(torchtitan) == 149
    # The keys TorchTitan's fault-tolerance experiment adds (torchtitan/components/ft/config/job_config.py).
    torchtitan |= json.loads((REPO / "tests" / "torchtitan_v0_2_2_ft_keys.json").read_text())
    different = {
        "model.hf_assets_path": "TorchTitan's test tokenizer folder; ours is bundled",
        "training.dataset": "TorchTitan's c4_test is a file of its repository; ours is bundled",
        "validation.dataset": "TorchTitan's c4_validation; ours is the held-out part of training.dataset",
        "training.mixed_precision_param": "auto is bfloat16 on GPU (TorchTitan's) and float32 on CPU",
    }
    for key, default in torchtitan.items():
        assert key in LEAVES, key
        assert default_value(LEAVES[key][0]) == default or key in different, (key, default)
    assert all(default_value(LEAVES[key][0]) != torchtitan[key] for key in different)
    ours = {key for key in LEAVES if key not in torchtitan}
    assert ours == {key for key, (f, _) in LEAVES.items() if f.metadata["extension"]}


@pytest.mark.parametrize(
    "args, words",
    [
        (["--quantize.linear.mx.recipe_name", "mxfp8_emulated"], ["quantize.linear.mx.recipe_name='mxfp8_emulated'", "float8"]),
        (["--model.converters", "float8,quantize.linear.mx"], ["'quantize.linear.mx' is not implemented", "float8"]),
        (["--model.converters", "quantize.grouped_mm.mx"], ["'quantize.grouped_mm.mx' is not implemented", "float8"]),
        (["--model.converters", "quantize.grouped_mm.float8"], ["quantize.grouped_mm.float8.fqns is empty", "fqns experts"]),
        (["--model.converters", "quantize.grouped_mm.float8", "--quantize.grouped_mm.float8.fqns", "experts",
          "--parallelism.expert_tensor_parallel_degree", "2"], ["expert_tensor_parallel_degree=2", "set expert_tensor_parallel_degree=1"]),
        (["--model.converters", "float8,quantize.linear.float8"], ["names a converter twice", "list each once"]),
        (["--activation_checkpoint.mode", "memory_budget"], ["'memory_budget' is not implemented", "'selective' or 'full'"]),
        (["--parallelism.context_parallel_load_balancer", "ptrr"], ["'ptrr' is not implemented", "headtail"]),
        (["--comm.mode", "local_tensor"], ["'local_tensor' is not implemented", "fake_backend"]),
    ],
)
def test_an_unimplemented_torchtitan_value_is_refused_in_one_line(args, words):
    with pytest.raises(ConfigError) as err:
        parse_args(args)
    assert "\n" not in str(err.value)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_torchtitan_nested_sections_load(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text(
        '[model]\nconverters = ["float8"]\n[quantize.linear.float8]\nemulate = true\nrecipe_name = "rowwise"\n'
        '[training]\nsteps = 3\n[training.dataloader]\nnum_workers = 2\npin_memory = true\n[debug]\nseed = 5\n'
    )
    config = parse_args(["--job.config_file", str(toml)])
    assert config.float8.emulate and config.float8.recipe_name == "rowwise"
    assert config.training.dataloader.num_workers == 2 and config.training.dataloader.pin_memory
    assert config.training.steps == 3 and config.debug.seed == 5
    assert parse_args([]).float8 is None  # no converter, no float8
    assert parse_args(["--model.converters", "quantize.linear.float8"]).float8 is not None  # TorchTitan's registered name
    toml.write_text("[quantize.linear.float9]\nemulate = true\n")
    with pytest.raises(ConfigError, match=r"unknown config section \[quantize.linear.float9\]; did you mean 'quantize.linear.float8'"):
        parse_args(["--job.config_file", str(toml)])
    toml.write_text("[float8]\nemulate = true\n")  # an older titanlite config
    with pytest.raises(ConfigError, match="'float8.emulate' is not in the TorchTitan v0.2 schema titanlite uses; use quantize"):
        parse_args(["--job.config_file", str(toml)])


@pytest.mark.parametrize(
    "args, words",
    [
        (["--training.stepz", "3"], ["training.stepz", "did you mean 'training.steps'"]),
        (["--trainin.steps", "3"], ["[trainin]", "did you mean 'training'"]),
        (["--training.steps", "ten"], ["training.steps='ten'", "int"]),
        (["--training.steps", "0"], ["training.steps=0", ">= 1"]),
        (["--model.flavor", "9B"], ["model.flavor='9B'", "debugmodel", "8B"]),
        (["--optimizer.lr", "-1"], ["optimizer.lr=-1.0", "> 0"]),
        (["--validation.enable", "maybe"], ["validation.enable='maybe'", "bool"]),
        (["--parallelism.data_parallel_shard_degree", "0"], ["data_parallel_shard_degree=0", "-1"]),
        (["--job.config_file", "/nonexistent.toml"], ["/nonexistent.toml", "does not exist"]),
        (["stray"], ["unexpected argument 'stray'"]),
        (["--model.converters", "float8", "--quantize.linear.float8.enable_fsdp_float8_all_gather",
          "--quantize.linear.float8.recipe_name", "rowwise"],
         ["quantize.linear.float8.enable_fsdp_float8_all_gather", "'rowwise'", "tensorwise"]),
        (["--model.converters", "float8", "--quantize.linear.float8.enable_fsdp_float8_all_gather",
          "--parallelism.tensor_parallel_degree", "2"],
         ["tensor_parallel_degree", "precompute_float8_dynamic_scale_for_fsdp=true"]),
        (["--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only", "false"],
         ["last_save_in_hf=true saves weights only", "last_save_model_only=true"]),
        (["--training.dataloader.prefetch_factor", "2"], ["training.dataloader.prefetch_factor", "num_workers > 0"]),
        (["--validation.steps", "0"], ["validation.steps=0", "-1"]),
        (["--quantize.linear", "1"], ["'quantize.linear' is a section"]),
        (["--compile.components", "model,optimizer"], ["compile.components", "'optimizer'", "model, loss"]),
        (["--model.converters", "float9"], ["model.converters=['float9']", "choose from: quantize.linear.float8, float8"]),
        (["--training.loss_chunks", "0"], ["training.loss_chunks=0", ">= 1"]),
        (["--training.loss_chunks", "4", "--parallelism.tensor_parallel_degree", "2", "--parallelism.disable_loss_parallel"],
         ["training.loss_chunks=4 with parallelism.disable_loss_parallel=true", "set disable_loss_parallel=false or loss_chunks=1"]),
    ],
)
def test_bad_input_names_key_value_and_fix(args, words):
    with pytest.raises(ConfigError) as err:
        parse_args(args)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_unknown_key_in_toml(tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text("[training]\nlocal_batch = 4\n")
    with pytest.raises(ConfigError, match="training.local_batch.*did you mean 'training.local_batch_size'"):
        parse_args(["--job.config_file", str(toml)])


# The keys TorchTitan v0.2.2's own llama3 configs (debug_model, 8B, 70B, 405B) set.
TORCHTITAN_CONFIG_KEYS = """
activation_checkpoint.mode activation_checkpoint.selective_ac_option checkpoint.async_mode checkpoint.enable
checkpoint.export_dtype checkpoint.folder checkpoint.interval checkpoint.last_save_model_only compile.components
compile.enable job.description job.dump_folder job.print_config lr_scheduler.decay_ratio lr_scheduler.decay_type
lr_scheduler.min_lr_factor lr_scheduler.warmup_steps metrics.disable_color_printing metrics.enable_tensorboard
metrics.enable_wandb metrics.log_freq metrics.save_tb_folder model.converters model.flavor model.hf_assets_path
model.name optimizer.eps optimizer.lr optimizer.name parallelism.context_parallel_degree
parallelism.data_parallel_replicate_degree parallelism.data_parallel_shard_degree
parallelism.enable_async_tensor_parallel parallelism.fsdp_reshard_after_forward parallelism.pipeline_parallel_degree
parallelism.pipeline_parallel_schedule parallelism.tensor_parallel_degree profiling.enable_memory_snapshot
profiling.enable_profiling profiling.profile_freq profiling.save_memory_snapshot_folder profiling.save_traces_folder
quantize.linear.float8.enable_fsdp_float8_all_gather quantize.linear.float8.filter_fqns
quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp training.dataset training.local_batch_size
training.max_norm training.seq_len training.steps validation.dataset validation.enable validation.freq validation.steps
""".split()


def test_shipped_configs_use_every_key_torchtitans_configs_do():
    from titanlite.config.reading import toml_pairs

    ours = {key for path in (REPO / "train_configs").glob("*.toml") for key, _ in toml_pairs(load_toml(str(path)))}
    assert set(TORCHTITAN_CONFIG_KEYS) <= ours, sorted(set(TORCHTITAN_CONFIG_KEYS) - ours)


def test_every_shipped_config_loads():
    for path in sorted((REPO / "train_configs").glob("*.toml")):
        assert parse_args(["--job.config_file", str(path)]).job.config_file == str(path)


def test_saved_config_round_trips(tmp_path):
    config = parse_args(["--job.config_file", DEBUG, "--training.steps", "9", "--quantize.linear.float8.filter_fqns", "output,w1"])
    config.save(tmp_path / "config.toml")
    again = parse_args(["--job.config_file", str(tmp_path / "config.toml")])
    assert again.to_dict() == config.to_dict() | {"job": again.to_dict()["job"]}
    assert load_toml(str(tmp_path / "config.toml"))["training"]["steps"] == 9


def test_help_lists_every_key_and_marks_the_unimplemented():
    from titanlite.config import LEAVES

    out = subprocess.run([sys.executable, "-m", "titanlite.preflight", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    lines = out.stdout.splitlines()
    closing = out.stdout.partition("\nNot implemented")[2]  # the unimplemented keys: one list at the end
    for key, (f, _) in LEAVES.items():
        if f.metadata["not_implemented"]:
            assert re.search(rf"(?<![\w.]){re.escape(key)}(?![\w.])", closing), key
            continue
        (at,) = [i for i, line in enumerate(lines) if line.startswith(f"  --{key} = ")]
        description = lines[at + 1]
        assert description.strip().startswith("[titanlite]") == f.metadata["extension"], key
    assert "  --quantize.linear.float8.emulate = false" in lines


def test_config_check_exits_2_with_one_line():
    out = subprocess.run(
        [sys.executable, "-m", "titanlite.preflight", "--parallelism.tensor_parallel_degree", "3"],
        capture_output=True, text=True, env={"WORLD_SIZE": "4", "PATH": ""},
    )
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "tensor_parallel_degree" not in out.stdout
    assert "do not divide the world size 4" in out.stderr


def test_a_torch_outside_the_tested_range_is_refused_in_one_line():
    from titanlite import SUPPORTED_TORCH, check_torch_version

    for ok in ("2.11.0", "2.13.0+cpu", "2.14.1", "2.15.0"):
        check_torch_version(ok)
    for bad in ("2.10.2", "2.16.0", "3.0.0.dev20270101"):
        with pytest.raises(ImportError, match=rf"works with torch 2.11 to 2.15, not {re.escape(bad)}; pip install"):
            check_torch_version(bad)
    # The same range as the package's dependency.
    low, high = SUPPORTED_TORCH
    assert f'"torch>={low[0]}.{low[1]},<{high[0]}.{high[1]}"' in (REPO / "pyproject.toml").read_text()
