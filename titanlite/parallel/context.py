"""Context parallel: the sequence split over the cp mesh dim, with exact ring attention.

Each step runs inside torch's `context_parallel()`: it shards the inputs, the labels and the
model's per-token inputs (positions, document ids) along the sequence (head-tail load balancing:
with cp ranks the sequence is cut into 2*cp chunks and rank r holds chunks r and 2cp-1-r, so the
causal work is even).

Causal attention: torch routes SDPA to its ring over the cp group, whose KV shards rotate by
all-gather or all-to-all. torch (2.11 to 2.14) registers ring handlers only for the CUDA SDPA
kernels; on CPU, `register_cpu_ring_attention` sends the CPU flash-attention kernel (forward and
backward) through the same ring (torch's `_templated_ring_attention`). These are private torch
APIs (looked up where 2.11-2.14 keep them); the parity tests pin their behaviour.

Document-masked (block_causal) attention: torch's ring takes no mask, so `apply_cp` swaps each
block's core attention for `RingAttention`, whose own ring (`_DocumentRing`) carries each KV
shard's document ids and positions with it and applies the block mask of each (query shard, KV
shard) pair. Positions, not shard order, decide causality, so any load balancer stays exact.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental import context_parallel

from titanlite.models.attention import CoreAttention, DocumentMask

def _cp_implementation_module():
    """torch's CP implementation: moved from experimental._attention to experimental._context_parallel."""
    for name in ("torch.distributed.tensor.experimental._context_parallel._attention", "torch.distributed.tensor.experimental._attention"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "custom_ops") and hasattr(module, "_templated_ring_attention"):
            return module
    raise ImportError("this torch has no ring-attention implementation for context parallel")


_ring = _cp_implementation_module()
# torch 2.13 renamed these functional collectives (the old names warn); earlier releases have the old ones.
_all_gather = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)
_reduce_scatter = getattr(funcol, "reduce_scatter_single", funcol.reduce_scatter_tensor)
SEQ_DIM = 2  # of q, k, v laid out (batch, heads, seq, head_dim)


def _arg(args, kwargs, index: int, name: str, default):
    return args[index] if len(args) > index else kwargs.get(name, default)


def _cpu_ring_forward(op, args, kwargs):
    # aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p=0., is_causal=False, *, attn_mask, scale)
    mesh = args[0].device_mesh
    q, k, v = (t.to_local() for t in args[:3])
    out, lse = _ring._templated_ring_attention(
        mesh.get_group(),
        SEQ_DIM,
        op,
        query=q,
        key=k,
        value=v,
        is_causal=_arg(args, kwargs, 4, "is_causal", False),
        dropout_p=_arg(args, kwargs, 3, "dropout_p", 0.0),
        scale=kwargs.get("scale"),
    )[:2]
    return tuple(DTensor.from_local(t, mesh, [Shard(SEQ_DIM)], run_check=False) for t in (out, lse))


def _cpu_ring_backward(op, args, kwargs):
    # ..._for_cpu_backward(grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, *, attn_mask, scale)
    mesh = args[1].device_mesh
    grad_out, q, k, v, out, lse = (t.to_local() for t in args[:6])
    grads = _ring._templated_ring_attention_backward(
        mesh.get_group(),
        SEQ_DIM,
        op,
        grad_out=grad_out,
        grad_out_name="grad_out",
        query=q,
        key=k,
        value=v,
        out=out,
        logsumexp=lse,
        is_causal=_arg(args, kwargs, 7, "is_causal", False),
        dropout_p=_arg(args, kwargs, 6, "dropout_p", 0.0),
        scale=kwargs.get("scale"),
    )
    return tuple(DTensor.from_local(t, mesh, [Shard(SEQ_DIM)], run_check=False) for t in grads[:3])


def register_cpu_ring_attention() -> None:
    """Let CPU SDPA take part in ring attention (copied into DTensor's handlers on each CP entry)."""
    aten = torch.ops.aten
    _ring.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = _cpu_ring_forward
    _ring.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = _cpu_ring_backward


@contextmanager
def sequence_parallel_step(cp_mesh: DeviceMesh, tensors: list[torch.Tensor], load_balance: bool, rotate_method: str):
    """Yields this rank's sequence shards of `tensors` (batch, seq, ...); inside, causal attention
    runs as torch's ring over `cp_mesh`."""
    shards = [t.clone() for t in tensors]  # context_parallel resizes its buffers in place
    _ring._cp_options.enable_load_balance = load_balance
    _ring.set_rotate_method(rotate_method)
    with context_parallel(cp_mesh, buffers=shards, buffer_seq_dims=[1] * len(shards), no_restore_buffers=set(shards)):
        yield shards


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, rotate_method: str) -> None:
    """Every core attention becomes a RingAttention over `cp_mesh` (no parameter changes)."""
    group = cp_mesh.get_group()
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is CoreAttention:
                setattr(module, name, RingAttention(group, rotate_method))


class RingAttention(CoreAttention):
    """Causal: SDPA, which torch's context_parallel() turns into its ring. With a document mask: our
    ring, the KV shards moving by all-gather or around the ring (all-to-all), as for torch's."""

    def __init__(self, group, rotate_method: str):
        super().__init__()
        self.group, self.rotate_method = group, rotate_method

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask | None) -> torch.Tensor:
        if mask is None:
            return super().forward(q, k, v, None)
        return _DocumentRing.apply(q, k, v, mask.document_ids, mask.positions, self.group, self.rotate_method)


def _visits(local: list[torch.Tensor], group, rotate_method: str):
    """Yields, for j = 0 .. cp-1, the tensors of the shard of cp rank (rank - j) mod cp: all gathered
    at once (allgather), or each passed on to the next rank while this one computes (alltoall)."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if rotate_method == "allgather":
        gathered = [_all_gather(t, 0, group).chunk(n) for t in local]
        for j in range(n):
            yield [g[(rank - j) % n] for g in gathered]
        return
    for j in range(n):
        following = [pass_on(t, group) for t in local] if j < n - 1 else None
        yield local
        local = following


def pass_on(t: torch.Tensor, group) -> torch.Tensor:
    """Send `t` to the next cp rank; returns the previous rank's (permute_tensor takes 1-D tensors)."""
    n = dist.get_world_size(group)
    return funcol.permute_tensor(t.flatten(), [(i + 1) % n for i in range(n)], group).view(t.shape)


class _DocumentRing(torch.autograd.Function):
    """Exact attention of this rank's queries over every rank's keys, masked to the same document
    and not later. q (b, heads, s, d); k, v (b, kv_heads, s, d); document ids and positions (b, s)
    of the local tokens. Scores are computed per visiting KV shard in fp32 and merged by their
    log-sum-exp (flash attention's recurrence); backward recomputes them shard by shard, and each
    shard's key/value gradients travel back to the rank that holds it."""

    @staticmethod
    def forward(ctx, q, k, v, document_ids, positions, group, rotate_method):
        local = DocumentMask(document_ids, positions)
        q5 = _grouped_queries(q, k.shape[1])
        scale = q.shape[-1] ** -0.5
        out = lse = None
        # The own shard comes first, and each query sees at least itself there: lse is finite from then on.
        for kv, layout in _visits([torch.stack([k, v]), torch.stack([document_ids, positions])], group, rotate_method):
            allowed = local.allowed(layout[0], layout[1]).unsqueeze(1)  # (b, 1, 1, sq, sk)
            scores = _scores(q5, kv[0], allowed, scale)
            chunk_lse = torch.logsumexp(scores, dim=-1)
            chunk_out = torch.where(allowed, torch.exp(scores - chunk_lse[..., None]), 0.0) @ kv[1].float().unsqueeze(2)
            if out is None:
                out, lse = chunk_out, chunk_lse
                continue
            merged = torch.logaddexp(lse, chunk_lse)
            out = out * torch.exp(lse - merged)[..., None] + chunk_out * torch.exp(chunk_lse - merged)[..., None]
            lse = merged
        ctx.save_for_backward(q, k, v, document_ids, positions, out, lse)
        ctx.group, ctx.rotate_method = group, rotate_method
        return out.flatten(1, 2).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, document_ids, positions, out, lse = ctx.saved_tensors
        group, n = ctx.group, dist.get_world_size(ctx.group)
        local = DocumentMask(document_ids, positions)
        q5, grad5 = _grouped_queries(q, k.shape[1]), _grouped_queries(grad_out, k.shape[1])
        scale = q.shape[-1] ** -0.5
        row_dot = (grad5 * out).sum(-1, keepdim=True)  # softmax's backward term, per query row
        grad_q = torch.zeros_like(q5)
        by_shard = []  # allgather: each visiting shard's key/value gradients
        travelling = None  # alltoall: the gradients of the shard now here, summed over the ranks it visited
        visits = _visits([torch.stack([k, v]), torch.stack([document_ids, positions])], group, ctx.rotate_method)
        for j, (kv, layout) in enumerate(visits):
            allowed = local.allowed(layout[0], layout[1]).unsqueeze(1)
            kf, vf = kv[0].float().unsqueeze(2), kv[1].float().unsqueeze(2)
            probs = torch.where(allowed, torch.exp(_scores(q5, kv[0], allowed, scale) - lse[..., None]), 0.0)
            grad_scores = probs * (grad5 @ vf.transpose(-1, -2) - row_dot)
            grad_q += grad_scores @ kf * scale
            grad_kv = torch.stack([
                (grad_scores.transpose(-1, -2) @ q5).sum(2) * scale, (probs.transpose(-1, -2) @ grad5).sum(2)
            ])
            if ctx.rotate_method == "allgather":
                by_shard.append(grad_kv)
                continue
            travelling = grad_kv if travelling is None else pass_on(travelling, group) + grad_kv
        if ctx.rotate_method == "allgather":
            rank = dist.get_rank(group)
            ordered = torch.stack([by_shard[(rank - i) % n] for i in range(n)])  # by the rank holding each shard
            grad_kv = _reduce_scatter(ordered, "sum", 0, group)[0]
        else:
            grad_kv = pass_on(travelling, group) if n > 1 else travelling  # the last shard's sums go home
        return grad_q.flatten(1, 2).to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None, None, None


def _grouped_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(b, heads, s, d) -> fp32 (b, kv_heads, heads per kv head, s, d): query head i reads kv head
    i // (heads / kv_heads), as repeat_interleave would pair them."""
    b, heads, s, d = q.shape
    return q.float().view(b, kv_heads, heads // kv_heads, s, d)


def _scores(q5: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    scores = q5 @ k.float().unsqueeze(2).transpose(-1, -2) * scale  # (b, kv_heads, per kv head, sq, sk)
    return scores.masked_fill(~allowed, float("-inf"))


def share_sequence_counts(model: nn.Module, plan, sequence_mesh: DeviceMesh) -> None:
    """Each cp rank (and under sequence parallel each tp rank, in a MoE layer) holds part of every
    sequence: the MoE layers' per-sequence expert counts (the sequence-wise aux loss) are summed
    over them before use."""
    group = sequence_mesh.get_group()

    def summed(counts: torch.Tensor) -> torch.Tensor:
        counts = counts.clone()
        torch.distributed.all_reduce(counts, group=group)
        return counts

    for layer in plan.moe_layers(model):
        layer.reduce_sequence_counts = summed
