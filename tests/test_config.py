"""Config: TOML loading, CLI overrides and their precedence, errors (exit 2, one line), --help."""

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
            "--float8.filter_fqns=output,attention.wq",
            "--lr_scheduler.decay_ratio", "0.2",
        ]
    )
    assert config.training.steps == 12
    assert config.validation.enable is True
    assert config.metrics.enable_tensorboard is False
    assert config.compile.components == ["model"]
    assert config.float8.filter_fqns == ["output", "attention.wq"]
    assert config.lr_scheduler.decay_ratio == 0.2
    assert parse_args(["--lr_scheduler.decay_ratio", "none"]).lr_scheduler.decay_ratio is None


def test_torchtitan_location_of_mixed_precision_is_accepted():
    config = parse_args(["--parallelism.mixed_precision_param", "bfloat16"])
    assert config.training.mixed_precision_param == "bfloat16"


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
        (["--float8.enable", "--float8.enable_fsdp_float8_all_gather", "--float8.recipe_name", "rowwise"],
         ["float8.enable_fsdp_float8_all_gather", "'rowwise'", "tensorwise"]),
        (["--float8.enable", "--float8.enable_fsdp_float8_all_gather", "--parallelism.tensor_parallel_degree", "2"],
         ["tensor_parallel_degree", "precompute_float8_dynamic_scale_for_fsdp=true"]),
        (["--compile.components", "model,optimizer"], ["compile.components", "'optimizer'", "model, loss"]),
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


def test_every_shipped_config_loads():
    for path in sorted((REPO / "train_configs").glob("*.toml")):
        assert parse_args(["--job.config_file", str(path)]).job.config_file == str(path)


def test_saved_config_round_trips(tmp_path):
    config = parse_args(["--job.config_file", DEBUG, "--training.steps", "9", "--float8.filter_fqns", "output,w1"])
    config.save(tmp_path / "config.toml")
    again = parse_args(["--job.config_file", str(tmp_path / "config.toml")])
    assert again.to_dict() == config.to_dict() | {"job": again.to_dict()["job"]}
    assert load_toml(str(tmp_path / "config.toml"))["training"]["steps"] == 9


def test_help_lists_every_key():
    out = subprocess.run([sys.executable, "-m", "titanlite.preflight", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for section, values in JobConfig().to_dict().items():
        for key in values:
            assert f"--{section}.{key}" in out.stdout


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

    for ok in ("2.11.0", "2.13.0+cpu", "2.14.1"):
        check_torch_version(ok)
    for bad in ("2.10.2", "2.15.0", "3.0.0.dev20270101"):
        with pytest.raises(ImportError, match=rf"works with torch 2.11 to 2.14, not {re.escape(bad)}; pip install"):
            check_torch_version(bad)
    # The same range as the package's dependency.
    low, high = SUPPORTED_TORCH
    assert f'"torch>={low[0]}.{low[1]},<{high[0]}.{high[1]}"' in (REPO / "pyproject.toml").read_text()
