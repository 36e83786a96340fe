"""plan.py's "run it" line is a command: read the way run_train.sh reads it (its env assignments, then
CONFIG_FILE and the arguments through titanlite's config reader) it gives the layout plan.py printed
in words (every degree, the pipeline schedule, AC, float8, compile, the batch sizes), on as many GPUs
as were planned for, and preflight accepts it for that world size. The 405B line also launches, as
pasted, in a fake_backend dry run. And benchmark.py's per-op AC row is the per-op policy."""

import os
import re
import shlex
import sys

import pytest

from helpers import REPO, run_command

SWITCHES = {"float8": "float8", "TP overlap": "tp_overlap", "compile": "compile"}


def described(text: str) -> dict:
    """The layout of Layout.describe()'s words ('dp_shard 256, tp 4; microbatch 4; AC full; float8; compile')."""
    degrees, *rest = text.split("; ")
    layout = {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1, "vp": 1, "cp": 1, "ep": 1}
    layout.update({k: int(v) for k, v in (item.split(" ") for item in degrees.split(", ") if item != "1 GPU")})
    layout.update(microbatch=int(rest[0].removeprefix("microbatch ")), ac=rest[1].removeprefix("AC "))
    layout.update({key: words in rest[2:] for words, key in SWITCHES.items()} | {"zero_bubble": "zero bubble" in rest[2:]})
    return layout


def plan_and_command(*argv: str) -> tuple[dict, dict, list[str]]:
    """plan.py's chosen layout (from its words), and its run line: (env, run_train.sh's arguments)."""
    out = run_command([sys.executable, "scripts/plan.py", *argv], cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    chosen = next(line.removeprefix("best: ") for line in lines if line.startswith("best: ") or re.search(": (fits|DOES NOT FIT); ", line))
    words = shlex.split(lines[lines.index(next(line for line in lines if line.startswith("run it"))) + 1])
    script = words.index("./run_train.sh")
    env = dict(word.split("=", 1) for word in words[:script])
    return described(chosen.split(": ")[0]), env, words[script + 1:]


def check_command(layout: dict, env: dict, args: list[str], gpus: int, seq_len: int, global_batch: int, tmp_path):
    from titanlite.config import parse_args
    from titanlite.preflight import check

    assert int(env["NGPU"]) * int(env["NNODES"]) == gpus and int(env["NGPU"]) <= 8, env
    config = parse_args(["--job.config_file", env["CONFIG_FILE"], *args])  # run_train.sh's order
    p, t, ac = config.parallelism, config.training, config.activation_checkpoint
    got = {"dp_replicate": p.data_parallel_replicate_degree, "dp_shard": p.data_parallel_shard_degree,
           "tp": p.tensor_parallel_degree, "pp": p.pipeline_parallel_degree, "cp": p.context_parallel_degree,
           "ep": p.expert_parallel_degree}
    assert got == {k: layout[k] for k in got}, (got, layout)
    assert (ac.mode, ac.selective_ac_option if ac.mode == "selective" else None) == {
        "none": ("none", None), "op": ("selective", "op"), "full": ("full", None)}[layout["ac"]], ac
    assert ("float8" in config.model.converters, config.compile.enable, p.enable_async_tensor_parallel) == (
        layout["float8"], layout["compile"], layout["tp_overlap"])
    assert (t.seq_len, t.global_batch_size) == (seq_len, global_batch)
    dp = layout["dp_replicate"] * layout["dp_shard"]
    if layout["pp"] > 1:  # one pipeline step of all the data rank's sequences, in microbatches
        schedule = "ZBVZeroBubble" if layout["zero_bubble"] else "Interleaved1F1B" if layout["vp"] > 1 else "1F1B"
        assert (t.local_batch_size, p.pipeline_parallel_microbatch_size, p.pipeline_parallel_schedule) == (
            global_batch // dp, layout["microbatch"], schedule)
        from titanlite.models import FAMILIES
        from titanlite.parallel.pipeline import plan_stages

        family = FAMILIES[config.model.name]
        _, own = plan_stages(config, family.plan, family.flavors[config.model.flavor].n_layers, layout["pp"], pp_rank=0)
        assert len(own) == layout["vp"], own  # the planned stages per rank
    else:
        assert t.local_batch_size == layout["microbatch"]
    check(parse_args(["--job.config_file", env["CONFIG_FILE"], *args, "--job.dump_folder", str(tmp_path)]), gpus)
    return config


@pytest.mark.slow
def test_the_405b_line_reads_back_as_the_plan_and_launches_as_pasted(tmp_path):
    layout, env, args = plan_and_command("--model", "405B", "--gpu", "H100", "--gpus", "1024")
    config = check_command(layout, env, args, 1024, 8192, 2048, tmp_path)
    assert env["CONFIG_FILE"] == "train_configs/llama3_405b.toml" and (config.model.name, config.model.flavor) == ("llama3", "405B")
    line = shlex.join([f"{k}={v}" for k, v in env.items()] + ["./run_train.sh", *args])
    out = run_command(["bash", "-c", f"COMM_MODE=fake_backend {line}"], cwd=REPO, timeout=120,
                      env={**os.environ, "PYTHON": sys.executable})
    assert out.returncode == 0, out.stderr[-2000:]
    world = (f"pp={layout['pp']} x dp_replicate={layout['dp_replicate']} x dp_shard={layout['dp_shard']} x cp={layout['cp']} "
             f"x tp={layout['tp']} (world 1024)")
    assert "dry run OK" in out.stdout and world in out.stdout, out.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("argv, gpus, seq_len, global_batch, name, config_file", [
    pytest.param(["--model", "llama4_17bx128e", "--gpus", "256", "--global-batch", "1024"], 256, 8192, 1024, "llama4",
                 "debug_llama4.toml", id="maverick_expert_parallel"),
    pytest.param(["--model", "deepseek_v3_671B", "--gpus", "1024", "--seq-len", "4096", "--global-batch", "8192"], 1024, 4096,
                 8192, "deepseek_v3", "debug_deepseek_v3.toml", id="dsv3_pipeline_and_expert_parallel"),
    pytest.param(["--model", "405B", "--gpus", "256", "--global-batch", "64", "--layout",
                  "dp_shard=4,tp=8,pp=8,vp=4,microbatch=1,ac=op,float8=true,compile=true,tp_overlap=true"], 256, 8192, 64,
                 "llama3", "llama3_405b.toml", id="405b_four_stages_per_rank"),
    # 80 blocks in 16 stages: only without the embedding's and the output's block of their own.
    pytest.param(["--model", "70B", "--gpus", "256", "--global-batch", "512", "--layout",
                  "dp_shard=8,tp=4,pp=4,vp=4,cp=2,microbatch=1,ac=none,float8=true,compile=true,tp_overlap=true"], 256, 8192, 512,
                 "llama3", "llama3_70b.toml", id="70b_four_stages_per_rank"),
])
def test_the_planned_line_reads_back_as_the_plan(argv, gpus, seq_len, global_batch, name, config_file, tmp_path):
    layout, env, args = plan_and_command(*argv, "--gpu", "H100")
    config = check_command(layout, env, args, gpus, seq_len, global_batch, tmp_path)
    assert env["CONFIG_FILE"] == f"train_configs/{config_file}" and config.model.name == name
    if "dsv3" in config_file:
        assert layout["pp"] > 1 and layout["ep"] > 1
    if name == "llama4":
        assert layout["ep"] > 1 and layout["ac"] == "op"


def test_a_line_on_a_debug_config_says_what_a_real_run_sets():
    """Families without a sized preset are planned on their debug config (its data, tokenizer and step
    count): a note under the line names the keys a real run sets, each a key of the schema; Llama 3's
    presets get none. The note is a shell comment, harmless if pasted with the line."""
    from titanlite.config.keys import LEAVES
    from titanlite.models import FAMILIES
    from titanlite.planner import Layout, run_command

    layout = Layout(dp_shard=8)
    for name, flavor, preset in [("deepseek_v3", "671B", False), ("llama4", "17bx16e", False), ("moe", "qwen3_30b_a3b", False),
                                 ("llama3", "8B", True)]:
        line, *note = run_command(layout, FAMILIES[name].flavors[flavor], name, flavor, 4096, 64).split("\n")
        assert line.startswith("NGPU=8 NNODES=1 CONFIG_FILE=train_configs/") and ("debug" in line) != preset, line
        if preset:
            assert note == [], note
            continue
        assert len(note) == 1 and note[0].startswith("# ") and "debug" in note[0], note
        keys = re.findall(r"--([a-z_]+\.[a-z_]+)", note[0])
        assert set(keys) == {"training.dataset", "training.dataset_path", "model.hf_assets_path", "training.steps",
                             "lr_scheduler.warmup_steps"} and all(k in LEAVES for k in keys), note


def test_benchmark_per_op_ac_row_runs_the_per_op_policy():
    sys.path.insert(0, str(REPO / "scripts"))
    from benchmark import PRESETS, trainer_args

    from titanlite.config import parse_args

    shape, _, runs = PRESETS["gpu_more"]
    run = next(r for r in runs if r.name == "bf16_compile_ac_op")
    config = parse_args(trainer_args(shape, run, "byte", "shakespeare", 4, REPO / "outputs" / "unused"))
    assert (config.activation_checkpoint.mode, config.activation_checkpoint.selective_ac_option) == ("selective", "op")
