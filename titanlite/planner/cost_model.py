"""The planner's cost model: memory per GPU and step time of one layout, from shapes alone.

Memory per GPU (bytes):
  states       16 B per parameter of the largest pipeline stage (fp32 weight, fp32 grad, AdamW's two
               fp32 moments), sharded by tp x dp_shard x cp (FSDP's group is dp_shard x cp)
  gathered     FSDP's working copies: unsharded weights (compute dtype) and gradients of two blocks
               (of the whole stage under PP, which keeps them gathered across microbatches)
  activations  what autograd keeps per block and microbatch (counted tensor by tensor below), times
               the blocks of a stage and the microbatches a 1F1B stage holds (up to pp); the logits;
               backward's working set (one block's activation gradients)
  overhead     runtime, allocator and communication buffers: a constant (GPU: 2 GiB; CPU: measured)

Step time: the linears' FLOPs at a sustained share of the peak (per GPU type and framework, under a
power limit, lower for small GEMMs: a GEMM's size is the harmonic sum of its dimensions, its
arithmetic intensity; float8 faster, up to the GPU's float8/bf16 peak ratio, the larger the GEMM),
causal attention at its own rate (CP's short chunks slower), the memory-bound elementwise work
(norms, activations, RoPE, residuals: passes over each activation at HBM bandwidth, fewer when
fused by torch.compile or Transformer Engine), recompute, the pipeline's busiest stage (the last
one also runs the output), plus the communication that cannot hide behind compute: FSDP
all-gathers/reduce-scatters beyond what overlaps, TP collectives (most hidden with TP overlap),
the pipeline bubble (interleaved stages shrink it), CP's ring exchange beyond the attention it
overlaps, HSDP's and ZeRO-1's gradient exchange beyond what overlaps, and for MoE models expert
parallel's all-to-alls (not overlapped).

Mixture of experts: FLOPs count the active parameters (a token's top-k experts); the routed experts
are sharded like every weight (over ep x efsdp = dp_shard x cp x tp) but gathered by FSDP over efsdp
only, so a rank's working copy holds experts / ep of them (the planner models expert TP degree 1:
experts whole; float8 covers the dense linears, routed experts run in bf16); the MoE layer routes each tp rank's
sequence shard (titanlite's MoE under TP), and the all-to-all moves top_k copies of each token's
hidden state to its experts and back, forward and backward. Collectives are ring-costed at NVLink
speed inside an NVLink domain and network speed across. A few constants are fitted to the
published runs of docs/published_runs.jsonl (`fit.fit_constants`, scripts/plan.py --fit; some held out),
the rest stated; docs/planner.md has both and the errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from titanlite.hardware import GPU
from titanlite.models.common.args import ModelArgs, MoEArgs

GIB = 2**30
# Fitted to the published runs (scripts/plan.py --fit; docs/planner.md), one by one below.
# The share of the bf16 peak that a GEMM of unbounded size would sustain in training, per GPU type.
SUSTAINED = {"A100": 0.864, "H100": 0.692, "B200": 0.648, "GB200": 0.59}
# GPU types with the same compute die as a measured one take its constant; others take H100's,
# with a caution.
SAME_DIE = {"H200": "H100", "H800": "H100", "H100": "H100", "A800": "A100", "A100": "A100"}
GEMM_HALF = 86.7  # the GEMM size (its FLOPs per byte moved in bf16) at which that share halves
ATTENTION_RATE = 0.93  # causal attention's rate relative to the matmuls'
FLOAT8_HALF = 1010  # the GEMM size at which float8 has half its speedup (casts and scales cost less per FLOP in larger ones)
# Seconds per block and microbatch, forward and backward, per framework: kernel launches, host work.
BLOCK_OVERHEAD = {"megatron": 0.00111, "torchtitan": 0.000969, "llm-foundry": 0.00409}
ELEMENTWISE_PASSES = 7.17  # reads and writes of each activation per block, forward and backward, unfused
POWER_EXPONENT = 0.927  # throughput under a power limit P: (P / TDP) ** POWER_EXPONENT
CP_ROUND = 0.0751  # each further CP ring round's cost, as a share of the attention
# The frameworks' kernels and overlap, relative to Megatron-Core's; titanlite is planned as
# TorchTitan, whose kernels (torch.compile, SDPA) and FSDP2 it shares.
SOFTWARE = {"megatron": 1, "torchtitan": 0.838, "llm-foundry": 0.885}
# The share of compute time that prefetched data-parallel collectives (FSDP's, and the replicas'
# gradient exchange) hide behind, at most all of it.
DP_OVERLAP = 0.933
FITTED = ("SUSTAINED", "GEMM_HALF", "ATTENTION_RATE", "FLOAT8_HALF", "ELEMENTWISE_PASSES", "BLOCK_OVERHEAD", "CP_ROUND",
          "POWER_EXPONENT", "SOFTWARE", "DP_OVERLAP")
UPPER_BOUNDS = {"SUSTAINED": 1.0, "DP_OVERLAP": 1.0}  # shares: the fit keeps them at most 1
# Stated, not fitted: the share of TP collectives hidden where TP communication overlaps its GEMMs
# (Megatron's tp_comm_overlap, torch's async TP).
TP_OVERLAP = 0.8
# Stated: a fused block (torch.compile's kernels, Transformer Engine's fused norms, activations and
# RoPE in Megatron) reads each activation once and writes it once in forward, and again in backward.
FUSED_PASSES = 4
# Stated: the share of the interleaved bubble a zero-bubble schedule leaves idle (forward, input
# gradients and weight gradients taken as equal thirds of the work: the weight gradients fill the
# rest). No published run used one.
ZERO_BUBBLE_SHARE = 1 / 3
GPU_OVERHEAD = 2 * GIB
# The range the published runs cover: the smallest per-GPU matmul width (min(dim, ffn) / tp) and
# tokens per microbatch and GPU among them, and the largest CP degree.
VALIDATED = {"width": 512, "tokens": 2048, "cp": 8}


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallel (MoE): borrows dp_shard x cp x tp, so it does not count in gpus
    microbatch: int = 1  # sequences per forward/backward on a rank
    ac: str = "none"  # none | op | full (| op_half: TorchTitan's op policy, for published runs)
    float8: bool = False
    vp: int = 1  # pipeline stages per pp rank (interleaved schedules)
    tp_overlap: bool = False  # TP collectives overlap their GEMMs (async TP)
    zero1: bool = False  # dp_replicate ranks shard the optimizer states (Megatron's distributed optimizer)
    compile: bool = False  # per-block torch.compile (TorchTitan's and titanlite's)
    zero_bubble: bool = False  # ZBVZeroBubble (vp 2 in V order): weight gradients run in the bubble
    sp_regather: bool = False  # Megatron's sequence parallel: GEMMs save their sharded input, all-gather it again in backward

    @property
    def gpus(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    def describe(self) -> str:
        parts = [f"{name} {v}" for name, v in [("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard), ("tp", self.tp),
                                               ("pp", self.pp), ("vp", self.vp), ("cp", self.cp), ("ep", self.ep)] if v > 1] or ["1 GPU"]
        flags = [name for name, on in (("float8", self.float8), ("TP overlap", self.tp_overlap), ("ZeRO-1", self.zero1),
                                       ("compile", self.compile), ("zero bubble", self.zero_bubble),
                                       ("SP regather", self.sp_regather)) if on]
        return ", ".join(parts) + f"; microbatch {self.microbatch}; AC {self.ac}" + "".join(f"; {f}" for f in flags)


@dataclass
class Estimate:
    layout: Layout
    gpu_type: GPU | None = None
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
    gathered = d / tp if layout.sp_regather else d  # a norm output as its GEMMs save it
    if layout.ac == "full":
        return tokens * d / tp  # the block input only
    if isinstance(model, MoEArgs):
        # Each tp rank routes tokens / tp tokens: k copies of the input, each expert's w1/w3 outputs,
        # silu(w1) and w2's input, its output; the shared experts' SwiGLU; the router's scores.
        routed = model.top_k * (2 * d + 4 * model.moe_hidden_dim)
        ffn = (routed + 4 * model.num_shared_experts * model.moe_hidden_dim + model.num_experts) / tp
        ffn_op = (model.top_k * (2 * d + 2 * model.moe_hidden_dim) + 2 * model.num_shared_experts * model.moe_hidden_dim) / tp
    else:
        ffn = gathered + 4 * f / tp  # the norm output: w1/w3's input; w1 and w3 outputs, silu(w1), w2's input
        ffn_op = gathered + 2 * f / tp
    full = (
        2 * d / tp  # the two norms' inputs (sequence-sharded)
        + gathered  # the attention norm's output: the input of wq/wk/wv
        + (3 * q + 2 * kv) / tp  # q, k, v, attention output, wo's input
        + ffn
    )
    if layout.ac in ("op", "op_half"):  # matmul and attention outputs (TorchTitan's policy: half the matmuls'; counted as all)
        return tokens * (d / tp + (q + q + 2 * kv) / tp + gathered + ffn_op)
    return tokens * full


def estimate(
    model: ModelArgs, seq_len: int, global_batch: int, gpu: GPU, layout: Layout,
    act_bytes: int = 2, overhead: float = GPU_OVERHEAD, power_watts: float | None = None, software: str = "torchtitan",
) -> Estimate:
    """`power_watts`: the GPUs' power limit where below their TDP; `software`: a SOFTWARE key."""
    L = layout if gpu.fp8_flops or not layout.float8 else replace(layout, float8=False)  # no float8 matmuls: bf16
    dp = L.dp_replicate * L.dp_shard
    fsdp = L.dp_shard * L.cp
    local_batch = global_batch // dp
    microbatches = max(1, local_batch // L.microbatch)
    tokens = L.microbatch * seq_len / L.cp  # local tokens of one microbatch
    blocks = -(-model.n_layers // L.pp)
    params = stage_params(model, L.pp)
    est = Estimate(L, gpu, capacity=gpu.hbm_bytes, peak=gpu.bf16_flops)

    # Memory. ZeRO-1: bf16 weights and fp32 gradients whole, the fp32 master weights and Adam's
    # moments sharded over the replicas (and cp, which Megatron's optimizer shards over too).
    if L.zero1:
        est.memory["states"] = (6 + 12 / (L.dp_replicate * fsdp)) * params / L.tp
    else:
        est.memory["states"] = 16 * params / (L.tp * fsdp)
    gathered_blocks = blocks if L.pp > 1 else 2  # a pipeline stage keeps all its blocks gathered
    experts = expert_params(model)
    gathered_block = (model.block_params - experts) / L.tp + experts / L.ep  # EP ranks gather their own experts (whole)
    sharded = fsdp > 1 and not L.zero1  # ZeRO-1 keeps the weights whole: nothing to gather
    est.memory["gathered"] = gathered_blocks * gathered_block * (act_bytes + 4) if sharded else 0.0
    # Microbatches whose activations a stage holds at once: pp under 1F1B; under an interleaved
    # schedule the first rank's warm-up runs (vp - 1) pp + 2 (pp - 1) + 1 stage-forwards of
    # blocks / vp blocks each before its first backward (torch's Interleaved1F1B).
    warmup = (L.vp - 1) * L.pp + 2 * (L.pp - 1) + 1 if L.vp > 1 else L.pp
    in_flight = min(microbatches * L.vp, warmup) / L.vp
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

    def gemm(m: float) -> float:
        """A layer's GEMM size: the harmonic sum of its three dimensions (the model width, the narrower
        tp shard of a weight, m tokens); the share of peak a GEMM reaches grows with it."""
        return 1 / (1 / model.dim + L.tp / min(model.dim, model.ffn_hidden_dim) + 1 / m)

    def saturation(size: float) -> float:
        return size / (size + GEMM_HALF)

    power = min(1.0, power_watts / gpu.tdp_watts) ** POWER_EXPONENT if power_watts else 1.0
    sustained = gpu.bf16_flops * SUSTAINED[gpu_family(gpu) or "H100"] * SOFTWARE[software] * power
    linear_gemm = gemm(tokens)
    est.matmul_efficiency = sustained * saturation(linear_gemm) / gpu.bf16_flops
    rate = gpu.bf16_flops * est.matmul_efficiency
    linear_share = 6 * model.num_params(exclude_embedding=True, active=True) / flops_per_token
    output_flops = 6 * model.vocab_size * model.dim  # per token, the output projection's
    # The linears at the matmul rate (float8's faster by float8_speedup; the output projection and
    # routed experts stay in bf16, as in TorchTitan and Transformer Engine); causal attention does
    # half the FLOPs counted (flops_per_token counts the full square) at ATTENTION_RATE times the
    # matmul rate of its own GEMMs.
    float8_share = 0.0
    if L.float8:
        routed = 6 * model.top_k * experts / model.num_experts * (model.n_layers - model.n_dense_layers) if experts else 0.0
        float8_share = linear_share - (routed + output_flops) / flops_per_token
    float8_gain = max(0.0, gpu.fp8_flops / gpu.bf16_flops - 1)  # no float8 matmuls: no gain
    float8_speedup = 1 + float8_gain * linear_gemm / (linear_gemm + FLOAT8_HALF)
    # Attention's GEMMs (QK^T, then the weights times V) are chunk x head_dim x chunk: context
    # parallel's ring computes them in chunks of seq / (2 cp) queries (head-tail), and each of its
    # cp - 1 further rounds (another KV shard, its merge into the output and log-sum-exp, forward and
    # backward) costs CP_ROUND of the attention more.
    chunk = seq_len / (2 * L.cp) if L.cp > 1 else seq_len
    attention_rate = ATTENTION_RATE * sustained * saturation(1 / (2 / chunk + 1 / model.head_dim))
    attention_rate /= 1 + CP_ROUND * (L.cp - 1)
    compute = est.flops_per_gpu * (
        float8_share / (float8_speedup * rate) + (linear_share - float8_share) / rate
        + 0.5 * (1 - linear_share) / attention_rate
    )
    # Recomputed in backward: under full AC one more forward (1/3 of forward + backward); titanlite's
    # op policy keeps every matmul (norms and elementwise ops rerun); TorchTitan's ("op_half")
    # recomputes every second matmul, half the linears' forward.
    recompute_share = {"none": 0.0, "op": 0.03, "op_half": linear_share / 6, "full": 1 / 3}[L.ac]
    # Memory-bound work at HBM bandwidth: the activations a block makes per token (two norm outputs,
    # q and the attention output, k and v, SwiGLU's three), each read and written `passes` times.
    q = model.n_heads * model.head_dim
    elements = (2 * model.dim + 2 * q + 2 * model.kv_dim + 3 * model.ffn_hidden_dim) / L.tp
    passes = FUSED_PASSES if L.compile or software == "megatron" else ELEMENTWISE_PASSES
    elementwise = microbatches * tokens * blocks * elements * act_bytes * passes / gpu.hbm_bandwidth
    est.time["compute"] = (compute + elementwise) * (1 + recompute_share) + microbatches * blocks * BLOCK_OVERHEAD[software]
    if L.pp > 1:
        # The last stage also runs the output projection, so the pipeline moves at the pace of its
        # busiest rank. Splits give the last rank fewer blocks for it (Megatron's
        # account_for_loss_in_pipeline_split, TorchTitan's uneven splits): the best such split.
        output = output_flops / ((flops_per_token - output_flops) / model.n_layers)  # in blocks
        busiest = min(max(-(-(model.n_layers - k) // (L.pp - 1)), k + output) for k in range(blocks + 1))
        est.time["compute"] *= busiest / ((model.n_layers + output) / L.pp)

    def link(group_span: int) -> float:
        """Per-GPU bandwidth of a collective whose group spans `group_span` consecutive ranks."""
        return gpu.nvlink_bandwidth if group_span <= gpu.nvlink_domain else gpu.network_bandwidth

    # FSDP: without PP, every microbatch all-gathers for forward and again for backward and
    # reduce-scatters fp32 gradients; a pipeline stage keeps its weights gathered across the step's
    # microbatches (gather once, reduce once), paid for in memory above.
    data_parallel = 0.0  # seconds of data-parallel collectives (FSDP's, then the replicas')
    if sharded:
        # Dense weights are gathered over fsdp; routed experts (whole, experts / ep per rank) over the
        # routing ranks outside EP, fsdp x tp / ep.
        moe_layers = blocks * (1 if experts else 0)
        dense, expert_part = params - moe_layers * experts, moe_layers * experts
        efsdp = fsdp * L.tp // L.ep if experts else 1
        # Float8 all-gathers move the dense linears' weights in 1 byte; the routed experts stay in high precision.
        for weights, group, float8_gather in ((dense / L.tp, fsdp, L.float8), (expert_part / L.ep, efsdp, False)):
            if group > 1 and weights:
                shard_bytes = weights * (1 if float8_gather else act_bytes)
                per_step = shard_bytes + weights * 4 if L.pp > 1 else microbatches * (2 * shard_bytes + weights * 4)
                data_parallel += per_step * (group - 1) / group / link(L.tp * fsdp)
    # HSDP / DDP replicas: one all-reduce of the (sharded) fp32 gradients; ZeRO-1: a reduce-scatter of
    # the whole fp32 gradients and an all-gather of the bf16 weights over the replicas x cp
    # (Megatron's overlap_grad_reduce and overlap_param_gather overlap both).
    if L.dp_replicate > 1:
        group = L.dp_replicate * (L.cp if L.zero1 else 1)
        per_param = 4 + act_bytes if L.zero1 else 2 * 4
        data_parallel += per_param * params / (L.tp * (1 if L.zero1 else fsdp)) * (group - 1) / group / link(L.gpus)
    # All of it overlaps compute, except at least one block's worth (the first gather, the last reduce).
    if data_parallel:
        est.time["data parallel exposed"] = max(data_parallel - DP_OVERLAP * est.time["compute"], data_parallel / max(blocks, 1))
    # TP with sequence parallel: per block, 2 all-gathers + 2 reduce-scatters forward, the same backward.
    if L.tp > 1:
        per_collective = tokens * model.dim * act_bytes * (L.tp - 1) / L.tp  # the TP group's gathered activation
        gathers = 2 * (0.5 if L.float8 else 1.0)  # float8 gathers move 1 byte per element
        backward = 4 + (2 if L.sp_regather else 0)  # input-grad reduce-scatters, output-grad all-gathers (+ the re-gathers)
        volume = microbatches * blocks * per_collective * (gathers + 2 + backward)
        est.time["tp"] = volume / link(L.tp) * (1 - TP_OVERLAP if L.tp_overlap else 1.0)
    # Pipeline: the bubble of 1F1B, (pp - 1) idle microbatch slots beside the microbatches, which
    # interleaving vp stages per rank divides by vp; a zero-bubble schedule runs the weight gradients
    # (a third of the work, with forward and input gradients alike) in what is left.
    if L.pp > 1:
        bubble = (L.pp - 1) / (L.vp * microbatches) * (ZERO_BUBBLE_SHARE if L.zero_bubble else 1.0)
        est.time["pp bubble"] = est.time["compute"] * bubble
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
    return est


def gpu_family(gpu: GPU) -> str | None:
    """The SUSTAINED key of a GPU (H100 96GB, H200 -> H100); None for a type no published run measured."""
    if gpu.name in SUSTAINED:
        return gpu.name
    return next((family for name, family in SAME_DIE.items() if gpu.name.startswith(name)), None)
