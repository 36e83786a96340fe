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


def every_extra() -> dict[str, float]:
    """Every extra a log step can have, from the trainer's and fault tolerance's own code (step_extras,
    stage_balance, FaultTolerance.metrics) run with every feature on, over stand-ins for their state:
    a key either adds shows up here, so its TensorBoard group is checked."""
    from types import SimpleNamespace

    from titanlite.fault_tolerance import FaultTolerance
    from titanlite.trainer import Trainer

    manager = SimpleNamespace(num_participants=lambda: 2, is_participating=lambda: True)
    ft = SimpleNamespace(manager=manager, steps_redone=3, stalled_seconds=0.4, goodput=lambda: 0.9, syncs=5, syncs_failed=0,
                         settings=SimpleNamespace(semi_sync_method="diloco"))
    trainer = SimpleNamespace(is_moe=True, aux_loss_on=True, device=torch.device("cpu"), pp_group=None,
                              balance=(torch.tensor([[3.0, 1.0]]), torch.tensor(0.003)), mtp_depth=1, mtp_loss=None,
                              global_loss=lambda loss: 2.5, ft=SimpleNamespace(metrics=lambda: FaultTolerance.metrics(ft)))
    trainer.stage_balance = lambda: Trainer.stage_balance(trainer)
    # A two-source training.dataset_mixture, 10 windows of 8 tokens in: web 7, code 3.
    from fractions import Fraction

    from titanlite.data.mixture import Schedule

    sources = [SimpleNamespace(stream=SimpleNamespace(name=name)) for name in ("web", "code")]
    trainer.dataloader = SimpleNamespace(dataset=SimpleNamespace(
        sources=sources, samples_per_source=Schedule([Fraction(7, 10), Fraction(3, 10)]).counts))
    trainer.config = SimpleNamespace(training=SimpleNamespace(dataset_mixture=["0.7 web", "0.3 code"], seq_len=8))
    trainer.samples_read = 10
    trainer.source_tokens = lambda: Trainer.source_tokens(trainer)
    return Trainer.step_extras(trainer)


def test_a_metric_without_a_group_is_charted_under_other():
    """A metric TB_TAGS lacks (test_tensorboard_tags_are_grouped_with_the_loss_chart_first keeps the
    trainer's own out of here) is charted as other/<key> rather than stopping a run mid-way."""
    assert metrics.scalar_tags({"step": 1, "loss": 3.0, "a_new_metric": 2.0}) == {"loss/loss": 3.0, "other/a_new_metric": 2.0}


def test_tensorboard_tags_are_grouped_with_the_loss_chart_first(tmp_path):
    """TensorBoard groups charts by the tag's prefix before '/' and sorts groups and charts by name:
    every scalar has a group, the loss sorts first, and each metrics.jsonl key has a tag of its own
    holding the same value. The logger gets every key a run can write: the row's, a MoE's and MTP's
    extras, fault tolerance's, a power reading (none on CPU: stood in for) and a validation."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = parse_args(["--job.dump_folder", str(tmp_path), "--metrics.enable_tensorboard", "true",
                         "--metrics.gpu_hour_cost", "2.0", "--metrics.peak_flops", "1e12"])
    logger = MetricsLogger(config, torch.device("cpu"), flops_per_token=6_000_000, tokens_divisor=1, rank=0)
    logger.power = ("NVML", lambda: 300.0)
    logger.open(append=False)
    logger.record_step(tokens=4000, data_seconds=0.01)
    extras = every_extra()
    assert {"mtp_loss", "moe_max_load", "moe_aux_loss", "ft_goodput", "ft_syncs"} <= set(extras), extras
    assert (extras["tokens_seen_web"], extras["tokens_seen_code"]) == (56, 24), extras
    logger.log(step=1, loss=3.0, grad_norm=1.5, lr=1e-3, tokens_seen=4000, skipped_steps=0, extras=extras)
    logger.log_validation(step=1, losses={"": 2.75, "web": 2.5, "code": 3.3})
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    keys = [k for row in rows for k in row if k != "step"]
    (events,) = {p.parent for p in (tmp_path / "tb").rglob("events.out.tfevents.*")}
    scalars = EventAccumulator(str(events)).Reload()
    tags = scalars.Tags()["scalars"]
    assert all(tag.count("/") == 1 and all(tag.split("/")) for tag in tags), tags
    assert sorted(tags)[0] == "loss/loss", sorted(tags)
    assert {"loss/loss", "loss/mtp_loss", "optimizer/grad_norm", "optimizer/lr", "throughput/tps", "throughput/mfu",
            "validation/loss", "moe/max_load", "torchft/goodput"} <= set(tags), tags
    from titanlite.metrics import tag

    ungrouped = sorted(k for k in keys if tag(k).startswith("other/"))
    assert not ungrouped, f"metrics {ungrouped} have no group: add them to TB_TAGS"
    assert {"throughput/tokens_seen_web", "validation/loss_code"} <= set(tags), tags
    assert len(tags) == len(keys) == len({tag(k) for k in keys}) and set(tags) == {tag(k) for k in keys}
    for row in rows:
        for key, value in row.items():
            if key != "step":
                (event,) = scalars.Scalars(tag(key))
                assert event.step == 1 and event.value == pytest.approx(value, rel=1e-6), key


def test_host_peak_memory_is_the_process_own_not_its_launchers():
    """A trainer started by a process that touched 1.5 GiB (a pytest worker, a launcher) reports its
    own peak: ru_maxrss would carry the starter's over exec. The peak grows by what the process touches."""
    import subprocess
    import sys

    child = ("import torch; from titanlite.metrics import peak_memory_gib; cpu = torch.device('cpu'); before = peak_memory_gib(cpu); "
             "t = torch.ones(300 * 2**20 // 4); print(before, peak_memory_gib(cpu))")
    starter = f"import subprocess, sys; big = b'1' * 1536 * 2**20; sys.exit(subprocess.run([sys.executable, '-c', {child!r}]).returncode)"
    out = subprocess.run([sys.executable, "-c", starter], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = map(float, out.stdout.split())
    assert 0.05 < before < 1.0, before  # torch imported: some hundreds of MiB, not the starter's 1.5 GiB
    assert 0.27 < after - before < 0.33, (before, after)  # 300 MiB touched
