"""Attention's core, softmax(q k^T / sqrt(d)) v, causal over the window or within its documents.

The loader packs documents end to end, each starting with BOS. With `attn_mask_type =
"block_causal"` a token attends only to the earlier tokens of its own document: the trainer
derives each token's document id and position from the whole window (`document_layout`, before
any sequence split), the model turns them into a `DocumentMask` once per forward, and every block
applies it. The kernels:

  sdpa  torch's SDPA: `is_causal`, or a boolean mask built from the document ids (exact on every
        device; the CPU path the tests run)
  flex  FlexAttention (CUDA): the block mask built once per forward, the kernel compiled

Context parallel swaps each `CoreAttention` for a ring over the cp ranks (parallel/context.py).
`Attention` is the grouped-query self-attention block around it (q/k/v, optional q/k head norms, RoPE).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from titanlite.models.common.args import ModelArgs
from titanlite.models.common.forward_stats import in_backward, max_outside_recompute
from titanlite.models.common.linear import FusedLinear, plain_linears
from titanlite.models.common.rope import apply_rope
from titanlite.models.common.sinks import cpu_sink_attention, rescaled_by_sinks


def document_layout(
    tokens: torch.Tensor, bos_id: int, reset_positions: bool, eos_id: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(document ids, positions), each (batch, seq), of packed windows: a document starts at each BOS
    and after each EOS (Megatron's and OLMo's token files end documents with EOS and have no BOS; a
    window's first tokens may be the tail of an earlier one). Where BOS and EOS are one token E
    (GPT-2's and Qwen's <|endoftext|>), a document starts after an E that does not follow an E:
    the second of a pair (titanlite's text: E doc E, E doc E) or the token after a lone one
    (Megatron's and OLMo's files). Positions count from the window's start, or with
    `reset_positions` from each document's (its first token is at 0, as if alone)."""
    starts = tokens == bos_id
    if eos_id is not None:
        after_eos = torch.zeros_like(starts)
        after_eos[:, 1:] = tokens[:, :-1] == eos_id
        if eos_id == bos_id:
            starts = after_eos.clone()
            starts[:, 2:] &= tokens[:, :-2] != eos_id
        else:
            starts |= after_eos
    document_ids = starts.cumsum(dim=1)
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    if reset_positions:
        # The position of each document's first token, carried forward over the document.
        first = torch.where(starts, positions, torch.zeros_like(positions)).cummax(dim=1).values
        positions = positions - first
    return document_ids, positions.contiguous()


@dataclass
class DocumentMask:
    """Query i may attend to key j when both lie in the same document and j is not after i (with a
    sliding `window`, also fewer than `window` positions before i: gpt-oss). Within a document
    positions grow with the window's order whether or not they restart at each document, so
    (document id, position) decides all three."""

    document_ids: torch.Tensor  # (batch, seq)
    positions: torch.Tensor  # (batch, seq)
    block_mask: object = None  # FlexAttention's BlockMask, when that kernel runs
    window: int = 0  # 0: no sliding window

    def allowed(self, kv_document_ids: torch.Tensor, kv_positions: torch.Tensor) -> torch.Tensor:
        """(batch, 1, queries, keys) booleans against the keys with these ids and positions."""
        return visible(
            self.document_ids[:, None, :, None], self.positions[:, None, :, None],
            kv_document_ids[:, None, None, :], kv_positions[:, None, None, :], self.window,
        )


def visible(q_document, q_position, kv_document, kv_position, window: int = 0):
    seen = (q_document == kv_document) & (q_position >= kv_position)
    return seen & (q_position - kv_position < window) if window else seen


# Causal attention's kernels: SDPA's backends in order of preference (None: torch's own order). The
# ones after the first take over where it cannot run the inputs (fp32, deterministic mode, a head size).
FALLBACKS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
SDPA_BACKENDS = {"sdpa": None, "cudnn": [SDPBackend.CUDNN_ATTENTION, *FALLBACKS], "flash": FALLBACKS}


def choose_causal_kernel(capability: tuple[int, int] | None) -> tuple[str, str]:
    """(kernel, what the log says) of causal attention on a device (`capability`: CUDA's compute
    capability; None: CPU). Hopper and Blackwell: SDPA's cuDNN attention first; Ampere and Ada:
    SDPA's FlashAttention-2 first. (FlashAttention-3 through flash_attn_interface is not wired in:
    it awaits a GPU to check it on.)"""
    if capability is None:
        return "sdpa", "SDPA (on CPU its flash kernel)"
    sm = "sm_" + "".join(map(str, capability))
    if capability >= (9, 0):
        return "cudnn", f"SDPA's cuDNN attention on {sm}"
    if capability >= (8, 0):
        return "flash", f"SDPA's FlashAttention-2 on {sm}"
    return "sdpa", f"SDPA's own choice on {sm}"


def attention_kernels(args: ModelArgs, device: torch.device, cp_enabled: bool) -> tuple[ModelArgs, str]:
    """The run's kernels: causal attention's on this device (set on CoreAttention), and masked
    attention's (model.attn_type, where it can run: FlexAttention trains on CUDA only, and under context
    parallel the masked ring runs). Returns the args to build with and the line the log shows."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    CoreAttention.causal_kernel, causal = choose_causal_kernel(capability)
    line = f"attention kernels: causal {causal}"
    if not args.masked_attention:
        return args, line
    why = (f"FlexAttention has no backward on {device.type}" if device.type != "cuda"
           else "under context parallel the masked ring runs" if cp_enabled else None)
    if why and args.attn_type != "sdpa":
        return replace(args, attn_type="sdpa"), f"{line}; masked SDPA with a boolean mask ({args.attn_type} not used: {why})"
    return args, f"{line}; masked {'FlexAttention' if args.attn_type != 'sdpa' else 'SDPA with a boolean mask'}"


class CoreAttention(nn.Module):
    """q (batch, heads, seq, head_dim); k, v with n_kv_heads heads (GQA shares each among the query
    heads in order). No parameters: swapping it (context parallel) leaves checkpoints unchanged.
    `max_logits` (QK-clip sets it: one per query head) keeps the largest logit each head has seen in
    training forwards (validation's run without grad; activation checkpointing's recompute, inside
    backward, has seen them already). A buffer, not saved: the forward a pipeline stage runs to learn
    its shapes, on activations nothing wrote, leaves buffers as they were."""

    def __init__(self):
        super().__init__()
        self.register_buffer("max_logits", None, persistent=False)

    causal_kernel = "sdpa"  # attention_kernels sets it for the device

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask | None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """`sinks`: one logit per (local) query head that joins each softmax (gpt-oss; models/common/sinks.py)."""
        # Eager recompute (inside backward) skips the logits; a compiled graph cannot ask (dynamo cannot
        # trace the question): there the op asks when it runs.
        if self.max_logits is not None and torch.is_grad_enabled() and (torch.compiler.is_compiling() or not in_backward()):
            with torch.no_grad():
                max_outside_recompute(self.max_logits, largest_logits(q, k, mask))
        if sinks is not None:
            return attention_with_sinks(q, k, v, mask, sinks)
        if mask is not None and mask.block_mask is not None:
            flex_attention = compiled("flex_attention")
            return flex_attention(q, k, v, block_mask=mask.block_mask, enable_gqa=k.shape[1] != q.shape[1])
        repeats = q.shape[1] // k.shape[1]
        # CPU's flash kernel shares the kv heads itself (6% faster than copies). On CUDA only the flash
        # kernel does, which takes no mask nor fp32: elsewhere SDPA would fall back to its math path.
        shared_in_kernel = repeats > 1 and q.device.type == "cpu"
        if not shared_in_kernel:
            k, v = (t.repeat_interleave(repeats, dim=1) if repeats > 1 else t for t in (k, v))
        if mask is None:
            backends = SDPA_BACKENDS[self.causal_kernel]
            with sdpa_kernel(backends, set_priority=True) if backends else nullcontext():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=shared_in_kernel)
        allowed = mask.allowed(mask.document_ids, mask.positions)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=shared_in_kernel)


def attention_with_sinks(q, k, v, mask: DocumentMask | None, sinks: torch.Tensor) -> torch.Tensor:
    """Causal or masked attention with each head's sink logit in its softmax (common/sinks.py): CPU
    SDPA's flash kernel, or FlexAttention with its log-sum-exp (the step's block mask, or one read
    from the dense mask: context parallel's window keys)."""
    if mask is not None and mask.block_mask is not None and q.device.type != "cpu":
        return flex_sink_attention(q, k, v, mask.block_mask, sinks)
    allowed = None if mask is None else mask.allowed(mask.document_ids, mask.positions)
    return sink_attention(q, k, v, allowed, sinks)


def sink_attention(q, k, v, allowed: torch.Tensor | None, sinks: torch.Tensor) -> torch.Tensor:
    """q (b, heads, s, d) over k, v (b, kv_heads, s', d) where `allowed` (b, 1, s, s'; None, on CPU:
    causal): on CPU SDPA's flash kernel (FlexAttention trains on CUDA only), elsewhere FlexAttention
    with a block mask read from `allowed`."""
    if q.device.type == "cpu":
        return cpu_sink_attention(q, k, v, allowed, sinks)
    return flex_sink_attention(q, k, v, dense_block_mask(allowed), sinks)


def flex_sink_attention(q, k, v, block_mask, sinks: torch.Tensor) -> torch.Tensor:
    from torch.nn.attention.flex_attention import AuxRequest

    out, aux = compiled("flex_attention")(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1],
                                          return_aux=AuxRequest(lse=True))
    return rescaled_by_sinks(out, aux.lse, sinks)


def dense_block_mask(allowed: torch.Tensor):
    """FlexAttention's block mask of a boolean (b, 1, s, s') mask."""
    batch, _, rows, cols = allowed.shape
    return compiled("create_block_mask")(lambda b, h, i, j: allowed[b, 0, i, j], batch, None, rows, cols, device=allowed.device)


def largest_logits(q: torch.Tensor, k: torch.Tensor, mask: DocumentMask | None, elements: int = 2**24) -> torch.Tensor:
    """Each query head's largest logit, q.k / sqrt(head_dim) (the kernels' scale), over the pairs it
    may attend: computed apart in fp32 (no kernel reports it), a block of queries at a time (about
    `elements` scores at once) against the keys up to the block's last (no later key is visible)."""
    batch, heads, seq, dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, seq, dim)  # each key head's query heads together
    keys = k.float()[:, :, None].transpose(-1, -2)
    best = torch.full((heads,), -torch.inf, device=q.device)
    rows = max(1, elements // (batch * heads * seq))
    for start in range(0, seq, rows):
        end = min(seq, start + rows)
        scores = grouped[..., start:end, :].float() @ keys[..., :end]  # (batch, kv heads, group, rows, keys)
        queries, seen = torch.arange(start, end, device=q.device), torch.arange(end, device=q.device)
        if mask is None:
            allowed = queries[:, None] >= seen
        else:
            ids, positions = mask.document_ids, mask.positions
            allowed = visible(ids[:, None, None, start:end, None], positions[:, None, None, start:end, None],
                              ids[:, None, None, None, :end], positions[:, None, None, None, :end], mask.window)
        best = torch.maximum(best, scores.masked_fill_(~allowed, -torch.inf).amax(dim=(0, 3, 4)).reshape(heads))
    return best / dim**0.5  # dividing after the max: the same bits (rounding keeps the order)


def build_mask(document_ids: torch.Tensor, positions: torch.Tensor, attn_type: str, window: int = 0) -> DocumentMask:
    """The step's mask for one forward; FlexAttention's block mask is built here, once for all blocks."""
    mask = DocumentMask(document_ids, positions, window=window)
    if attn_type in ("flex", "varlen"):

        def same_document_not_later(b, h, q, kv):
            return visible(document_ids[b, q], positions[b, q], document_ids[b, kv], positions[b, kv], window)

        batch, seq = document_ids.shape
        create_block_mask = compiled("create_block_mask")
        mask.block_mask = create_block_mask(same_document_not_later, batch, None, seq, seq, device=document_ids.device)
    return mask


_COMPILED: dict = {}


def compiled(name: str):
    """torch.nn.attention.flex_attention's function `name`, compiled once per process on first use
    (uncompiled, FlexAttention materializes the whole score matrix)."""
    if name not in _COMPILED:
        from torch.nn.attention import flex_attention

        _COMPILED[name] = torch.compile(getattr(flex_attention, name), dynamic=False)
    return _COMPILED[name]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        bias = args.attention_bias
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=bias)
        self.qkv = FusedLinear() if args.fused_projections else None
        # Qwen3: each query and key head is RMS-normalized before RoPE.
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.inner_attention = CoreAttention()

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: DocumentMask | None = None) -> torch.Tensor:
        q, k, v = self.heads(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.attend(apply_rope(q, rope), apply_rope(k, rope), v, mask)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (b, s, heads, head_dim) of the input."""
        bsz, seqlen, _ = x.shape
        if self.qkv is not None and plain_linears(self.wq, self.wk, self.wv):
            biases = (self.wq.bias, self.wk.bias, self.wv.bias) if self.wq.bias is not None else ()
            q, k, v = self.qkv(x, self.wq.weight, self.wk.weight, self.wv.weight, *biases)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        # -1 heads: under tensor parallel each rank holds a slice of the heads.
        return tuple(t.view(bsz, seqlen, -1, self.head_dim) for t in (q, k, v))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask | None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """The core attention of (b, s, heads, head_dim) q, k, v (with sink logits), through the output projection."""
        bsz, seqlen = q.shape[:2]
        out = self.inner_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, sinks)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))
