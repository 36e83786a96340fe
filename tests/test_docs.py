"""README.md and docs/ stay true to the code.

The omission checks fail when a family, flavor, train_configs file, script, config section or an
environment variable that run_train.sh reads is named nowhere in README.md or docs/; the flag check
fails on a `--section.key` in a code block that is no key of the schema, or a refused one; the key
tables of docs/config.md must be the schema's. The recipes of the README run as written: the CPU ones
for real (two steps, in a scratch folder), the GPU ones as fake-backend dry runs of the same command.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from helpers import REPO, run_train_env_vars
from titanlite.config import reference
from titanlite.config.help import ENVIRONMENT
from titanlite.config.keys import LEAVES, MOVED, SECTIONS
from titanlite.models import FAMILIES

README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]


def omissions(text: str) -> list[str]:
    """What the docs (one text) leave unnamed, one line each."""
    missing = []
    lines = text.splitlines()
    for family, record in FAMILIES.items():
        if f"`{family}`" not in text:
            missing.append(f"family {family}")
        for flavor in record.flavors:  # named on a line with its family: 'debugmodel' is in several
            if not any(f"`{family}`" in line and f"`{flavor}`" in line for line in lines):
                missing.append(f"flavor {family}/{flavor}")
    missing += [f"config {p.name}" for p in sorted((REPO / "train_configs").glob("*.toml")) if p.name not in text]
    missing += [f"script {p.name}" for p in sorted((REPO / "scripts").iterdir()) if p.is_file() and f"scripts/{p.name}" not in text]
    missing += [f"section [{s}]" for s in sorted(SECTIONS) if f"[{s}]" not in text and f"`{s}." not in text]
    variables = run_train_env_vars() | {name for name, _ in ENVIRONMENT}  # and those --help lists
    missing += [f"variable {v}" for v in sorted(variables) if f"`{v}`" not in text]
    return missing


def docs_text() -> str:
    return "\n".join(p.read_text() for p in PAGES)


def test_the_docs_name_every_family_flavor_config_script_section_and_variable():
    assert {"NGPU", "NNODES", "CONFIG_FILE", "COMM_MODE", "MAX_RESTARTS", "FT_LIGHTHOUSE"} <= run_train_env_vars()
    assert omissions(docs_text()) == []


@pytest.mark.parametrize("kind, names", [
    ("family", ["deepseek_v3"]), ("flavor", ["qwen3_235b_a22b"]), ("config", ["debug_llama4.toml"]),
    ("script", ["scripts/ft_downtime.py"]), ("section", ["[fault_tolerance]", "`fault_tolerance."]),
    ("variable", ["`MAX_RESTARTS`"]),
])
def test_an_omission_of_each_kind_is_found(kind, names):
    """Each kind of omission fails the check: the name taken out of every page is reported."""
    text = docs_text()
    for name in names:
        assert name in text
        text = text.replace(name, "(removed)")
    found = omissions(text)
    assert any(line.startswith(kind) for line in found), found


def code_blocks(text: str) -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)


def flag_problems(text: str) -> list[str]:
    """`--section.key` flags in code blocks that are no key of the schema, or are refused."""
    problems = []
    for block in code_blocks(text):
        for key in re.findall(r"--([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)+)", block):
            section, _, name = key.rpartition(".")
            if key not in LEAVES and name.startswith("no_") and f"{section}.{name[3:]}" in LEAVES:
                key = f"{section}.{name[3:]}"
            if key in MOVED or key not in LEAVES:
                problems.append(f"--{key}: not a key of the schema")
            elif LEAVES[key][0].metadata["not_implemented"]:
                problems.append(f"--{key}: refused (not implemented)")
    return problems


def test_every_flag_in_a_code_block_is_a_key_titanlite_takes():
    assert flag_problems(docs_text()) == []
    assert flag_problems("```bash\n./run_train.sh --training.stepz 3\n```") == ["--training.stepz: not a key of the schema"]
    assert flag_problems("```\n./run_train.sh --memory_estimation.enable\n```") == ["--memory_estimation.enable: refused (not implemented)"]
    assert flag_problems("```\n./run_train.sh --training.no_enable_cpu_offload --float8.enable\n```") == [
        "--float8.enable: not a key of the schema"]


def test_the_key_tables_are_the_schemas():
    page = reference.PAGE.read_text()
    assert reference.page_with_tables(page) == page, "run python -m titanlite.config.reference"
    for key, (f, _) in LEAVES.items():
        section, name = key.rsplit(".", 1)
        assert f"| `{key if f.metadata['not_implemented'] else name}`" in page, key


def test_every_mutation_has_a_row_in_the_testing_page():
    page = (REPO / "docs" / "testing.md").read_text()
    entries = tomllib.loads((REPO / "scripts" / "mutations.toml").read_text())["mutation"]
    assert [e["name"] for e in entries if f"| {e['name']} |" not in page] == []


def test_the_readme_is_short():
    assert len(README.read_text().splitlines()) <= 200


def recipes() -> list[str]:
    """The commands of the README's Recipes section, one a line, comments off."""
    section = README.read_text().split("\n## Recipes", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in code_blocks(section):
        for line in block.splitlines():
            command = line.split("  #", 1)[0].strip()
            if command:
                commands.append(command)
    return commands


def split_command(command: str) -> tuple[dict, list[str]]:
    words = shlex.split(command)
    env = {}
    while "=" in words[0] and not words[0].startswith(("-", ".")):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return env, words


def is_gpu_recipe(env: dict) -> bool:
    return int(env.get("NGPU", "1")) > 2 or int(env.get("NNODES", "1")) > 1


def run(words: list[str], env: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHON": sys.executable}
    return subprocess.run(words, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def test_the_recipes_cover_what_the_readme_promises():
    text = "\n".join(recipes())
    for needle in ("debug_moe.toml", "debug_deepseek_v3.toml", "debug_llama4.toml", "tensor_parallel_degree",
                   "data_parallel_replicate_degree", "pipeline_parallel_degree", "context_parallel_degree",
                   "NNODES=4", "sbatch", "create_seed_checkpoint", "convert_hf.py to-hf", "initial_load_in_hf",
                   "last_save_in_hf", "fault_tolerance.enable", "ft_demo.sh", "COMM_MODE=fake_backend",
                   "llama3_405b.toml", "plan.py --model 405B --gpu H100 --gpus 1024"):
        assert needle in text, needle


@pytest.mark.slow
def test_the_gpu_recipes_pass_a_dry_run():
    """Each multi-GPU or multi-node run_train.sh recipe, as a COMM_MODE=fake_backend dry run of the
    same command; the torchft groups and SLURM lines through the config reader and its checks."""
    from titanlite.config.reading import parse_args  # it validates too

    checked = 0
    for command in recipes():
        env, words = split_command(command)
        if words[0] == "sbatch":
            script = next(w for w in words if w.startswith("scripts/"))
            assert (REPO / script).is_file(), script
            overrides = words[words.index(script) + 1:]
            parse_args(["--job.config_file", env.get("CONFIG_FILE", "train_configs/debug_model.toml"), *overrides])
            checked += 1
        elif words[0] == "./run_train.sh" and "--fault_tolerance.enable" in words:
            parse_args(["--job.config_file", env.get("CONFIG_FILE", "train_configs/debug_model.toml"), *words[1:]])
            checked += 1
        elif words[0] == "./run_train.sh" and (is_gpu_recipe(env) or env.get("COMM_MODE")):
            result = run(words, {**env, "COMM_MODE": "fake_backend"}, timeout=120)
            assert result.returncode == 0 and "dry run OK" in result.stdout, (command, result.stdout[-2000:], result.stderr[-2000:])
            checked += 1
    assert checked >= 11


# CPU recipes that tests/test_cli.py trains as written (more steps, with a falling loss): not run twice.
TRAINED_IN_TEST_CLI = {
    "CONFIG_FILE=train_configs/debug_deepseek_v3.toml ./run_train.sh": "test_debug_deepseek_v3_config_trains_and_its_mtp_loss_falls",
    "CONFIG_FILE=train_configs/debug_llama4.toml ./run_train.sh": "test_debug_llama4_config_trains_with_a_falling_loss",
    "CONFIG_FILE=train_configs/debug_moe.toml NGPU=2 ./run_train.sh --parallelism.expert_parallel_degree 2":
        "test_debug_moe_config_trains_on_two_expert_parallel_ranks",
}


def test_the_recipes_test_cli_trains_are_the_readmes():
    source = (REPO / "tests" / "test_cli.py").read_text()
    for command, test in TRAINED_IN_TEST_CLI.items():
        assert command in recipes(), command
        body = source.split(f"def {test}(", 1)[1].split("\ndef ", 1)[0]
        env, words = split_command(command)
        assert f'"{env["CONFIG_FILE"]}"' in body and all(f'"{w}"' in body for w in words), (command, test)


def metrics_rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_cpu_recipes_train(tmp_path):
    """Each CPU recipe for two steps, in order, each checked for what it promises; the paths under
    outputs/ and hf_out move to tmp_path. The seed checkpoint's run writes where the next line reads.
    Batches of 2 and one validation batch: the configs' 8 x 256 tokens cost seconds a step on 2 cores
    and nothing a recipe promises depends on them."""
    small = ["--training.local_batch_size", "2", "--validation.steps", "1"]
    ran = 0
    for i, command in enumerate(recipes()):
        env, words = split_command(command)
        if command in TRAINED_IN_TEST_CLI or is_gpu_recipe(env) or env.get("COMM_MODE") or "--fault_tolerance.enable" in words:
            continue
        words = [w.replace("outputs/", f"{tmp_path}/").replace("hf_out", f"{tmp_path}/hf_out") for w in words]
        if words[0] == "python":
            result = run([sys.executable, *words[1:]], env)
            assert result.returncode == 0, (command, result.stdout[-2000:], result.stderr[-2000:])
            if "to-hf" in words:
                assert (tmp_path / "hf_out" / "model.safetensors").is_file()
            ran += 1
        elif words[0] == "./run_train.sh":
            seeding = "--checkpoint.create_seed_checkpoint" in words
            folder = tmp_path / ("debug_model" if seeding else f"recipe_{i}")
            result = run([*words, *small, "--training.steps", "2", "--job.dump_folder", str(folder)], env)
            assert result.returncode == 0, (command, result.stdout[-2000:], result.stderr[-2000:])
            if seeding:
                assert (folder / "checkpoint" / "step-0").is_dir(), command
                continue
            rows = metrics_rows(folder)
            assert [r["step"] for r in rows if "loss" in r][-1] == 2 and all(math.isfinite(r["loss"]) for r in rows if "loss" in r)
            if "--checkpoint.interval" in words:  # "run it again: it resumes from the latest"
                again = run([*words, *small, "--training.steps", "3", "--job.dump_folder", str(folder)], env)
                assert again.returncode == 0 and "at step 2" in again.stdout, (again.stdout[-2000:], again.stderr[-2000:])
            if "--checkpoint.initial_load_in_hf" in words:
                assert "loaded Hugging Face weights" in result.stdout, result.stdout[-2000:]
            if "--checkpoint.last_save_in_hf" in words:
                assert list((folder / "checkpoint").glob("step-2/*.safetensors")), sorted((folder / "checkpoint").rglob("*"))
            ran += 1
    assert ran >= 7
