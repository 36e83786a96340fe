"""Metrics rows: throughput, MFU, cost per million tokens; the GPU spec table; power on CPU."""

import json

import torch

from titanlite.config import parse_args
from titanlite.hardware import find_gpu
from titanlite.metrics import MetricsLogger, power_reader


def test_row_has_mfu_and_cost_per_million_tokens(tmp_path):
    config = parse_args(["--job.dump_folder", str(tmp_path), "--metrics.peak_flops", "1e12",
                         "--metrics.gpu_hour_cost", "2.0", "--metrics.enable_tensorboard", "false"])
    logger = MetricsLogger(config, torch.device("cpu"), flops_per_token=6_000_000, tokens_divisor=2, writes_files=True)
    logger.open(append=False)
    logger.record_step(tokens=4000, data_seconds=0.0)
    row = logger.log(step=1, loss=3.0, grad_norm=1.0, lr=1e-3, tokens_seen=4000)
    logger.close()
    # tokens/s per device = tokens / seconds / divisor; everything else follows from it.
    assert abs(row["tflops"] - 6e6 * row["tps"] / 1e12) < 1e-12
    assert abs(row["mfu"] - 100 * row["tflops"] / 1.0) < 1e-9
    assert abs(row["usd_per_mtok"] - 2.0 / 3600 / row["tps"] * 1e6) < 1e-9
    assert "power_w" not in row  # no power reading on CPU, and none is made up
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["usd_per_mtok"] == row["usd_per_mtok"]


def test_gpu_table_matches_device_names():
    assert find_gpu("NVIDIA H200").tdp_watts == 700
    assert find_gpu("NVIDIA H100 PCIe").bf16_flops == 756e12
    assert find_gpu("NVIDIA H100 80GB HBM3").bf16_flops == 989e12
    assert find_gpu("NVIDIA GB200").name == "GB200" and find_gpu("NVIDIA B200").name == "B200"
    assert find_gpu("Some Future GPU") is None
    assert power_reader(torch.device("cpu")) is None
