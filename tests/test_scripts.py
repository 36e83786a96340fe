"""The measuring scripts run end to end on CPU: benchmark.py, loss_compare.py and compare_torchtitan.py."""

import json
import statistics
import sys

import pytest

from helpers import REPO, run_command


@pytest.mark.slow
@pytest.mark.full  # in scripts/test_full.sh: the default suite stays under 20 minutes
def test_benchmark_smoke_preset_writes_rows_table_and_plot(tmp_path):
    out = run_command([sys.executable, str(REPO / "scripts" / "benchmark.py"), "--preset", "smoke", "--steps", "6",
                       "--warmup", "2", "--overhead-repeats", "2", "--profile", "--out", str(tmp_path)], timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
    assert [r["name"] for r in rows] == ["1rank", "fsdp2"]
    for r in rows:
        assert r["tps_per_device"] > 0 and 0 < r["mfu"] < 100 and r["peak_memory_gib"] > 0 and 0 <= r["data_share"] < 1
        assert abs(r["tps_total"] - r["nproc"] * r["tps_per_device"]) < 1e-6 * r["tps_total"]
    assert rows[0]["bare_step_time_s"] > 0 and len(rows[0]["overhead_pct_each"]) == 2
    for r in rows:  # the kernels the log named, and the profiled last step's costliest ops
        assert r["attention"] == "causal SDPA (on CPU its flash kernel)"
        assert "aten::mm" in open(r["top_kernels"]).read()
    assert "| 1rank | 1 |" in out.stdout and (tmp_path / "results.csv").exists()
    assert (tmp_path / "results_smoke.png").stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.full  # in scripts/test_full.sh: the default suite stays under 20 minutes
def test_loss_compare_trains_from_one_seed_and_asserts(corpus_jsonl, tmp_path):
    common = (f"--model.hf_assets_path byte --training.dataset {corpus_jsonl} --training.seq_len 32 "
              "--training.data_split sequences --validation.enable false --metrics.enable_tensorboard false")
    script = [sys.executable, str(REPO / "scripts" / "loss_compare.py")]
    out = run_command([*script, "--steps", "6", "--common", common, "--out", str(tmp_path),
                       "--run", "single", "1", "--training.local_batch_size 4",
                       "--run", "fsdp2", "2", "--training.local_batch_size 2",
                       "--assert-within", "1e-4"], timeout=400)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "OK: every run within 0.0001 of single" in out.stdout
    assert (tmp_path / "seed" / "checkpoint" / "step-0" / ".metadata").exists()
    result = json.loads((tmp_path / "loss_compare.json").read_text())
    assert len(result["curves"]["fsdp2"]) == 6 and (tmp_path / "loss_compare.png").exists()

    # Reading finished runs: a curve shifted by 0.01 fails a 1e-3 tolerance.
    shifted = tmp_path / "shifted.jsonl"
    shifted.write_text("".join(json.dumps({"step": i + 1, "loss": x + 0.01}) + "\n"
                               for i, x in enumerate(result["curves"]["single"].values())))
    out = run_command([*script, "--metrics", "single", str(tmp_path / "single" / "metrics.jsonl"),
                       "--metrics", "shifted", str(shifted), "--out", str(tmp_path / "read"), "--assert-within", "1e-3"])
    assert out.returncode == 1 and "FAIL" in out.stdout, out.stdout + out.stderr


@pytest.mark.slow
@pytest.mark.full  # in scripts/test_full.sh: the default suite stays under 20 minutes
def test_compare_torchtitan_takes_runs_in_turn_and_prints_each_pairs_ratio(tmp_path):
    """A stand-in for the TorchTitan runner (it checks the shape and corpus it is given and reports 1,000 tokens/s):
    titanlite's side trains for real, and the ratio is the median of each pair's."""
    runner = tmp_path / "runner.sh"
    runner.write_text('[ "$1" = 1rank ] && [ "$TT_VOCAB" = 8192 ] && [ "$TT_STEPS" = 4 ] || exit 3\n'
                      # the same text as titanlite's: its Shakespeare training split, as C4 JSON lines
                      'head -n 1 "$TT_DATA_JSON" | grep -q \'"text": "ALL.S WELL THAT ENDS WELL\' || exit 4\n'
                      'echo "torchtitan tps=1000 loss_first=9.0 peak_rss_mib_max=4000"\n')
    out = run_command([sys.executable, str(REPO / "scripts" / "compare_torchtitan.py"), "--runner", str(runner), "--layouts",
                       "1rank", "--repeats", "2", "--steps", "4", "--warmup", "1", "--out", str(tmp_path / "out")], timeout=400)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "compare.json").read_text())["results"]["1rank"]
    ours = [run["tps"] for run in result["titanlite"]["runs"]]
    assert len(ours) == 2 and result["ratio"] == pytest.approx(statistics.median(ours) / 1000)
    assert f"| 1rank | {statistics.median(ours):,.0f} | 1,000 | {result['ratio']:.2f} |" in out.stdout


def test_curve_difference_fails_on_nan_infinity_and_unequal_length():
    from titanlite.launch import curve_difference

    assert curve_difference([3.0, 2.5, 2.0], [3.0, 2.4, 2.0]) == pytest.approx(0.1)
    nan, inf = float("nan"), float("inf")
    for curve in ([3.0, nan, 2.0], [3.0, 2.5, inf], [3.0, 2.5], [3.0, 2.5, 2.0, 1.0], []):
        assert not curve_difference(curve, [3.0, 2.5, 2.0]) <= 1.0, curve  # NaN, Inf and a length mismatch fail
    assert not curve_difference([3.0, 2.5], [3.0, nan]) <= 1.0  # a NaN in the baseline too


def test_the_repository_speaks_of_itself_alone():
    """A clone has no files beside it: no code or doc may send a reader to ../shared, and none may
    describe the GPU run as anything but a user's run on a machine with a GPU."""
    import re
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    outside = re.compile(r"\bshared/(notes|tools|ARCHITECTURE)|\.\./shared|\blent\b", re.IGNORECASE)
    found = []
    for name in files:
        if name.startswith("titanlite/assets/") or name.endswith(".png") or name == "tests/test_scripts.py":
            continue
        for number, line in enumerate((REPO / name).read_text(errors="replace").splitlines(), 1):
            if outside.search(line) and "start_new_session" not in line and 'scope="session"' not in line:
                found.append(f"{name}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_every_mutation_still_applies_once_and_names_existing_tests():
    """scripts/mutations.toml stays true to the code: each mutation's text occurs exactly once in its
    file (a stale one would stop mutation_check.py), and each test it names exists."""
    import re

    sys.path.insert(0, str(REPO / "scripts"))
    from mutation_check import load_mutations

    entries = load_mutations()
    assert len(entries) >= 14
    for entry in entries:
        assert (REPO / entry["file"]).read_text().count(entry["before"]) == 1, entry["name"]
        assert entry["before"] != entry["after"], entry["name"]
        for test in entry["tests"]:
            path, _, name = test.partition("::")
            function = re.sub(r"\[.*\]$", "", name)
            assert (REPO / path).is_file() and (not function or f"def {function}(" in (REPO / path).read_text()), (entry["name"], test)


@pytest.mark.slow
def test_the_gpu_benchmark_scripts_rows_pass_a_dry_run(tmp_path):
    """scripts/gpu_benchmark.sh's logic on CPU: DRY_RUN=1 checks every row of the gpu preset (the exact
    shapes, compile, float8, float8 grouped GEMMs, FlexAttention) as a fake-backend dry run."""
    import os

    env = os.environ | {"DRY_RUN": "1", "PYTHON": sys.executable, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = run_command(["bash", str(REPO / "scripts" / "gpu_benchmark.sh"), str(tmp_path)], timeout=600, cwd=REPO, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    sys.path.insert(0, str(REPO / "scripts"))
    from benchmark import PRESETS

    rows = [run.name for run in PRESETS["gpu"][2]]
    assert {"bf16_compile", "float8_rowwise_compile", "moe_qwen3_30b_a3b_bf16_compile_float8_grouped",
            "dsv3_16b_4_blocks_bf16_compile", "gpt_oss_20b_2_blocks_bf16_flex_compile"} <= set(rows)
    assert out.stdout.count("dry run OK") == len(rows), out.stdout[-3000:]
    assert all((tmp_path / "bench" / "gpu" / row / "dry_run.log").is_file() for row in rows)


def test_the_benchmark_starts_no_run_once_its_budget_is_spent(tmp_path):
    out = run_command([sys.executable, str(REPO / "scripts" / "benchmark.py"), "--preset", "gpu", "--dry-run", "--budget-s",
                       "1e-9", "--only", "bf16_compile", "gpt_oss_20b_2_blocks_bf16_flex_compile", "--out", str(tmp_path)],
                      timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "not run: bf16_compile, gpt_oss_20b_2_blocks_bf16_flex_compile" in out.stdout


def test_the_top_kernels_table_counts_gpu_kernels_not_the_ops_that_launch_them():
    """On a GPU the profile's table ranks kernels by their GPU time; the aten op that launched a kernel
    (a CPU event carrying the same GPU time) is left out, or each kernel would count twice."""
    from types import SimpleNamespace

    import torch

    from titanlite.profiling import top_kernels

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(key="aten::mm", device_type=cpu, self_device_time_total=900.0, self_cpu_time_total=50.0, count=4),
              SimpleNamespace(key="sm90_gemm", device_type=cuda, self_device_time_total=900.0, self_cpu_time_total=0.0, count=4),
              SimpleNamespace(key="flash_fwd", device_type=cuda, self_device_time_total=300.0, self_cpu_time_total=0.0, count=2)]
    table = top_kernels(events, gpu=True).splitlines()
    assert table[2:4] == ["| sm90_gemm | 0.900 | 4 | 75.0% |", "| flash_fwd | 0.300 | 2 | 25.0% |"]
    assert not any("aten::mm" in line for line in table)


@pytest.mark.slow
def test_a_run_past_its_time_is_killed_with_its_workers(corpus_jsonl, tmp_path):
    """scripts/benchmark.py gives each run what is left of --budget-s: past it, torchrun and its ranks go."""
    import subprocess

    from helpers import tiny_args
    from titanlite.launch import run_trainer

    with pytest.raises(RuntimeError, match="stopped after 8 s"):
        run_trainer(2, tiny_args(corpus_jsonl, tmp_path, "--training.steps", "100000"), log=tmp_path / "train.log", timeout=8)
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    if left:  # a broken stop: kill them before failing, so they do not run on past the test
        subprocess.run(["pkill", "-9", "-f", str(tmp_path)])
    assert left == [], left
