"""A parallelism planner: memory per GPU and step time of candidate layouts, from shapes alone.

Memory per GPU (bytes):
  states       16 B per parameter of the largest pipeline stage (fp32 weight, fp32 grad, AdamW's two
               fp32 moments), sharded by tp x dp_shard x cp (FSDP's group is dp_shard x cp)
  gathered     FSDP's working copies: unsharded weights (compute dtype) and gradients of two blocks
               (of the whole stage under PP, which keeps them gathered across microbatches)
  activations  what autograd keeps per block and microbatch (counted tensor by tensor below), times
               the blocks of a stage and the microbatches a 1F1B stage holds (up to pp); the logits;
               backward's working set (one block's activation gradients)
  overhead     runtime, allocator and communication buffers: a constant (GPU: 2 GiB; CPU: measured)

Step time: compute at an achievable fraction of peak, which falls as TP narrows the per-GPU matmuls
(efficiency = max_efficiency * k / (k + 128), k = dim / tp), plus the communication that cannot
hide behind compute: FSDP all-gathers/reduce-scatters beyond what overlaps, every TP collective
(no async TP), the pipeline bubble, CP's ring exchange beyond the attention it overlaps, HSDP's
cross-replica all-reduce, and for MoE models expert parallel's all-to-alls (not overlapped).

Mixture of experts: FLOPs count the active parameters (a token's top-k experts); the routed experts
are sharded like every weight (over ep x efsdp = dp_shard x cp x tp) but gathered by FSDP over efsdp
only, so a rank's working copy holds experts / ep of them (the planner models expert TP degree 1:
experts whole; float8 covers the dense linears, routed experts run in bf16); the MoE layer routes each tp rank's
sequence shard (titanlite's MoE under TP), and the all-to-all moves top_k copies of each token's
hidden state to its experts and back, forward and backward. Collectives are ring-costed at NVLink speed inside an NVLink domain and
network speed across. The constants are stated here, not fitted per run; docs/planner.md compares
the predictions with published runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import product

from titanlite.hardware import GPU
from titanlite.models.args import ModelArgs, MoEArgs

GIB = 2**30
MAX_EFFICIENCY = 0.55  # bf16 matmul-heavy training, compiled, at large matmul widths
FLOAT8_EFFICIENCY = 0.70  # fraction of the float8 peak reached relative to bf16's (casts, scaling)
K_HALF = 128  # per-GPU matmul width at which efficiency is half its maximum
FSDP_OVERLAP = 0.9  # share of compute time FSDP's prefetched collectives can hide behind
GPU_OVERHEAD = 2 * GIB


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallel (MoE): borrows dp_shard x cp x tp, so it does not count in gpus
    microbatch: int = 1  # sequences per forward/backward on a rank
    ac: str = "none"  # none | op | full
    float8: bool = False

    @property
    def gpus(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    def describe(self) -> str:
        parts = [f"{name} {v}" for name, v in [("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard), ("tp", self.tp),
                                               ("pp", self.pp), ("cp", self.cp), ("ep", self.ep)] if v > 1] or ["1 GPU"]
        return ", ".join(parts) + f"; microbatch {self.microbatch}; AC {self.ac}" + ("; float8" if self.float8 else "")


@dataclass
class Estimate:
    layout: Layout
    memory: dict = field(default_factory=dict)  # bytes per GPU, by part
    time: dict = field(default_factory=dict)  # seconds per step, by part
    capacity: float = 0.0
    tokens_per_gpu: float = 0.0  # per step
    flops_per_gpu: float = 0.0
    peak: float = 0.0
    matmul_efficiency: float = 0.0

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())

    @property
    def step_time(self) -> float:
        return sum(self.time.values())

    @property
    def fits(self) -> bool:
        return self.memory_total <= self.capacity

    @property
    def tokens_per_second_per_gpu(self) -> float:
        return self.tokens_per_gpu / self.step_time

    @property
    def mfu(self) -> float:
        return self.flops_per_gpu / self.step_time / self.peak


def stage_params(model: ModelArgs, pp: int) -> float:
    """Parameters of the largest pipeline stage: its blocks plus the embedding or the output."""
    if pp == 1:
        return model.num_params()
    blocks = -(-model.n_layers // pp)
    return blocks * model.block_params + model.vocab_size * model.dim + model.dim


def expert_params(model: ModelArgs) -> float:
    """Routed-expert weights of one MoE block (0 for a dense model)."""
    return 3 * model.dim * model.moe_hidden_dim * model.num_experts if isinstance(model, MoEArgs) else 0.0


def block_activation_elements(model: ModelArgs, tokens: float, layout: Layout) -> float:
    """Elements autograd saves in one block for `tokens` local tokens (sequence parallel under TP)."""
    d, kv, f, tp = model.dim, model.kv_dim, model.ffn_hidden_dim, layout.tp
    q = model.n_heads * model.head_dim
    if layout.ac == "full":
        return tokens * d / tp  # the block input only
    if isinstance(model, MoEArgs):
        # Each tp rank routes tokens / tp tokens: k copies of the input, each expert's w1/w3 outputs,
        # silu(w1) and w2's input, its output; the shared experts' SwiGLU; the router's scores.
        routed = model.top_k * (2 * d + 4 * model.moe_hidden_dim)
        ffn = (routed + 4 * model.num_shared_experts * model.moe_hidden_dim + model.num_experts) / tp
        ffn_op = (model.top_k * (2 * d + 2 * model.moe_hidden_dim) + 2 * model.num_shared_experts * model.moe_hidden_dim) / tp
    else:
        ffn = d + 4 * f / tp  # the norm output, gathered: w1/w3's input; w1 and w3 outputs, silu(w1), w2's input
        ffn_op = d + 2 * f / tp
    full = (
        2 * d / tp  # the two norms' inputs (sequence-sharded)
        + d  # the attention norm's output, gathered: the input of wq/wk/wv
        + (3 * q + 2 * kv) / tp  # q, k, v, attention output, wo's input
        + ffn
    )
    if layout.ac == "op":  # matmul and attention outputs; norms and elementwise ops are recomputed
        return tokens * (d / tp + (q + q + 2 * kv) / tp + d + ffn_op)
    return tokens * full


def estimate(
    model: ModelArgs, seq_len: int, global_batch: int, gpu: GPU, layout: Layout,
    act_bytes: int = 2, overhead: float = GPU_OVERHEAD,
) -> Estimate:
    L = layout
    dp = L.dp_replicate * L.dp_shard
    fsdp = L.dp_shard * L.cp
    local_batch = global_batch // dp
    microbatches = max(1, local_batch // L.microbatch)
    tokens = L.microbatch * seq_len / L.cp  # local tokens of one microbatch
    blocks = -(-model.n_layers // L.pp)
    params = stage_params(model, L.pp)
    est = Estimate(L, capacity=gpu.hbm_bytes, peak=gpu.bf16_flops)

    # Memory.
    est.memory["states"] = 16 * params / (L.tp * fsdp)
    gathered_blocks = blocks if L.pp > 1 else 2  # a pipeline stage keeps all its blocks gathered
    experts = expert_params(model)
    gathered_block = (model.block_params - experts) / L.tp + experts / L.ep  # EP ranks gather their own experts (whole)
    est.memory["gathered"] = gathered_blocks * gathered_block * (act_bytes + 4) if fsdp > 1 else 0.0
    in_flight = min(microbatches, L.pp)
    per_block = block_activation_elements(model, tokens, L) * act_bytes
    one_block = block_activation_elements(model, tokens, replace(L, ac="none")) * act_bytes
    # Backward of a block holds gradients shaped like its activations (and, under full AC, the
    # recomputed activations themselves) next to everything still saved.
    working_set = one_block * (2 if L.ac == "full" else 1)
    logits = tokens * model.vocab_size / L.tp * (act_bytes + 8 if act_bytes == 2 else 8)
    est.memory["activations"] = in_flight * blocks * per_block + working_set + logits
    est.memory["overhead"] = overhead

    # Compute.
    est.tokens_per_gpu = global_batch * seq_len / (dp * L.tp * L.cp * L.pp)
    flops_per_token = model.flops_per_token(seq_len)
    est.flops_per_gpu = flops_per_token * est.tokens_per_gpu
    k = min(model.dim, model.ffn_hidden_dim) / L.tp
    est.matmul_efficiency = MAX_EFFICIENCY * k / (k + K_HALF)
    rate = gpu.bf16_flops * est.matmul_efficiency
    linear_share = 6 * model.num_params(exclude_embedding=True, active=True) / flops_per_token
    if L.float8:  # the dense linears; routed experts stay in bf16
        routed = 6 * model.top_k * experts / model.num_experts * (model.n_layers - model.n_dense_layers) if experts else 0.0
        float8_share = linear_share - routed / flops_per_token
        linear_rate = gpu.fp8_flops * est.matmul_efficiency * FLOAT8_EFFICIENCY
        compute = est.flops_per_gpu * (float8_share / linear_rate + (1 - float8_share) / rate)
    else:
        compute = est.flops_per_gpu / rate
    recompute_share = {"none": 0.0, "op": 0.03, "full": 1 / 3}[L.ac]  # a forward is ~1/3 of forward + backward
    est.time["compute"] = compute * (1 + recompute_share)

    def link(group_span: int) -> float:
        """Per-GPU bandwidth of a collective whose group spans `group_span` consecutive ranks."""
        return gpu.nvlink_bandwidth if group_span <= gpu.nvlink_domain else gpu.network_bandwidth

    # FSDP: without PP, every microbatch all-gathers for forward and again for backward and
    # reduce-scatters fp32 gradients; a pipeline stage keeps its weights gathered across the step's
    # microbatches (gather once, reduce once), paid for in memory above.
    if fsdp > 1:
        # Dense weights are gathered over fsdp; routed experts (whole, experts / ep per rank) over the
        # routing ranks outside EP, fsdp x tp / ep.
        moe_layers = blocks * (1 if experts else 0)
        dense, expert_part = params - moe_layers * experts, moe_layers * experts
        efsdp = fsdp * L.tp // L.ep if experts else 1
        comm = 0.0
        # Float8 all-gathers move the dense linears' weights in 1 byte; the routed experts stay in high precision.
        for weights, group, float8_gather in ((dense / L.tp, fsdp, L.float8), (expert_part / L.ep, efsdp, False)):
            if group > 1 and weights:
                shard_bytes = weights * (1 if float8_gather else act_bytes)
                per_step = shard_bytes + weights * 4 if L.pp > 1 else microbatches * (2 * shard_bytes + weights * 4)
                comm += per_step * (group - 1) / group / link(L.tp * fsdp)
        est.time["fsdp exposed"] = max(comm - FSDP_OVERLAP * est.time["compute"], comm / max(blocks, 1))
    # TP with sequence parallel: per block, 2 all-gathers + 2 reduce-scatters forward, the same backward.
    if L.tp > 1:
        per_collective = tokens * model.dim * act_bytes * (L.tp - 1) / L.tp  # the TP group's gathered activation
        gathers = 2 * (0.5 if L.float8 else 1.0)  # float8 gathers move 1 byte per element
        volume = microbatches * blocks * per_collective * (gathers + 2 + 4)
        est.time["tp"] = volume / link(L.tp)
    # Pipeline: 1F1B bubble, (pp - 1) idle microbatch slots out of (microbatches + pp - 1).
    if L.pp > 1:
        est.time["pp bubble"] = est.time["compute"] * (L.pp - 1) / microbatches
    # Context parallel: each rank passes k and v around the ring (and their gradients back);
    # it hides behind the attention compute of the same step.
    if L.cp > 1:
        volume = microbatches * blocks * 3 * 2 * tokens * model.kv_dim / L.tp * act_bytes * (L.cp - 1)
        attention_share = 1 - linear_share
        est.time["cp exposed"] = max(0.0, volume / link(L.tp * L.cp) - attention_share * est.time["compute"])
    # Expert parallel: every MoE layer sends top_k copies of each routed token out and back, in forward
    # and again in backward (the tp ranks route their own sequence shards), with nothing to hide behind.
    if experts and L.ep > 1:
        volume = microbatches * blocks * 4 * tokens / L.tp * model.top_k * model.dim * act_bytes * (L.ep - 1) / L.ep
        est.time["ep all-to-all"] = volume / link(L.ep)
    # HSDP / DDP replicas: one all-reduce of the (sharded) fp32 gradients, overlapping backward.
    if L.dp_replicate > 1:
        volume = 2 * 4 * params / (L.tp * fsdp) * (L.dp_replicate - 1) / L.dp_replicate
        comm = volume / link(L.gpus)
        est.time["dp_replicate exposed"] = max(0.0, comm - 0.5 * est.time["compute"])
    return est


def powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def candidate_layouts(model: ModelArgs, seq_len: int, global_batch: int, gpu: GPU, n_gpus: int,
                      float8: bool | None = None) -> list[Layout]:
    """Layouts using all n_gpus: TP inside an NVLink domain and dividing the kv heads, PP up to 16
    stages (at least 2 blocks each), CP for sequences of 8k and longer, HSDP across domains,
    every microbatch size and AC mode; float8 where the GPU has it (None: both ways)."""
    float8_options = [False, True] if float8 is None else [float8]
    if gpu.fp8_flops == 0:
        float8_options = [False]
    layouts = []
    experts = model.num_experts if isinstance(model, MoEArgs) else 1
    for tp, pp, cp in product(powers_of_two(min(gpu.nvlink_domain, model.n_kv_heads)), powers_of_two(16), powers_of_two(16)):
        if n_gpus % (tp * pp * cp) or (pp > 1 and model.n_layers < 2 * pp) or (cp > 1 and seq_len < 8192):
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
            for microbatch, ac, f8, ep in product(powers_of_two(local_batch), ("none", "op", "full"), float8_options, eps):
                if local_batch % microbatch or (pp > 1 and local_batch // microbatch < pp):
                    continue
                layouts.append(Layout(dp_replicate, dp_shard, tp, pp, cp, ep, microbatch, ac, f8))
    return layouts


def plan(model: ModelArgs, seq_len: int, global_batch: int, gpu: GPU, n_gpus: int, float8: bool | None = None,
         act_bytes: int = 2, overhead: float = GPU_OVERHEAD) -> tuple[list[Estimate], list[Estimate]]:
    """(layouts that fit, fastest first; layouts that do not fit, smallest memory first)."""
    estimates = [estimate(model, seq_len, global_batch, gpu, layout, act_bytes, overhead)
                 for layout in candidate_layouts(model, seq_len, global_batch, gpu, n_gpus, float8)]
    fitting = sorted((e for e in estimates if e.fits), key=lambda e: e.step_time)
    rejected = sorted((e for e in estimates if not e.fits), key=lambda e: e.memory_total)
    return fitting, rejected


def breakdown(e: Estimate) -> str:
    memory = ", ".join(f"{k} {v / GIB:.1f}" for k, v in e.memory.items() if v)
    time = ", ".join(f"{k} {1000 * v:.0f}" for k, v in e.time.items())
    return f"memory GiB: {memory} (total {e.memory_total / GIB:.1f} of {e.capacity / GIB:.0f}); step ms: {time}"


def explain(fitting: list[Estimate], rejected: list[Estimate]) -> list[str]:
    """Why the best layout wins: its costs, and what the nearest alternatives lose."""
    if not fitting:
        closest = rejected[0]
        return [f"no layout fits: the smallest needs {closest.memory_total / GIB:.1f} GiB per GPU "
                f"({closest.layout.describe()}); add GPUs, use a smaller global batch or sequence"]
    best = fitting[0]
    lines = [f"best: {best.layout.describe()}: {best.tokens_per_second_per_gpu:,.0f} tokens/s per GPU, "
             f"MFU {100 * best.mfu:.1f}%", f"  {breakdown(best)}"]
    for changed in ("tp", "pp", "ac", "float8", "cp", "ep"):
        rivals = [e for e in fitting[1:] if getattr(e.layout, changed) != getattr(best.layout, changed)]
        if not rivals:
            continue
        rival = rivals[0]
        slower = 100 * (rival.step_time / best.step_time - 1)
        reasons = [f"{k} {1000 * (rival.time.get(k, 0) - best.time.get(k, 0)):+.0f} ms"
                   for k in sorted(set(rival.time) | set(best.time))
                   if abs(rival.time.get(k, 0) - best.time.get(k, 0)) > 0.02 * best.step_time]
        lines.append(f"  vs {changed} {getattr(rival.layout, changed)} ({rival.layout.describe()}): {slower:+.1f}% step time: "
                     + (", ".join(reasons) or "same costs within 2%"))
        if changed == "tp":
            lines.append(f"     matmul efficiency {100 * best.matmul_efficiency:.0f}% of peak at tp {best.layout.tp} vs "
                         f"{100 * rival.matmul_efficiency:.0f}% at tp {rival.layout.tp} (per-GPU matmul width "
                         f"dim/tp); TP traffic per GPU does not shrink with tp while compute does")
    if rejected:
        lines.append(f"  {len(rejected)} layouts do not fit, e.g. {rejected[-1].layout.describe()} needs "
                     f"{rejected[-1].memory_total / GIB:.0f} GiB")
    return lines
