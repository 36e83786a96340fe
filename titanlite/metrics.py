"""Throughput, TFLOPS, MFU, memory; one console line, TensorBoard scalars and metrics.jsonl rows.

Per-device figures: tokens/s per device = tokens this data-parallel rank consumed / seconds /
(cp * tp * pp), since those ranks share one stream of tokens. MFU = flops_per_token * tps / peak.
"""

from __future__ import annotations

import json
import os
import re
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from titanlite.hardware import find_gpu


def peak_flops(device: torch.device, configured: float) -> tuple[float, str]:
    """(peak FLOP/s per device, how it was obtained) for the MFU denominator."""
    if configured > 0:
        return configured, "configured"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        gpu = find_gpu(name)
        if gpu:
            return gpu.bf16_flops, f"{gpu.name} bf16 spec"
        return 312e12, f"unknown GPU '{name}': A100 bf16 peak assumed"
    return measure_cpu_flops(), "CPU fp32 matmul, measured"


def measure_cpu_flops(n: int = 512, seconds: float = 0.3) -> float:
    """Best sustained fp32 matmul rate of this process's threads: the honest CPU 'peak'."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # warm up
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - start))
    return best


def power_reader(device: torch.device) -> tuple[str, Callable[[], float]] | None:
    """(how device power is known, a function returning watts): 'NVML' readings, or the board's
    TDP as an estimate; None where neither exists (CPU: not measured)."""
    if device.type != "cuda":
        return None
    try:
        torch.cuda.power_draw(device)
        return "NVML", lambda: torch.cuda.power_draw(device) / 1000  # milliwatts
    except Exception:  # no pynvml / amdsmi, or the driver refuses: fall back to the board's TDP
        gpu = find_gpu(torch.cuda.get_device_name(device))
        return ("TDP estimate", lambda: gpu.tdp_watts) if gpu else None


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    return host_peak_bytes() / 2**30


def host_peak_bytes() -> int:
    """This process's peak resident memory: Linux's VmHWM. getrusage's ru_maxrss keeps, across exec, the
    peak of the process that started this one (a trainer started by a 2 GiB pytest or launcher would
    report 2 GiB); it is the fallback where /proc is missing."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


# ANSI colours of the console line's fields, on a terminal only (see use_color).
COLORS = {"loss": "\033[36m", "grad_norm": "\033[33m", "tps": "\033[32m", "mfu": "\033[35m", "mem": "\033[34m"}
RESET = "\033[0m"
FIELDS = re.compile(r"\b(loss|grad_norm|tps|mfu|mem) +[-+0-9.,naif]+(?:%| GiB)?")


def use_color(config, stream=sys.stdout) -> bool:
    """Colours on a terminal unless metrics.disable_color_printing (or NO_COLOR) says no; never into a
    file or pipe. Under torchrun a rank's stdout is a pipe (into torchrun's log files), so ranks print
    plain lines and titanlite.torchrun colours them on their way to its terminal."""
    return not (config.metrics.disable_color_printing or os.environ.get("NO_COLOR")) and stream.isatty()


def colorize(text: str) -> str:
    """The step line's fields in colour (other text unchanged)."""
    if "| loss" not in text:
        return text
    return FIELDS.sub(lambda m: f"{COLORS[m.group(1)]}{m.group(0)}{RESET}", text)


class ColorizedStream:
    """A text stream that colours step lines as they pass (the launcher's stdout on a terminal)."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        return self.stream.write(colorize(text))

    def __getattr__(self, name):
        return getattr(self.stream, name)


def open_wandb(config, folder: Path, rank: int, all_ranks: bool):
    """A W&B run in <dump_folder>/wandb (WANDB_PROJECT, WANDB_RUN_NAME, WANDB_TEAM, WANDB_MODE as
    wandb reads them; WANDB_MODE=offline needs no network)."""
    from titanlite.preflight import check_wandb_installed

    check_wandb_installed()
    import wandb

    name = os.environ.get("WANDB_RUN_NAME") or folder.name
    return wandb.init(
        project=os.environ.get("WANDB_PROJECT", "titanlite"),
        entity=os.environ.get("WANDB_TEAM"),
        name=f"{name}-rank{rank}" if all_ranks else name,
        group=name if all_ranks else None,
        dir=str(folder),
        config=config.to_dict(),
    )


# Each metrics.jsonl key's TensorBoard (and W&B) tag, "group/name": both show a group per prefix and
# sort groups and the charts in them by name. So no group sorts before "loss" (fault tolerance is
# "torchft", cost sits with throughput) and nothing in loss/ sorts before "loss/loss" (grad_norm and
# lr are the optimizer step's). metrics.jsonl keeps the flat keys.
TB_TAGS = {
    "loss": "loss/loss",
    "mtp_loss": "loss/mtp_loss",
    "grad_norm": "optimizer/grad_norm",
    "lr": "optimizer/lr",
    "skipped_steps": "optimizer/skipped_steps",
    "tps": "throughput/tps",
    "tflops": "throughput/tflops",
    "mfu": "throughput/mfu",
    "tokens_seen": "throughput/tokens_seen",
    "usd_per_mtok": "throughput/usd_per_mtok",
    "memory_gib": "memory/peak_gib",
    "step_time_s": "time/step_s",
    "data_share": "time/data_share",
    "elapsed_s": "time/elapsed_s",
    "power_w": "power/watts",
    "joules_per_token": "power/joules_per_token",
    "moe_max_load": "moe/max_load",
    "moe_aux_loss": "moe/aux_loss",
    "ft_replicas": "torchft/replicas",
    "ft_participating": "torchft/participating",
    "ft_steps_redone": "torchft/steps_redone",
    "ft_stalled_seconds": "torchft/stalled_seconds",
    "ft_goodput": "torchft/goodput",
    "ft_syncs": "torchft/syncs",
    "ft_syncs_failed": "torchft/syncs_failed",
    "health_spike": "health/spike",
    "health_spike_rank": "health/spike_rank",
    "health_nonfinite_rank": "health/nonfinite_rank",
    "health_transient_rank": "health/transient_rank",
    "health_replay_data": "health/replay_data",
    "health_replica_healed_rank": "health/replica_healed_rank",
    "health_straggler_rank": "health/straggler_rank",
    "health_straggler_late_s": "health/straggler_late_s",
    "val_loss": "validation/loss",
    "val_perplexity": "validation/perplexity",
}


def scalar_tags(row: dict) -> dict[str, float]:
    """A metrics.jsonl row's scalars under their TensorBoard tags; a metric TB_TAGS lacks goes under
    other/ (tests/test_metrics.py fails on any the trainer writes, so that is a stopgap, not a group)."""
    return {tag(k): v for k, v in row.items() if k != "step"}


# Metrics named after a data source (training.dataset_mixture, validation.dataset_mixture).
SOURCE_TAGS = {"tokens_seen_": "throughput/tokens_seen_", "val_loss_": "validation/loss_"}


def tag(key: str) -> str:
    prefix = next((p for p in SOURCE_TAGS if key.startswith(p)), None)
    return SOURCE_TAGS[prefix] + key.removeprefix(prefix) if prefix else TB_TAGS.get(key, f"other/{key}")


class MetricsLogger:
    """Accumulates timing between log steps and writes the console, TensorBoard, W&B and JSONL rows.

    One rank (`writes_files`, rank 0: the loss is summed over every dim, pp included) writes
    metrics.jsonl, TensorBoard and W&B; with metrics.save_for_all_ranks every rank writes its own
    TensorBoard folder (rank_<r>) and W&B run. Every rank may print; torchrun's LOG_RANK filter
    chooses whose lines a person sees.
    """

    def __init__(self, config, device: torch.device, flops_per_token: int, tokens_divisor: int, rank: int):
        m = config.metrics
        self.config = config
        self.device, self.flops_per_token, self.tokens_divisor = device, flops_per_token, tokens_divisor
        self.peak, self.peak_source = peak_flops(device, m.peak_flops)
        self.gpu_hour_cost = m.gpu_hour_cost
        self.power = power_reader(device)
        self.folder = Path(config.job.dump_folder)
        self.rank, self.writes_files = rank, rank == 0
        self.writes_scalars = self.writes_files or m.save_for_all_ranks
        ranks_folder = self.folder / m.save_tb_folder / (f"rank_{rank}" if m.save_for_all_ranks else "")
        self.tb_folder = ranks_folder / time.strftime("%Y%m%d-%H%M%S")
        self.color = use_color(config)
        self.jsonl = self.tb = self.wandb = None
        self.start = time.perf_counter()
        self.reset()

    def open(self, append: bool) -> None:
        """Start the files: a resumed run appends to metrics.jsonl, a fresh one starts it anew."""
        m = self.config.metrics
        if self.writes_files:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.jsonl = open(self.folder / "metrics.jsonl", "a" if append else "w")
        if self.writes_scalars and m.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.tb_folder))
        if self.writes_scalars and m.enable_wandb:
            self.wandb = open_wandb(self.config, self.folder, self.rank, m.save_for_all_ranks)

    def reset(self) -> None:
        self.window_start = time.perf_counter()
        self.tokens = 0
        self.data_seconds = 0.0
        self.steps = 0

    def record_step(self, tokens: int, data_seconds: float) -> None:
        self.tokens += tokens
        self.data_seconds += data_seconds
        self.steps += 1

    def log(
        self, step: int, loss: float, grad_norm: float, lr: float, tokens_seen: int, skipped_steps: int | None = None,
        extras: dict[str, float] | None = None,
    ) -> dict:
        """`extras`: more scalars of the step (a MoE's load balance), on the line and in every sink."""
        seconds = time.perf_counter() - self.window_start
        tps = self.tokens / seconds / self.tokens_divisor
        tflops = self.flops_per_token * tps / 1e12
        row = {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tps": tps,
            "tflops": tflops,
            "mfu": 100 * tflops * 1e12 / self.peak,
            "memory_gib": peak_memory_gib(self.device),
            "step_time_s": seconds / self.steps,
            "data_share": self.data_seconds / seconds,
            "tokens_seen": tokens_seen,
            "elapsed_s": time.perf_counter() - self.start,
        }
        costs = ""
        if skipped_steps is not None:  # training.skip_nonfinite_steps: steps skipped so far
            row["skipped_steps"] = skipped_steps
            costs += f" | skipped {skipped_steps}"
        if self.gpu_hour_cost > 0:  # device-hours per million tokens x price
            row["usd_per_mtok"] = self.gpu_hour_cost * 1e6 / (tps * 3600)
            costs += f" | ${row['usd_per_mtok']:.3f}/Mtok"
        if self.power is not None:
            watts = self.power[1]()
            row["power_w"], row["joules_per_token"] = watts, watts / tps
            costs += f" | {row['joules_per_token']:.3f} J/tok"
        for key, value in (extras or {}).items():
            row[key] = value
            costs += f" | {key} {value:.4g}"
        line = (
            f"step {step:>6} | loss {loss:8.4f} | grad_norm {grad_norm:7.3f} | lr {lr:.2e} | tps {tps:>9,.0f} | "
            f"tflops {tflops:7.2f} | mfu {row['mfu']:5.2f}% | mem {row['memory_gib']:6.2f} GiB | "
            f"data {100 * row['data_share']:4.1f}%{costs} | {row['elapsed_s']:7.1f}s"
        )
        print(colorize(line) if self.color else line, flush=True)
        self._write(step, row)
        self.reset()
        return row

    def log_validation(self, step: int, losses: dict[str, float]) -> dict:
        """losses: {"": the loss} and each validation source's by its name."""
        loss = losses[""]
        row = {"step": step, "val_loss": loss, "val_perplexity": float(torch.tensor(loss).exp())}
        row |= {f"val_loss_{name}": value for name, value in losses.items() if name}
        sources = "".join(f" | {name} {value:.4f}" for name, value in losses.items() if name)
        print(f"step {step:>6} | validation loss {loss:8.4f} | perplexity {row['val_perplexity']:10.2f}{sources}", flush=True)
        self._write(step, row)
        return row

    def log_event(self, step: int, row: dict, line: str) -> None:
        """A health alarm: one line on the console, its figures in metrics.jsonl, TensorBoard and W&B."""
        log_line(line)
        self._write(step, {"step": step} | row)

    def _write(self, step: int, row: dict) -> None:
        scalars = scalar_tags(row)
        if self.jsonl:
            self.jsonl.write(json.dumps(row) + "\n")
            self.jsonl.flush()
        if self.tb:
            for tag, value in scalars.items():
                self.tb.add_scalar(tag, value, step)
            self.tb.flush()
        if self.wandb:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        for handle in (self.jsonl, self.tb):
            if handle:
                handle.close()
        if self.wandb:
            self.wandb.finish()


def log_line(message: str) -> None:
    print(f"titanlite: {message}", file=sys.stdout, flush=True)
