"""The mixture-of-experts feed-forward: a token-choice top-k mixture of SwiGLU experts, which
replaces the dense SwiGLU in a family's MoE blocks (models/moe/, the MoE family).

A MoE layer routes each token to `top_k` of `num_experts` routed experts (softmax or sigmoid scores;
optionally renormalized and scaled), runs every expert on its tokens (one grouped weight per
projection, so experts shard as tensors; `torch._grouped_mm`, or an exact loop over experts), sums
the weighted outputs per token and adds the shared experts, which every token visits.

Load balancing (DeepSeek-V3): an expert bias, added to the scores only when choosing experts, moves
after each optimizer step towards balance (`update_expert_bias`, from the token counts of all data
ranks), and an optional sequence-wise auxiliary loss. Both depend only on global counts, so they are
the same under any layout. No parallel code lives here: expert parallel (parallel/expert.py) wraps
`experts` with the all-to-all dispatch, and parallelize sets `reduce_sequence_counts` where a
sequence is split over ranks (parallel/context.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from titanlite.models.common.feed_forward import FeedForward
from titanlite.models.common.args import MoEArgs
from titanlite.models.common.forward_stats import add_outside_recompute


def local_shard(weight: torch.Tensor) -> torch.Tensor:
    """Experts sharded over expert-parallel ranks are DTensors: each rank computes with its own."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


class Router(nn.Module):
    """Token-choice top-k: scores over the experts; the bias only shifts which experts are chosen."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.gate = nn.Linear(args.dim, args.num_experts, bias=args.router_bias)
        self.top_k, self.score_func = args.top_k, args.score_func
        self.route_norm, self.route_scale = args.route_norm, args.route_scale
        self.n_group, self.topk_group = args.n_group, args.topk_group

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (tokens, dim) -> (weights (tokens, k), chosen experts (tokens, k), scores (tokens, experts)), in fp32.
        The gate runs in fp32 whatever the activations' dtype: bf16 logits change some tokens' top-k."""
        bias = None if self.gate.bias is None else self.gate.bias.float()
        logits = F.linear(x.float(), self.gate.weight.float(), bias)
        scores = logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()
        chosen = self.within_best_groups(scores + expert_bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if self.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, chosen, scores

    def within_best_groups(self, choice_scores: torch.Tensor) -> torch.Tensor:
        """Group-limited routing: each group of experts scores the sum of its two best experts' choice
        scores; experts outside a token's `topk_group` best groups get -inf (cannot be chosen)."""
        if self.n_group <= 1:
            return choice_scores
        tokens, experts = choice_scores.shape
        grouped = choice_scores.view(tokens, self.n_group, experts // self.n_group)
        best_groups = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(self.topk_group, dim=-1).indices
        outside = torch.ones(tokens, self.n_group, dtype=torch.bool, device=choice_scores.device).scatter_(1, best_groups, False)
        return grouped.masked_fill(outside.unsqueeze(-1), float("-inf")).view(tokens, experts)


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts as one (experts, out, in) weight per projection (each expert's an
    nn.Linear weight, as Hugging Face stores them). Takes the tokens grouped by expert and each
    expert's count; returns their outputs in the same order.

    `kernel` ("grouped": `torch._grouped_mm`; "loop": one matmul chain per expert, exact) and
    `compute_dtype` (None: the activations') are set for the device by `choose_expert_kernel`."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool):
        super().__init__()
        self.num_experts = num_experts
        self.kernel, self.compute_dtype = ("grouped" if use_grouped_mm else "loop"), None
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    def weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """w1, w2, w3 as (experts, in, out) views in `dtype`, column-major: the layout CUDA's grouped
        GEMMs take their second operand in."""
        return tuple(local_shard(w).to(dtype).transpose(-2, -1) for w in (self.w1, self.w2, self.w3))

    def forward(self, x: torch.Tensor, counts: torch.Tensor, meanwhile: Once | None = None) -> torch.Tensor:
        """`meanwhile`: the layer's work that needs none of the routed tokens (the shared experts), which
        expert parallel runs while the tokens travel (parallel/expert.py); the layer runs it after."""
        dtype = self.compute_dtype or x.dtype
        w1, w2, w3 = self.weights(dtype)
        return swiglu_experts(x.to(dtype), counts, w1, w2, w3, self.kernel).to(x.dtype)


def choose_expert_kernel(use_grouped_mm: bool, device_type: str, capability: tuple[int, int] | None) -> tuple[str, torch.dtype | None, str]:
    """(kernel, compute dtype or None for the activations', why) for the routed experts on a device.
    CUDA's fast grouped GEMM takes bf16 on SM90 and later (TorchTitan runs its experts in bf16 too);
    elsewhere on CUDA torch's fallback loops over groups and reads their offsets on the host, so the
    exact loop over experts runs instead. CPU's grouped GEMM takes any dtype."""
    if not use_grouped_mm:
        return "loop", None, "model.moe_grouped_mm=false: the routed experts run as a loop over experts"
    if device_type != "cuda":
        return "grouped", None, f"the routed experts run torch._grouped_mm on {device_type} in the activations' dtype"
    if capability is not None and capability >= (9, 0):
        return "grouped", torch.bfloat16, "the routed experts run torch._grouped_mm in bfloat16"
    return "loop", None, (
        f"torch._grouped_mm's fast kernel needs SM90 or later (this GPU: sm_{''.join(map(str, capability or ()))}): "
        "the routed experts run as an exact loop over experts"
    )


def configure_experts(modules: list[GroupedExperts], use_grouped_mm: bool, device: torch.device) -> str:
    """Sets each expert module's kernel for the device; returns the line for the log."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    kernel, dtype, why = choose_expert_kernel(use_grouped_mm, device.type, capability)
    for module in modules:
        module.kernel, module.compute_dtype = kernel, dtype
    return why


def expert_groups(counts: torch.Tensor, kernel: str) -> list[int] | torch.Tensor:
    """How `per_expert` finds each expert's rows: their counts on the host (the loop), or the groups'
    cumulative ends (`torch._grouped_mm`'s offsets)."""
    return counts.tolist() if kernel == "loop" else torch.cumsum(counts, 0, dtype=torch.int32)


def swiglu_experts(x, counts, w1, w2, w3, kernel: str = "grouped") -> torch.Tensor:
    """Each expert's SwiGLU on its rows of x (grouped by expert); weights (experts, in, out)."""
    groups = expert_groups(counts, kernel)
    return per_expert(F.silu(per_expert(x, groups, w1)) * per_expert(x, groups, w3), groups, w2)


def per_expert(x: torch.Tensor, groups: list[int] | torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x's rows (grouped by expert) times their expert's matrix, w (experts, in, out): one matmul per
    expert (the exact reference), or one grouped GEMM. bf16 and fp32 grouped GEMMs take groups of
    any size: no padding (float8 ones would want each group's rows aligned to 16)."""
    if isinstance(groups, list):
        outputs = [rows @ w[e] for e, rows in enumerate(x.split(groups))]
        return torch.cat(outputs) if outputs else x.new_zeros(0, w.shape[-1])
    return grouped_mm(x, w, groups)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """`torch._grouped_mm(a, b, offs=ends)`, which torch.compile traces in any dtype: torch's own
    shape function takes bf16 only, so other dtypes (fp32 on CPU) go through `any_dtype_grouped_mm`."""
    if a.dtype == torch.bfloat16:
        return torch._grouped_mm(a, b, offs=ends)
    return any_dtype_grouped_mm(a, b, ends)


@torch.library.custom_op("titanlite::grouped_mm", mutates_args=())
def any_dtype_grouped_mm(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """a (rows, K) @ b[e] (K, N) per group of rows; or, with b (rows, N), a^T (K, rows) @ b per group of
    a's columns and b's rows, giving (groups, K, N)."""
    return torch._grouped_mm(a if b.dim() == 3 else a.t(), b, offs=ends)


@any_dtype_grouped_mm.register_fake
def _(a, b, ends):
    return a.new_empty(a.shape[0], b.shape[-1]) if b.dim() == 3 else a.new_empty(ends.shape[0], a.shape[1], b.shape[1])


def _grouped_mm_backward(ctx, grad):
    a, b, ends = ctx.saved_tensors
    grad_a = any_dtype_grouped_mm(grad, b.transpose(-2, -1), ends) if ctx.needs_input_grad[0] else None
    grad_b = any_dtype_grouped_mm(a, grad, ends) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None


def _save_operands(ctx, inputs, output):
    if inputs[1].dim() != 3:
        raise NotImplementedError("titanlite::grouped_mm differentiates the (rows, K) @ (groups, K, N) form only")
    ctx.save_for_backward(*inputs)


any_dtype_grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_save_operands)


class _AttachAuxLoss(torch.autograd.Function):
    """Passes the output through and gives the auxiliary loss the gradient 1 in backward, so the loss
    trains the router wherever the layer sits (any pipeline stage) without reaching the loss function."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape = aux_loss.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.new_ones(ctx.aux_shape, dtype=torch.float32)


class Once:
    """module(*args), run by its first caller; later calls get the same result."""

    def __init__(self, module: nn.Module, *args):
        self.module, self.args, self.result = module, args, None

    def __call__(self) -> torch.Tensor:
        if self.result is None:
            self.result = self.module(*self.args)
        return self.result


class MoE(nn.Module):
    def __init__(self, args: MoEArgs, routed_experts: nn.Module | None = None):
        """`routed_experts`: a GroupedExperts of another kind (gpt-oss's); default SwiGLU experts."""
        super().__init__()
        self.num_experts, self.top_k = args.num_experts, args.top_k
        self.load_balance_coeff, self.aux_loss_coeff, self.aux_loss_type = args.load_balance_coeff, args.aux_loss_coeff, args.aux_loss_type
        self.moe_layer_count = args.moe_layer_count  # the global-batch loss is a mean over the model's MoE layers
        self.score_before_experts = args.score_before_experts
        self.router = Router(args)
        self.experts = routed_experts or GroupedExperts(args.dim, args.moe_hidden_dim, args.num_experts, args.use_grouped_mm)
        shared = args.num_shared_experts * args.moe_hidden_dim
        self.shared_experts = FeedForward(args.dim, shared) if shared else None
        # Persistent: the bias is training state that a checkpoint keeps. The counts of the current step are not.
        self.register_buffer("expert_bias", torch.zeros(args.num_experts))
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)
        self.register_buffer("aux_loss_sum", torch.zeros(()), persistent=False)
        # Set by the trainer: the aux loss is a mean over the step's sequences (or forwards, for the
        # global-batch loss), and `sequence_len` is the full sequence length (a rank may hold a shard of it).
        self.aux_loss_scale, self.sequence_len = 1.0, 0
        # parallelize sets these: sums of expert counts over the ranks that hold parts of the same
        # sequences (context / sequence parallel), and over all ranks that route this forward's tokens.
        self.reduce_sequence_counts = self.reduce_batch_counts = None

    def reset_state(self) -> None:
        """Zero state in fp32 whatever the parameters' dtype (training.dtype = bfloat16 casts the whole
        model): bf16 counts are not exact above 256 and a 1e-3 bias step vanishes next to 1."""
        for name in ("expert_bias", "tokens_per_expert", "aux_loss_sum"):
            setattr(self, name, torch.zeros_like(getattr(self, name), dtype=torch.float32))

    def traces_whole(self) -> bool:
        """Whether torch.compile can take the layer as one graph. Not where its routed experts are
        split over ranks (expert parallel's split sizes are read to the host) or run as the loop (it
        reads each expert's count), nor where its aux loss sums counts over ranks (an exchange that
        activation checkpointing's recompute takes back from a record)."""
        split = any(hasattr(p, "to_local") for p in self.experts.parameters())
        summed = self.reduce_sequence_counts if self.aux_loss_type == "sequence" else self.reduce_batch_counts
        return not split and self.experts.kernel != "loop" and not (self.aux_loss_coeff and summed is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, dim = x.shape
        flat = x.reshape(-1, dim)
        weights, chosen, scores = self.router(flat, self.expert_bias)
        # scatter_add, not bincount: bincount reads its input's max on the host (a sync on CUDA).
        choices = chosen.flatten()
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device).scatter_add_(0, choices, torch.ones_like(choices))
        if self.training:
            add_outside_recompute(self.tokens_per_expert, counts.to(self.tokens_per_expert.dtype))
        # Token copies sorted by expert (stable: a token's copies keep their order), through the experts, back.
        order = choices.argsort(stable=True)
        copies = flat[order // self.top_k]
        if self.score_before_experts:
            copies = (copies.float() * weights.flatten()[order].unsqueeze(-1)).to(flat.dtype)
        shared = Once(self.shared_experts, flat) if self.shared_experts is not None else None
        routed = self.experts(copies, counts, shared)
        # Back in token order (a permutation: each row written once), then each token's k outputs weighted
        # in fp32 and summed in a fixed order: no scatter-add, whose atomics on CUDA sum in any order.
        by_token = torch.empty_like(routed).index_copy_(0, order, routed).view(-1, self.top_k, dim).float()
        if not self.score_before_experts:
            by_token = by_token * weights.unsqueeze(-1)
        out = by_token.sum(dim=1).to(flat.dtype)
        if shared is not None:
            out = out + shared()
        if self.aux_loss_coeff and self.training:
            if self.aux_loss_type == "global_batch":
                aux = self.global_batch_aux_loss(scores, counts)
            else:
                aux = self.sequence_aux_loss(scores, chosen, bsz, seqlen)
            add_outside_recompute(self.aux_loss_sum, aux.detach())
            out = _AttachAuxLoss.apply(out, aux)
        return out.view(bsz, seqlen, dim)

    def sequence_aux_loss(self, scores: torch.Tensor, chosen: torch.Tensor, bsz: int, seqlen: int) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance loss, aux_loss_coeff * sum_i f_i P_i per sequence: f_i is
        expert i's share of the sequence's choices (times experts / k), P_i its mean normalized score.
        Where a sequence is split over ranks, counts are summed over them and each rank adds its
        tokens' scores; the result is this rank's share of the mean over the step's sequences."""
        seq_len = self.sequence_len or seqlen
        counts = torch.zeros(bsz, self.num_experts, device=scores.device)
        counts.scatter_add_(1, chosen.view(bsz, -1), torch.ones_like(chosen, dtype=counts.dtype).view(bsz, -1))
        if self.reduce_sequence_counts is not None:
            counts = self.reduce_sequence_counts(counts)
        share = counts * self.num_experts / (self.top_k * seq_len)
        normalized = (scores / scores.sum(dim=-1, keepdim=True)).view(bsz, seqlen, -1)
        return self.aux_loss_coeff * (share * normalized.sum(dim=1) / seq_len).sum() * self.aux_loss_scale

    def global_batch_aux_loss(self, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Qwen's global-batch balance loss, as transformers' load_balancing_loss_func for one layer:
        aux_loss_coeff * E * sum_i f_i P_i over this forward's tokens on every routing rank, f_i the
        share of tokens choosing expert i (a token's k choices each count), P_i its mean normalized
        score; a mean over the model's MoE layers and the step's forwards. The counts are summed over
        the ranks; each rank adds its own tokens' scores, so the ranks' parts sum to the loss."""
        counts = counts.float()
        if self.reduce_batch_counts is not None:
            counts = self.reduce_batch_counts(counts)
        tokens = counts.sum() / self.top_k
        score_sums = (scores / scores.sum(dim=-1, keepdim=True)).sum(dim=0)
        scale = self.aux_loss_coeff * self.num_experts * self.aux_loss_scale / self.moe_layer_count
        return scale * (counts * score_sums).sum() / tokens**2


# ---- load balancing (called by the trainer around the optimizer step) ----


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def experts(model: nn.Module) -> list[nn.Module]:
    """The routed experts: expert parallel shards them over experts, FSDP over the ranks outside EP."""
    return [m.experts for m in moe_layers(model)]


def set_batch(layers: list[MoE], sequences_per_step: int, seq_len: int, forwards_per_step: int) -> None:
    """The sequence-wise aux loss of each step is the mean over its `sequences_per_step` sequences
    (all ranks, all microbatches) of `seq_len` tokens; the global-batch one the mean over its
    `forwards_per_step` forwards (microbatches of accumulation and of the pipeline schedule)."""
    for layer in layers:
        per = sequences_per_step if layer.aux_loss_type == "sequence" else forwards_per_step
        layer.aux_loss_scale, layer.sequence_len = 1.0 / per, seq_len


@torch.no_grad()
def global_balance(layers: list[MoE], group) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens per expert (layers, experts), aux loss) of the step, summed over the data ranks in
    `group`, which route different tokens. One all-reduce."""
    if not layers:
        return torch.zeros(0, 0), torch.zeros(())
    # float64: global counts stay exact past 2**24.
    flat = torch.cat([torch.stack([layer.tokens_per_expert for layer in layers]).flatten(),
                      torch.stack([layer.aux_loss_sum for layer in layers])]).double()
    if group is not None:
        dist.all_reduce(flat, group=group)
    n = len(layers) * layers[0].num_experts
    return flat[:n].view(len(layers), -1), flat[n:].sum()


@torch.no_grad()
def update_expert_bias(layers: list[MoE], counts: torch.Tensor) -> None:
    """Auxiliary-loss-free balancing: each expert's bias moves by load_balance_coeff towards the mean
    load (up if under-used, down if over-used), centered so the biases keep a zero mean; the step's
    counts start again from zero."""
    for layer, layer_counts in zip(layers, counts):
        if layer.load_balance_coeff:
            delta = layer.load_balance_coeff * torch.sign(layer_counts.mean() - layer_counts)
            layer.expert_bias += (delta - delta.mean()).float()
    clear_counts(layers)


def clear_counts(layers: list[MoE]) -> None:
    """The step's counts and aux loss start again from zero."""
    for layer in layers:
        layer.tokens_per_expert.zero_()
        layer.aux_loss_sum.zero_()
