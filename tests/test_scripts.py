"""The measuring scripts run end to end on CPU: benchmark.py and loss_compare.py."""

import json
import sys

import pytest

from helpers import REPO, run_command


@pytest.mark.slow
def test_benchmark_smoke_preset_writes_rows_table_and_plot(tmp_path):
    out = run_command([sys.executable, str(REPO / "scripts" / "benchmark.py"), "--preset", "smoke", "--steps", "6",
                       "--warmup", "2", "--overhead-repeats", "2", "--out", str(tmp_path)], timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
    assert [r["name"] for r in rows] == ["1rank", "fsdp2"]
    for r in rows:
        assert r["tps_per_device"] > 0 and 0 < r["mfu"] < 100 and r["peak_memory_gib"] > 0 and 0 <= r["data_share"] < 1
        assert abs(r["tps_total"] - r["nproc"] * r["tps_per_device"]) < 1e-6 * r["tps_total"]
    assert rows[0]["bare_step_time_s"] > 0 and len(rows[0]["overhead_pct_each"]) == 2
    assert "| 1rank | 1 |" in out.stdout and (tmp_path / "results.csv").exists()
    assert (tmp_path / "results_smoke.png").stat().st_size > 10_000


@pytest.mark.slow
def test_loss_compare_trains_from_one_seed_and_asserts(corpus_jsonl, tmp_path):
    common = (f"--model.tokenizer_path byte --training.dataset {corpus_jsonl} --training.seq_len 32 "
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
                               for i, x in enumerate(result["curves"]["single"])))
    out = run_command([*script, "--metrics", "single", str(tmp_path / "single" / "metrics.jsonl"),
                       "--metrics", "shifted", str(shifted), "--out", str(tmp_path / "read"), "--assert-within", "1e-3"])
    assert out.returncode == 1 and "FAIL" in out.stdout, out.stdout + out.stderr
