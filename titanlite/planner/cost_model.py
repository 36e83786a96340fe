"""The planner's cost model: memory per GPU and step time of one layout, from shapes alone.

Memory per GPU (bytes):
  states       16 B per parameter of the largest pipeline stage (fp32 weight, fp32 grad, AdamW's two
               fp32 moments; 12 B under Muon, one momentum, for all but the embedding and output),
               sharded by tp x dp_shard x cp (FSDP's group is dp_shard x cp)
  gathered     FSDP's working copies: unsharded weights (compute dtype) and gradients of two blocks
               (of the whole stage under PP, which keeps them gathered across microbatches)
  activations  what autograd keeps per block and microbatch (counted tensor by tensor below), times
               the blocks of a stage and the microbatches a 1F1B stage holds (up to pp); the logits;
               backward's working set (one block's activation gradients)
  overhead     runtime, allocator and communication buffers: a constant (GPU: 2 GiB; CPU: measured)

Step time: the linears' FLOPs at a sustained share of the peak (per GPU type and framework, under a
power limit, lower for small GEMMs: a GEMM's size is the harmonic sum of its dimensions, its
arithmetic intensity; float8 faster, up to the GPU's float8/bf16 peak ratio, the larger the GEMM),
causal attention at its own rate over the keys each block sees (CP's ring rounds slower; masked
attention under CP in titanlite's fp32 document ring), the memory-bound elementwise work
(norms, activations, RoPE, residuals: passes over each activation at HBM bandwidth, fewer when
fused by torch.compile or Transformer Engine), recompute, a fixed host cost per block and
microbatch (more per MoE block), the pipeline's busiest stage (the last one also runs the output,
and multi-token prediction's modules), plus the communication that cannot hide behind compute:
FSDP all-gathers/reduce-scatters beyond what overlaps, TP collectives (most hidden with TP
overlap), the pipeline bubble (interleaved stages shrink it), CP's exchange (the ring's beyond each
round's attention; the all-gather CP's in full), HSDP's and ZeRO-1's gradient exchange beyond what
overlaps, and for MoE models expert parallel's all-to-alls (titanlite's not overlapped).

Mixture of experts, in the MoE blocks (the args' is_moe): FLOPs count the active parameters (a
token's top-k experts); the routed experts are split over ep x efsdp (= dp_shard x cp x tp) as
FSDP2 shards them (whole experts along dim 0, or along dim 1 where the ranks outnumber them), and gathered
by FSDP over efsdp only, so a rank's working copy holds experts / ep of them (expert TP degree 1:
experts whole, each expert's GEMM as large as the copies routed to it; float8 covers the dense
linears, and the routed experts only under Megatron's grouped GEMMs); the MoE layer routes each tp
rank's sequence shard (titanlite's MoE under TP), and the all-to-all moves top_k copies of each
token's hidden state to its experts and back, forward and backward; across nodes, copy by copy
(titanlite) or once per node reached (DeepEP, HybridEP: at most topk_group nodes under DeepSeek-V3's
group-limited routing). DeepSeek-V3's latent attention and multi-token prediction, Llama 4's chunks
and interleaved MoE blocks: shapes.py.
Collectives are ring-costed at NVLink speed inside an NVLink domain and network speed across. A few
constants are fitted to the published runs of docs/published_runs.jsonl (`fit.fit_constants`,
scripts/plan.py --fit; some held out), the rest stated; docs/planner.md has both and the errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from titanlite.hardware import GPU
from titanlite.models.common.args import ModelArgs, MoEArgs
from titanlite.planner.shapes import (
    attention_flops, attention_shape, attention_spans, block_activation_elements, block_weights, elementwise_elements,
    flops_per_token as counted_flops_per_token, heaviest_layers, latent_down_params, moe_blocks_among, moe_share,
    mtp_depth, padded_attention_flops, remote_nodes_per_token, routed_flops, stage_expert_params, stage_params, tail_flops,
)

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
BLOCK_OVERHEAD = {"megatron": 0.00112, "torchtitan": 0.00105, "llm-foundry": 0.00417, "meta": 0.001}
# Seconds more per MoE block and microbatch, per framework: dropless routing sizes the experts' GEMMs
# on the host (a device-to-host copy of the token counts per layer, which drains the launch queue)
# before the layer's many small kernels (router, permutation, dispatch, combine).
MOE_BLOCK_OVERHEAD = {"megatron": 0.00159, "torchtitan": 0.00632}
ELEMENTWISE_PASSES = 7.03  # reads and writes of each activation per block, forward and backward, unfused
POWER_EXPONENT = 0.927  # throughput under a power limit P: (P / TDP) ** POWER_EXPONENT
CP_ROUND = 0.0751  # each further CP ring round's cost, as a share of the attention
# The frameworks' kernels and overlap, relative to Megatron-Core's; titanlite is planned as
# TorchTitan, whose kernels (torch.compile, SDPA) and FSDP2 it shares.
SOFTWARE = {"megatron": 1, "torchtitan": 0.838, "llm-foundry": 0.885, "meta": 0.75}
# The share of compute time that prefetched data-parallel collectives (FSDP's, and the replicas'
# gradient exchange) hide behind, at most all of it.
DP_OVERLAP = 0.933
# The share of expert parallel's all-to-alls hidden where they run beside another microbatch's compute
# (Megatron's overlap_moe_expert_parallel_comm; not the first and last microbatches', nor behind host
# stalls), at most all of it.
EP_OVERLAP = 0.391
FITTED = ("SUSTAINED", "GEMM_HALF", "ATTENTION_RATE", "FLOAT8_HALF", "ELEMENTWISE_PASSES", "BLOCK_OVERHEAD", "CP_ROUND",
          "POWER_EXPONENT", "SOFTWARE", "DP_OVERLAP", "MOE_BLOCK_OVERHEAD", "EP_OVERLAP")
MOE_FITTED = ("MOE_BLOCK_OVERHEAD", "EP_OVERLAP")  # read by MoE blocks only: fitted on the MoE runs (fit.py)
UPPER_BOUNDS = {"SUSTAINED": 1.0, "DP_OVERLAP": 1.0, "EP_OVERLAP": 1.0}  # shares: the fit keeps them at most 1
# Not fitted: Megatron is SOFTWARE's reference; Meta's stack (the Llama 3 paper's runs) is stated to pay
# 1 ms per block and microbatch, about TorchTitan's (PyTorch eager): its runs, all with the same tokens
# per microbatch, cannot tell that cost from SOFTWARE's.
UNFITTED = {("SOFTWARE", "megatron"), ("BLOCK_OVERHEAD", "meta")}
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
# Stated (datasheets): the fp32 peak without tensor cores, as a share of the bf16 peak, per GPU type
# (others: H100's). titanlite's document ring multiplies fp32 scores at it (torch's default matmul
# precision: no TF32).
FP32_SHARE = {"A100": 19.5 / 312, "H100": 67 / 989, "B200": 75 / 2250, "GB200": 80 / 2500}
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
    # Published runs' dispatchers and CP, which titanlite does not have: a token sent once per node it
    # needs (DeepEP, HybridEP), all-to-alls beside another microbatch's compute (Megatron), Llama 3's
    # all-gather CP (keys and values gathered before the attention, no ring).
    ep_dedup: bool = False
    ep_overlap: bool = False
    cp_allgather: bool = False
    accumulation: int = 1  # pipeline schedules a step (gradient accumulation), each draining the pipeline
    muon: bool = False  # optimizer.name = "Muon": one fp32 buffer per hidden matrix (AdamW's two for the rest)
    last_stage_blocks: int = 0  # blocks on the last pipeline rank where a published layout fixes them (0: the best split)

    @property
    def gpus(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    def describe(self) -> str:
        parts = [f"{name} {v}" for name, v in [("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard), ("tp", self.tp),
                                               ("pp", self.pp), ("vp", self.vp), ("cp", self.cp), ("ep", self.ep)] if v > 1] or ["1 GPU"]
        flags = [name for name, on in (("float8", self.float8), ("TP overlap", self.tp_overlap), ("ZeRO-1", self.zero1),
                                       ("compile", self.compile), ("zero bubble", self.zero_bubble),
                                       ("SP regather", self.sp_regather), ("DeepEP", self.ep_dedup),
                                       ("EP overlap", self.ep_overlap), ("CP all-gather", self.cp_allgather)) if on]
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


def estimate(
    model: ModelArgs, seq_len: int, global_batch: int, gpu: GPU, layout: Layout, act_bytes: int = 2,
    overhead: float = GPU_OVERHEAD, power_watts: float | None = None, software: str = "torchtitan", values_padded: bool = True,
) -> Estimate:
    """`power_watts`: the GPUs' power limit where below their TDP; `software`: a SOFTWARE key;
    `values_padded`: MLA's values padded to the query/key head dim (titanlite's kernels; shapes.py)."""
    L = layout if gpu.fp8_flops or not layout.float8 else replace(layout, float8=False)  # no float8 matmuls: bf16
    dp = L.dp_replicate * L.dp_shard
    fsdp = L.dp_shard * L.cp
    local_batch = global_batch // dp
    microbatches = max(1, local_batch // L.microbatch)
    per_schedule = max(1, microbatches // L.accumulation)  # the microbatches of one pipeline schedule
    tokens = L.microbatch * seq_len / L.cp  # local tokens of one microbatch
    blocks = -(-model.n_layers // L.pp)
    params = stage_params(model, L.pp)
    # Routed experts are split over ep (whole, experts / ep per rank), their states over the ranks
    # outside it: the expert data parallel group, edp = the replicas x fsdp x tp / ep.
    expert_part = stage_expert_params(model, L.pp)
    dense = params - expert_part
    edp = L.dp_replicate * fsdp * L.tp // L.ep
    efsdp = max(1, fsdp * L.tp // L.ep)  # the ranks FSDP shards each routed expert over (ZeRO-1: none)
    # FSDP2 shards the experts along their first dim, ceil(local experts / efsdp) whole experts on the
    # first ranks; where the ranks outnumber the experts and divide dim 1, along it, evenly (parallel/fsdp.py).
    local_experts = model.num_experts // L.ep if expert_part else 1
    along_dim_1 = efsdp > local_experts and model.dim % efsdp == 0 and model.moe_hidden_dim % efsdp == 0 if expert_part else False
    # The share of its EP rank's experts a rank holds, at most.
    expert_shard = 1 / efsdp if along_dim_1 else -(-local_experts // efsdp) / local_experts
    est = Estimate(L, gpu, capacity=gpu.hbm_bytes, peak=gpu.bf16_flops)

    # Memory. ZeRO-1: bf16 weights and fp32 gradients whole, the fp32 master weights and Adam's
    # moments sharded over the replicas (and cp, which Megatron's optimizer shards over too); the
    # routed experts' whole on their EP rank, sharded over edp.
    # Muon: 4 B of momentum for each hidden matrix's parameter where AdamW keeps 8 B of moments; the
    # embedding and output (AdamW's beside it) keep theirs.
    optimizer_dense, optimizer_experts = 8.0, 8.0
    if L.muon:
        adamw_share = min(1.0, model.vocab_size * model.dim * (2 if L.pp == 1 and not model.tie_embeddings else 1) / dense)
        optimizer_dense, optimizer_experts = 4 + 4 * adamw_share, 4.0
    if L.zero1:
        est.memory["states"] = ((6 + (4 + optimizer_dense) / (L.dp_replicate * fsdp)) * dense / L.tp
                                + (6 + (4 + optimizer_experts) / edp) * expert_part / L.ep)
    else:
        est.memory["states"] = ((8 + optimizer_dense) * dense / (L.tp * fsdp)
                                + (8 + optimizer_experts) * expert_part / L.ep * expert_shard)
    # The blocks FSDP holds gathered: a pipeline stage keeps all its blocks, otherwise two at a time.
    gathered_dense, gathered_experts = block_weights(model, heaviest_layers(model, blocks if L.pp > 1 else 2))
    sharded = fsdp > 1 and not L.zero1  # ZeRO-1 keeps the weights whole: nothing to gather
    # EP ranks gather their own experts (whole) over efsdp; where FSDP does not shard them (efsdp 1)
    # their gradient is the one the states count, and only the compute-dtype copy is extra.
    gathered = gathered_dense / L.tp * (act_bytes + 4) + gathered_experts / L.ep * (act_bytes + (4 if efsdp > 1 else 0))
    est.memory["gathered"] = gathered if sharded else 0.0
    # Microbatches whose activations a stage holds at once: pp under 1F1B; under an interleaved
    # schedule the first rank's warm-up runs (vp - 1) pp + 2 (pp - 1) + 1 stage-forwards of
    # blocks / vp blocks each before its first backward (torch's Interleaved1F1B).
    warmup = (L.vp - 1) * L.pp + 2 * (L.pp - 1) + 1 if L.vp > 1 else L.pp
    in_flight = min(per_schedule * L.vp, warmup) / L.vp
    # The largest stage's blocks (all of them without PP), MoE and dense.
    stage_moe_blocks = moe_blocks_among(model, heaviest_layers(model, blocks))
    stage_blocks = sum(n * block_activation_elements(model, tokens, L, values_padded, moe) * act_bytes
                       for n, moe in ((stage_moe_blocks, True), (blocks - stage_moe_blocks, False)) if n)
    per_block = block_activation_elements(model, tokens, L, values_padded) * act_bytes  # a MoE block's, where blocks differ
    one_block = block_activation_elements(model, tokens, replace(L, ac="none"), values_padded) * act_bytes
    # Backward of a block holds gradients shaped like its activations (and, under full AC, the
    # recomputed activations themselves) next to everything still saved.
    working_set = one_block * (2 if L.ac == "full" else 1)
    # The logits, and each multi-token prediction depth's own logits and block (on the last stage,
    # which holds one microbatch at a time under 1F1B; counted on top of the busiest stage's).
    depth = mtp_depth(model)
    logits = tokens * model.vocab_size / L.tp * (act_bytes + 8 if act_bytes == 2 else 8) * (1 + depth)
    est.memory["activations"] = in_flight * stage_blocks + working_set + logits + depth * per_block
    est.memory["overhead"] = overhead

    # Compute: per token, the linears at the matmul rate (float8's faster by float8_speedup; the output
    # projections stay in bf16, as in TorchTitan and Transformer Engine; the routed experts too, but
    # Transformer Engine's grouped GEMMs (Megatron) run them in float8), each routed expert's GEMMs at
    # their own size, and causal attention (half the FLOPs counted: flops_per_token counts the full
    # square) at ATTENTION_RATE times the rate of its own GEMMs.
    est.tokens_per_gpu = global_batch * seq_len / (dp * L.tp * L.cp * L.pp)
    flops_per_token = counted_flops_per_token(model, seq_len)
    est.flops_per_gpu = flops_per_token * est.tokens_per_gpu
    shape = attention_shape(model, values_padded)

    def saturation(size: float) -> float:
        """The share of the sustained rate a GEMM reaches: its size is the harmonic sum of its three
        dimensions (its FLOPs per byte moved in bf16)."""
        return size / (size + GEMM_HALF)

    def harmonic(*dims: float) -> float:
        return 1 / sum(1 / d for d in dims)

    power = min(1.0, power_watts / gpu.tdp_watts) ** POWER_EXPONENT if power_watts else 1.0
    sustained = gpu.bf16_flops * SUSTAINED[gpu_family(gpu) or "H100"] * SOFTWARE[software] * power
    float8_gain = max(0.0, gpu.fp8_flops / gpu.bf16_flops - 1)  # no float8 matmuls: no gain

    def float8_speedup(size: float) -> float:
        return 1 + float8_gain * size / (size + FLOAT8_HALF) if L.float8 else 1.0

    # A linear's GEMM: the model width, the narrower tp shard of a weight, the m tokens of a microbatch.
    linear_gemm = harmonic(model.dim, min(model.dim, model.ffn_hidden_dim) / L.tp, tokens)
    rate = sustained * saturation(linear_gemm)
    est.matmul_efficiency = rate / gpu.bf16_flops
    counted_attention = attention_flops(model, seq_len)
    linear_flops = flops_per_token - counted_attention
    routed = routed_flops(model)
    output_flops = 6 * model.vocab_size * model.dim * (1 + depth)
    dense_flops = linear_flops - routed
    float8_flops = dense_flops - output_flops if L.float8 else 0.0
    # MLA's down projections run whole on every tp rank: tp - 1 more copies of them per GPU.
    replicated = 6 * latent_down_params(model) * (model.n_layers + depth) * (L.tp - 1)
    time_per_token = (float8_flops / float8_speedup(linear_gemm) + dense_flops - float8_flops + replicated) / rate
    if routed:
        # Each local expert multiplies the copies routed to it: tokens / tp per tp rank, top_k copies
        # each, spread over the experts, ep of whose shares this rank holds.
        expert_gemm = harmonic(model.dim, model.moe_hidden_dim, tokens / L.tp * model.top_k * L.ep / model.num_experts)
        expert_speedup = float8_speedup(expert_gemm) if software == "megatron" else 1.0
        time_per_token += routed / (expert_speedup * sustained * saturation(expert_gemm))
    # Attention's GEMMs: QK^T (queries x qk head dim x keys), then the weights times V (the kernel's
    # value head dim), block by block over the keys its queries see (Llama 4's RoPE blocks: a chunk;
    # its FLOPs as attention_flops_per_token counts them, the kernel skipping what the causal mask
    # or the chunk hides). Context parallel's ring computes them in pieces of seq / (2 cp) queries
    # (head-tail) against one KV shard a round, each of its cp - 1 further rounds (another KV shard,
    # its merge into the output and log-sum-exp, forward and backward) costing CP_ROUND of the
    # attention more; the all-gather CP (Llama 3's) runs the local queries against all keys at once.
    # Masked attention under CP is titanlite's document ring: every query against every KV shard,
    # all scores computed (nothing skipped, however short the chunk), as fp32 matmuls: forward's two
    # products and backward's five (it recomputes the scores), at the fp32 peak (a bound: the fp32
    # score tiles' elementwise passes come on top).
    queries = seq_len / (2 * L.cp) if L.cp > 1 else seq_len
    rounds = 1.0 if L.cp_allgather else 1 + CP_ROUND * (L.cp - 1)
    kernel_attention = padded_attention_flops(model, seq_len, shape)
    qk, v = shape.qk_head_dim, shape.v_head_dim
    spans = attention_spans(model, seq_len)
    key_blocks = sum(keys * span_blocks for keys, _, span_blocks in spans)
    attention_per_token = 0.0
    for keys, masked, span_blocks in spans:
        span_flops = kernel_attention * keys * span_blocks / key_blocks
        if masked and L.cp > 1:
            ring_flops = span_flops * seq_len / keys * (4 * qk + 3 * v) / (3 * (qk + v))
            attention_per_token += ring_flops / (gpu.bf16_flops * FP32_SHARE[gpu_family(gpu) or "H100"] * power)
            continue
        seen = min(keys, seq_len if L.cp_allgather else queries)  # keys a round's GEMM sees
        attention_per_token += sum(
            0.5 * span_flops * head_dim / (qk + v)
            / (ATTENTION_RATE * sustained * saturation(harmonic(min(queries, keys), head_dim, seen)) / rounds)
            for head_dim in (qk, v)
        )
    compute = est.tokens_per_gpu * (time_per_token + attention_per_token)
    # Recomputed in backward: under full AC one more forward (1/3 of forward + backward); titanlite's
    # op policy keeps every matmul (norms and elementwise ops rerun); TorchTitan's ("op_half")
    # recomputes every second matmul, half the linears' forward.
    linear_share = linear_flops / flops_per_token
    recompute_share = {"none": 0.0, "op": 0.03, "op_half": linear_share / 6, "full": 1 / 3}[L.ac]
    # Memory-bound work at HBM bandwidth: the activations a block makes per token, each read and
    # written `passes` times.
    passes = FUSED_PASSES if L.compile or software == "megatron" else ELEMENTWISE_PASSES
    elements = elementwise_elements(model, L, values_padded)
    elementwise = microbatches * tokens * blocks * elements * act_bytes * passes / gpu.hbm_bandwidth
    # The stage's MoE blocks (multi-token prediction's among them) at the model's share: an average
    # stage's mix, not the busiest one's.
    moe_blocks = blocks * moe_share(model)
    host = microbatches * (blocks * BLOCK_OVERHEAD[software] + moe_blocks * (MOE_BLOCK_OVERHEAD[software] if moe_blocks else 0.0))
    est.time["compute"] = (compute + elementwise) * (1 + recompute_share) + host
    if L.pp > 1:
        # The last stage also runs the output projection (and multi-token prediction's modules, each
        # with another pass through the output head), so the pipeline moves at the pace of its
        # busiest rank. Splits give the last rank fewer blocks for it (Megatron's
        # account_for_loss_in_pipeline_split and pipeline layouts, TorchTitan's uneven splits): the
        # best such split.
        tail = tail_flops(model, seq_len)
        output = tail / ((flops_per_token - tail) / model.n_layers)  # in blocks
        splits = [L.last_stage_blocks] if L.last_stage_blocks else range(blocks + 1)
        busiest = min(max(-(-(model.n_layers - k) // (L.pp - 1)), k + output) for k in splits)
        est.time["compute"] *= busiest / ((model.n_layers + output) / L.pp)

    def link(group_span: int) -> float:
        """Per-GPU bandwidth of a collective whose group spans `group_span` consecutive ranks."""
        return gpu.nvlink_bandwidth if group_span <= gpu.nvlink_domain else gpu.network_bandwidth

    # FSDP: without PP, every microbatch all-gathers for forward and again for backward and
    # reduce-scatters fp32 gradients; a pipeline stage keeps its weights gathered across a schedule's
    # microbatches (gather once, reduce once a schedule), paid for in memory above.
    data_parallel = 0.0  # seconds of data-parallel collectives (FSDP's, then the replicas')
    if sharded:
        # Dense weights are gathered over fsdp; routed experts (whole, experts / ep per rank) over efsdp.
        # Float8 all-gathers move the dense linears' weights in 1 byte; the routed experts stay in high precision.
        # Each rank sends its (padded) shard to the group's other ranks.
        for weights, group, shard, float8_gather in ((dense / L.tp, fsdp, 1 / fsdp, L.float8),
                                                     (expert_part / L.ep, efsdp, expert_shard, False)):
            if group > 1 and weights:
                shard_bytes = weights * (1 if float8_gather else act_bytes)
                if L.pp > 1:
                    per_step = L.accumulation * (shard_bytes + weights * 4)
                else:
                    per_step = microbatches * (2 * shard_bytes + weights * 4)
                data_parallel += per_step * (group - 1) * shard / link(L.tp * fsdp)
    # HSDP / DDP replicas: one all-reduce of the (sharded) fp32 gradients; ZeRO-1: a reduce-scatter of
    # the whole fp32 gradients and an all-gather of the bf16 weights over the replicas x cp
    # (Megatron's overlap_grad_reduce and overlap_param_gather overlap both).
    if L.dp_replicate > 1:
        per_param = 4 + act_bytes if L.zero1 else 2 * 4
        if L.zero1:  # the routed experts' over the expert data parallel group
            group = L.dp_replicate * L.cp
            data_parallel += per_param * dense / L.tp * (group - 1) / group / link(L.gpus)
            if expert_part:
                data_parallel += per_param * expert_part / L.ep * (edp - 1) / edp / link(L.gpus)
        else:
            group = L.dp_replicate
            data_parallel += per_param * params / (L.tp * fsdp) * (group - 1) / group / link(L.gpus)
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
        bubble = (L.pp - 1) / (L.vp * per_schedule) * (ZERO_BUBBLE_SHARE if L.zero_bubble else 1.0)
        est.time["pp bubble"] = est.time["compute"] * bubble
    # Every block's keys and values go round, a chunked block's too: no ring (torch's, or titanlite's
    # document ring) skips a KV shard that the mask hides.
    if L.cp > 1:
        est.time["cp exposed"] = context_parallel_exposed(L, microbatches * blocks * tokens * (shape.k_width + shape.v_width) / L.tp
                                                          * act_bytes, link(L.tp * L.cp), est.tokens_per_gpu * attention_per_token)
    if moe_blocks and L.ep > 1:
        routed_tokens = microbatches * moe_blocks * tokens / L.tp
        est.time["ep all-to-all"] = expert_parallel_time(model, L, gpu, routed_tokens * model.dim * act_bytes, est.time["compute"])
    return est


def context_parallel_exposed(L: Layout, kv_bytes: float, bandwidth: float, attention_time: float) -> float:
    """Seconds of context parallel's exchange that no attention hides, for `kv_bytes` of one rank's
    keys and values per step. The ring passes each rank's keys and values on for cp - 1 rounds in
    forward, and again with their gradients in backward (3 passes), each round's exchange hidden
    behind that round's attention; across nodes it runs at network speed. Llama 3's all-gather CP
    gathers the other ranks' keys and values before the attention and reduce-scatters their
    gradients after it, on the critical path (the paper: "exposed"), keeping the gathered ones for
    backward (gathered again under full AC)."""
    if L.cp_allgather:
        return (3 if L.ac == "full" else 2) * kv_bytes * (L.cp - 1) / bandwidth
    return max(0.0, 3 * kv_bytes * (L.cp - 1) / bandwidth - attention_time)


def expert_parallel_time(model: MoEArgs, L: Layout, gpu: GPU, routed_bytes: float, compute: float) -> float:
    """Seconds of expert parallel's all-to-alls a step: every MoE layer sends top_k copies of each
    routed token (`routed_bytes` of them a step: the tp ranks route their own sequence shards) out
    and back, in forward and again in backward (and once more in full AC's recompute). Inside an NVLink domain at NVLink speed; over ep
    ranks spanning nodes, the copies bound for other nodes at network speed (the NVLink hops of the
    rest run alongside): each copy on its own under a plain all-to-all (titanlite's), or one per
    token and node with a deduplicating dispatcher (DeepEP, HybridEP; `ep_dedup`), at most
    topk_group nodes under group-limited routing. With `ep_overlap` (Megatron's
    overlap_moe_expert_parallel_comm) they run beside another microbatch's compute, EP_OVERLAP of
    which they can hide behind."""
    passes = 6 if L.ac == "full" else 4
    domain = min(L.ep, gpu.nvlink_domain)
    nodes = -(-L.ep // gpu.nvlink_domain)
    nvlink = passes * routed_bytes * model.top_k * (domain - 1) / L.ep / gpu.nvlink_bandwidth
    if nodes > 1:
        remote = remote_nodes_per_token(model, L.ep, gpu.nvlink_domain) if L.ep_dedup else model.top_k * (nodes - 1) / nodes
        hops = model.top_k * (domain - 1) / domain if L.ep_dedup else model.top_k * (domain - 1) / L.ep
        nvlink = passes * routed_bytes * hops / gpu.nvlink_bandwidth
        seconds = max(passes * routed_bytes * remote / gpu.network_bandwidth, nvlink)
    else:
        seconds = nvlink
    return max(seconds * (1 - EP_OVERLAP), seconds - compute) if L.ep_overlap else seconds


def gpu_family(gpu: GPU) -> str | None:
    """The SUSTAINED key of a GPU (H100 96GB, H200 -> H100); None for a type no published run measured."""
    if gpu.name in SUSTAINED:
        return gpu.name
    return next((family for name, family in SAME_DIE.items() if gpu.name.startswith(name)), None)
