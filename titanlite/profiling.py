"""torch.profiler traces every `profile_freq` steps, and CUDA memory snapshots (GPU only).

Traces: <dump_folder>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json (open in
chrome://tracing or Perfetto), beside rank<r>_top_kernels.txt: the 15 GPU kernels that took the most
time (on CPU, the ops that took the most CPU time of their own), as a table. Memory snapshots: <dump_folder>/<save_memory_snapshot_folder>/
iteration_<step>/rank<r>_memory_snapshot.pickle (drag into pytorch.org/memory_viz). Snapshots
record the CUDA caching allocator, so on CPU they are skipped with a note.
"""

from __future__ import annotations

from pathlib import Path

import torch

from titanlite.metrics import log_line


TOP_KERNELS = 15


def top_kernels(events, gpu: bool) -> str:
    """The TOP_KERNELS costliest of a profile's averaged events as a table: on a GPU its kernels by
    their GPU time (not the aten ops that launched them, which would count each kernel twice), on CPU
    the ops by the CPU time of their own."""
    if gpu:
        rows = [(e.key, e.self_device_time_total, e.count) for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        rows = [(e.key, e.self_cpu_time_total, e.count) for e in events]
    rows.sort(key=lambda row: -row[1])
    total = sum(us for _, us, _ in rows) or 1.0
    what = "GPU kernel" if gpu else "op (self CPU time)"
    lines = [f"| {what} | ms | calls | share |", "|---|---|---|---|"]
    lines += [f"| {name[:100]} | {us / 1000:.3f} | {count} | {100 * us / total:.1f}% |" for name, us, count in rows[:TOP_KERNELS]]
    return "\n".join(lines) + f"\n\ntotal: {total / 1000:.3f} ms over {len(rows)} {'kernels' if gpu else 'ops'}\n"


class Profiler:
    def __init__(self, config, rank: int, device: torch.device):
        p = config.profiling
        self.rank, self.freq, self.device = rank, p.profile_freq, device
        self.traces = Path(config.job.dump_folder) / p.save_traces_folder
        self.snapshots = Path(config.job.dump_folder) / p.save_memory_snapshot_folder
        self.profiler = None
        self.step = 0
        if p.enable_profiling:
            self.profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU]
                + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []),
                # Each profile_freq-step cycle ends with profiler_warmup + profiler_active steps (TorchTitan's).
                schedule=torch.profiler.schedule(
                    wait=self.freq - p.profiler_warmup - p.profiler_active, warmup=p.profiler_warmup, active=p.profiler_active
                ),
                on_trace_ready=self._write_trace,
            )
            self.profiler.start()
        self.snapshot = p.enable_memory_snapshot and device.type == "cuda"
        if p.enable_memory_snapshot and not self.snapshot:
            log_line("profiling.enable_memory_snapshot: CUDA memory snapshots need a GPU; skipped on CPU")
        if self.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    def _write_trace(self, prof) -> None:
        folder = self.traces / f"iteration_{self.step}"
        folder.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(folder / f"rank{self.rank}_trace.json"))
        (folder / f"rank{self.rank}_top_kernels.txt").write_text(top_kernels(prof.key_averages(), self.device.type == "cuda"))

    def after_step(self, step: int) -> None:
        self.step = step
        if self.profiler is not None:
            self.profiler.step()
        if self.snapshot and step % self.freq == 0:
            folder = self.snapshots / f"iteration_{step}"
            folder.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(folder / f"rank{self.rank}_memory_snapshot.pickle"))

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
        if self.snapshot:
            torch.cuda.memory._record_memory_history(enabled=None)
