"""Metrics rows: throughput, MFU, cost per million tokens; the GPU spec table; power on CPU."""

import itertools
import json

import pytest
import torch

from titanlite import metrics
from titanlite.config import parse_args
from titanlite.hardware import find_gpu
from titanlite.metrics import MetricsLogger, power_reader


def test_row_has_tokens_per_second_per_device_mfu_and_cost(tmp_path, monkeypatch):
    config = parse_args(["--job.dump_folder", str(tmp_path), "--metrics.peak_flops", "1e12",
                         "--metrics.gpu_hour_cost", "2.0", "--metrics.enable_tensorboard", "false"])
    clock = itertools.chain([100.0, 100.0], itertools.repeat(102.0))  # logger start and window start, then the log
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    # 4000 tokens in 2 s, shared by cp x tp x pp = 2 devices: 1000 tokens/s per device.
    logger = MetricsLogger(config, torch.device("cpu"), flops_per_token=6_000_000, tokens_divisor=2, rank=0)
    logger.open(append=False)
    logger.record_step(tokens=4000, data_seconds=0.5)
    row = logger.log(step=1, loss=3.0, grad_norm=1.0, lr=1e-3, tokens_seen=4000)
    logger.close()
    assert row["tps"] == 1000.0
    assert row["tflops"] == pytest.approx(6e6 * 1000 / 1e12)  # 0.006 TFLOP/s
    assert row["mfu"] == pytest.approx(0.6)  # of a 1 TFLOP/s peak, in percent
    assert row["usd_per_mtok"] == pytest.approx(2.0 / 3600 / 1000 * 1e6)  # $2 per device-hour at 1000 tokens/s
    assert row["step_time_s"] == 2.0 and row["data_share"] == 0.25 and row["elapsed_s"] == 2.0
    assert "power_w" not in row  # no power reading on CPU, and none is made up
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["usd_per_mtok"] == row["usd_per_mtok"]


def test_gpu_table_matches_device_names():
    assert find_gpu("NVIDIA H200").tdp_watts == 700
    assert find_gpu("NVIDIA H100 PCIe").bf16_flops == 756e12
    assert find_gpu("NVIDIA H100 80GB HBM3").bf16_flops == 989e12
    assert find_gpu("NVIDIA GB200").name == "GB200" and find_gpu("NVIDIA B200").name == "B200"
    assert find_gpu("Some Future GPU") is None
    assert power_reader(torch.device("cpu")) is None
