"""Searching layouts: the candidates titanlite can run, ranked by the cost model, and the
explanation of the best against its nearest alternatives."""

from __future__ import annotations

from dataclasses import replace
from itertools import product

from titanlite.hardware import GPU
from titanlite.models.common.args import ModelArgs, MoEArgs
from titanlite.planner.command import stage_split
from titanlite.planner.cost_model import GIB, GPU_OVERHEAD, VALIDATED, Estimate, Layout, estimate, gpu_family


def powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def candidate_layouts(model: ModelArgs, seq_len: int, global_batch: int, gpu: GPU, n_gpus: int,
                      float8: bool | None = None, muon: bool = False) -> list[Layout]:
    """Layouts titanlite can run on all n_gpus: TP inside an NVLink domain and dividing the kv heads
    (async TP), PP up to 16 stages (at least 2 blocks each; 1, 2 or 4 per rank), CP for sequences of
    8k and longer, HSDP across domains, every microbatch size and AC mode; float8 where the GPU has
    it (None: both ways)."""
    float8_options = [False, True] if float8 is None else [float8]
    if gpu.fp8_flops == 0:
        float8_options = [False]
    layouts = []
    experts = model.num_experts if isinstance(model, MoEArgs) else 1
    for tp, pp, cp in product(powers_of_two(min(gpu.nvlink_domain, model.n_kv_heads)), powers_of_two(16), powers_of_two(16)):
        if n_gpus % (tp * pp * cp) or (pp > 1 and (model.n_layers < 2 * pp or model.tie_embeddings)) or (cp > 1 and seq_len < 8192):
            continue
        dp = n_gpus // (tp * pp * cp)
        replicas = [1] + [r for r in powers_of_two(dp) if r > 1 and dp // r * tp * pp * cp >= gpu.nvlink_domain]
        for dp_replicate in replicas:
            if global_batch % dp:
                continue
            local_batch = global_batch // dp
            # EP (MoE): cp x tp times a divisor of dp_shard that divides the experts.
            dp_shard = dp // dp_replicate
            eps = [1] + [cp * tp * d for d in powers_of_two(dp_shard)
                         if dp_shard % d == 0 and cp * tp * d > 1 and experts % (cp * tp * d) == 0] if experts > 1 else [1]
            # Interleaved schedules: up to 4 stages per rank, each at least 2 blocks; more than 2 where
            # titanlite can cut the blocks into that many stages (command.stage_split).
            vps = [vp for vp in (1, 2, 4) if pp > 1 and model.n_layers >= 2 * pp * vp
                   and (vp <= 2 or stage_split(model.n_layers, pp * vp))] or [1]
            for microbatch, ac, f8, ep, vp in product(powers_of_two(local_batch), ("none", "op", "full"), float8_options, eps, vps):
                if local_batch % microbatch or (pp > 1 and local_batch // microbatch < pp):
                    continue
                # Compiled per block (fused elementwise kernels), and under TP with async TP (which
                # needs compile), whose collectives overlap the GEMMs.
                layout = Layout(dp_replicate, dp_shard, tp, pp, cp, ep, microbatch, ac, f8, vp, tp_overlap=tp > 1, compile=True,
                                muon=muon)
                layouts.append(layout)
                if vp == 2:  # titanlite's ZBVZeroBubble: 2 stages per rank
                    layouts.append(replace(layout, zero_bubble=True))
    return layouts


def plan(model: ModelArgs, seq_len: int, global_batch: int, gpu: GPU, n_gpus: int, float8: bool | None = None,
         act_bytes: int = 2, overhead: float = GPU_OVERHEAD, muon: bool = False) -> tuple[list[Estimate], list[Estimate]]:
    """(layouts that fit, fastest first; layouts that do not fit, smallest memory first)."""
    estimates = [estimate(model, seq_len, global_batch, gpu, layout, act_bytes, overhead)
                 for layout in candidate_layouts(model, seq_len, global_batch, gpu, n_gpus, float8, muon)]
    fitting = sorted((e for e in estimates if e.fits), key=lambda e: e.step_time)
    rejected = sorted((e for e in estimates if not e.fits), key=lambda e: e.memory_total)
    return fitting, rejected


def breakdown(e: Estimate) -> str:
    memory = ", ".join(f"{k} {v / GIB:.1f}" for k, v in e.memory.items() if v)
    time = ", ".join(f"{k} {1000 * v:.0f}" for k, v in e.time.items())
    return f"memory GiB: {memory} (total {e.memory_total / GIB:.1f} of {e.capacity / GIB:.0f}); step ms: {time}"


def outside_validation(e: Estimate, model: ModelArgs, seq_len: int) -> list[str]:
    """Where a layout leaves the range the published runs cover (the constants are fitted there)."""
    L, notes = e.layout, []
    if e.gpu_type is not None and gpu_family(e.gpu_type) is None:
        notes.append(f"no published run measured a {e.gpu_type.name}: its efficiency is taken as an H100's")
    width = min(model.dim, model.ffn_hidden_dim) / L.tp
    if width < VALIDATED["width"]:
        notes.append(f"per-GPU matmul width {width:.0f} (dim / tp) is below the {VALIDATED['width']} of any published run")
    if L.microbatch * seq_len / L.cp < VALIDATED["tokens"]:
        notes.append(f"{L.microbatch * seq_len / L.cp:.0f} tokens per microbatch and GPU, fewer than the {VALIDATED['tokens']} of any "
                     "published run")
    if L.cp > VALIDATED["cp"]:
        notes.append(f"context parallel {L.cp}: published runs go to cp {VALIDATED['cp']}")
    if e.memory_total > 0.85 * e.capacity:
        notes.append(f"{e.memory_total / GIB:.1f} of {e.capacity / GIB:.0f} GiB: within the memory model's 15% error of the "
                     "GPU's capacity; check the peak on a short run")
    return notes


def differences(a: Layout, b: Layout) -> str:
    """How layout b differs from a, in words."""
    names = {"dp_replicate": "replicas", "dp_shard": "FSDP", "tp": "TP", "pp": "PP", "vp": "stages per PP rank", "cp": "CP",
             "ep": "EP", "microbatch": "microbatch", "ac": "AC", "float8": "float8", "zero_bubble": "zero bubble"}
    return ", ".join(f"{label} {getattr(b, key)}" for key, label in names.items() if getattr(a, key) != getattr(b, key)) or "the same"


def slower(rival: Estimate, best: Estimate) -> str:
    """How much longer `rival`'s step is than `best`'s, and the parts that make the difference."""
    reasons = [f"{k} {1000 * (rival.time.get(k, 0) - best.time.get(k, 0)):+.0f} ms"
               for k in sorted(set(rival.time) | set(best.time))
               if abs(rival.time.get(k, 0) - best.time.get(k, 0)) > 0.02 * best.step_time]
    return f"{100 * (rival.step_time / best.step_time - 1):+.1f}% step time: " + (", ".join(reasons) or "same costs within 2%")


def explain(fitting: list[Estimate], rejected: list[Estimate], model: ModelArgs | None = None, seq_len: int = 0) -> list[str]:
    """Why the best layout wins: its costs, the layouts as fast as it, what the nearest alternatives
    lose, and where it leaves the range the model was validated on."""
    if not fitting:
        closest = rejected[0]
        return [f"no layout fits: the smallest needs {closest.memory_total / GIB:.1f} GiB per GPU "
                f"({closest.layout.describe()}); add GPUs, use a smaller global batch or sequence"]
    best = fitting[0]
    lines = [f"best: {best.layout.describe()}: {best.tokens_per_second_per_gpu:,.0f} tokens/s per GPU, "
             f"MFU {100 * best.mfu:.1f}%", f"  {breakdown(best)}"]
    if model is not None:
        lines += [f"  caution: {note}" for note in outside_validation(best, model, seq_len)]
    ties = [e for e in fitting[1:] if e.step_time <= best.step_time * 1.01]
    if ties:
        shown = "; ".join(differences(best.layout, e.layout) for e in ties[:3])
        lines.append(f"  {len(ties)} more within 1% (the model cannot rank them; pick the least memory or the simplest), "
                     f"e.g. with {shown}")
    # Each alternative: the fastest layout that fits on the other side of one choice (pipelining or not,
    # a smaller EP: the two a MoE plan turns on), and for those two the one nearest to fitting of the
    # layouts that would beat it: what it lacks.
    other_side = {"tp": lambda a, b: a.tp != b.tp, "pp": lambda a, b: (a.pp > 1) != (b.pp > 1), "ac": lambda a, b: a.ac != b.ac,
                  "float8": lambda a, b: a.float8 != b.float8, "cp": lambda a, b: a.cp != b.cp, "ep": lambda a, b: b.ep < a.ep}
    for changed, differs in other_side.items():
        rivals = [e for e in fitting[1:] if differs(best.layout, e.layout)]
        if not rivals:
            continue
        rival = rivals[0]
        lines.append(f"  vs {changed} {getattr(rival.layout, changed)} ({rival.layout.describe()}): {slower(rival, best)}")
        if changed == "tp":
            lines.append(f"     matmul efficiency {100 * best.matmul_efficiency:.0f}% of peak at tp {best.layout.tp} vs "
                         f"{100 * rival.matmul_efficiency:.0f}% at tp {rival.layout.tp} (each GPU's GEMMs shrink with tp); "
                         "TP traffic per GPU does not shrink with tp while compute does")
        if changed not in ("pp", "ep"):
            continue
        faster = min((e for e in rejected if differs(best.layout, e.layout) and e.step_time < rival.step_time),
                     key=lambda e: e.memory_total, default=None)  # the nearest to fitting
        if faster is not None:
            lines.append(f"     a faster one with {changed} {getattr(faster.layout, changed)} does not fit: {faster.layout.describe()} "
                         f"needs {faster.memory_total / GIB:.0f} of {faster.capacity / GIB:.0f} GiB ({slower(faster, best)})")
    if rejected:
        lines.append(f"  {len(rejected)} layouts do not fit, e.g. {rejected[-1].layout.describe()} needs "
                     f"{rejected[-1].memory_total / GIB:.0f} GiB")
    return lines

