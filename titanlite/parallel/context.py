"""Context parallel: the sequence split over the cp mesh dim, with exact ring attention.

Each step runs inside torch's `context_parallel()`: it shards the inputs, the labels and the
model's per-token inputs (positions, document ids) along the sequence (head-tail load balancing:
with cp ranks the sequence is cut into 2*cp chunks and rank r holds chunks r and 2cp-1-r, so the
causal work is even).

Causal attention: torch routes SDPA to its ring over the cp group, whose KV shards rotate by
all-gather or all-to-all. torch (2.11 to 2.15) registers ring handlers only for the CUDA SDPA
kernels; on CPU, `register_cpu_ring_attention` sends the CPU flash-attention kernel (forward and
backward) through the same ring (torch's `_templated_ring_attention`). These are private torch
APIs (looked up where 2.11-2.15 keep them); the parity tests pin their behaviour.

Document-masked (block_causal) attention: torch's ring takes no mask, so `apply_cp` swaps each
block's core attention (models/common/attention.py's CoreAttention, which every family's attention calls)
for `RingAttention`, which runs titanlite's document ring (parallel/document_ring.py). Sliding-window
layers (gpt-oss) fetch only the keys their window reaches (parallel/window_halo.py); attention sinks
rescale by the ring's log-sum-exp.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental import context_parallel

from titanlite.models.common.attention import CoreAttention, DocumentMask
from titanlite.models.common.sinks import rescaled_by_sinks
from titanlite.parallel.activation_checkpoint import ForwardReplay
from titanlite.parallel.document_ring import document_ring
from titanlite.parallel.window_halo import fits, window_attention

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


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, rotate_method: str, load_balance: bool = True) -> None:
    """Every core attention becomes a RingAttention over `cp_mesh` (no parameter changes)."""
    group = cp_mesh.get_group()
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is CoreAttention:
                setattr(module, name, RingAttention(group, rotate_method, load_balance))


class RingAttention(CoreAttention):
    """Causal: SDPA, which torch's context_parallel() turns into its ring. With a document mask:
    titanlite's document ring, its KV shards moving as the rotate method says, as torch's do; with a
    sliding window that chunks hold, only the keys it reaches. Sinks come with a mask (gpt-oss masks
    every layer)."""

    def __init__(self, group, rotate_method: str, load_balance: bool = True):
        super().__init__()
        self.group, self.rotate_method, self.load_balance = group, rotate_method, load_balance

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask | None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        if mask is None:
            return super().forward(q, k, v, None)
        if mask.window and sinks is not None and fits(q.shape[2], mask.window, self.group.size(), self.load_balance):
            return window_attention(q, k, v, mask, sinks, self.group, self.load_balance)
        out, lse, _ = document_ring(
            q, k, v, mask.document_ids, mask.positions, self.group.group_name, self.rotate_method, mask.window
        )
        return out if sinks is None else rescaled_by_sinks(out, lse, sinks)


def share_expert_counts(model: nn.Module, plan, sequence_mesh: DeviceMesh | None, routing_mesh: DeviceMesh | None) -> None:
    """Each cp rank (and under sequence parallel each tp rank, in a MoE layer) holds part of every
    sequence, and every routing rank part of each forward's tokens: the MoE layers' per-sequence
    expert counts (the sequence-wise aux loss) are summed over the first, the per-forward counts
    (the global-batch aux loss) over the second, before use."""
    for layer in plan.moe_layers(model):
        layer.forward_replay = ForwardReplay()  # one of the two runs a forward; recompute takes its sums back
        layer.reduce_sequence_counts = summed_over(sequence_mesh, layer.forward_replay) if sequence_mesh else None
        layer.reduce_batch_counts = summed_over(routing_mesh, layer.forward_replay) if routing_mesh else None


def summed_over(mesh: DeviceMesh, replay: ForwardReplay):
    group = mesh.get_group()

    def all_reduced(counts: torch.Tensor) -> torch.Tensor:
        counts = counts.clone()
        torch.distributed.all_reduce(counts, group=group)
        return counts

    def summed(counts: torch.Tensor) -> torch.Tensor:
        replay.begin()
        return replay(lambda: all_reduced(counts))

    return summed
