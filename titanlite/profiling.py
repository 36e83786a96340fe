"""torch.profiler traces every `profile_freq` steps, and CUDA memory snapshots (GPU only).

Traces: <dump_folder>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json (open in
chrome://tracing or Perfetto), beside rank<r>_top_kernels.txt: the 15 kernels that took the most
GPU time (on CPU, the ops that took the most CPU time), as a table. Memory snapshots: <dump_folder>/<save_memory_snapshot_folder>/
iteration_<step>/rank<r>_memory_snapshot.pickle (drag into pytorch.org/memory_viz). Snapshots
record the CUDA caching allocator, so on CPU they are skipped with a note.
"""

from __future__ import annotations

from pathlib import Path

import torch

from titanlite.metrics import log_line


TOP_KERNELS = 15


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
        by = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        (folder / f"rank{self.rank}_top_kernels.txt").write_text(prof.key_averages().table(sort_by=by, row_limit=TOP_KERNELS))

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
