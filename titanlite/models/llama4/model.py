"""Llama 4's text model as a plain nn.Module: Llama's transformer with RoPE blocks (chunked local
attention, optional L2 QK-norm) and NoPE blocks (global attention, temperature-tuned queries), dense
and mixture-of-experts feed-forwards interleaved (models/llama4/args.py says which block is which).

Chunked attention is a document mask: a chunk is a run of `attention_chunk_size` positions, and a
RoPE block's token sees the earlier tokens of its own (document, chunk) segment. Positions are the
RoPE positions, so chunks count from the window's start, or under model.reset_position_ids from each
document's (a document attends as if it were alone; so do the NoPE blocks' temperatures, which
transformers takes from the window's positions even for packed documents). Every kernel and
context parallel's ring then take chunks as they take documents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from titanlite.models.common.attention import Attention, DocumentMask, build_mask
from titanlite.models.common.moe import MoE
from titanlite.models.common.rope import apply_rope
from titanlite.models.llama3.model import Transformer, TransformerBlock
from titanlite.models.llama4.args import Llama4Args


@dataclass
class AttentionInputs:
    """What a block's attention masks and scales by: the whole-window mask (None: causal), the
    chunked mask, and each token's position."""

    full: DocumentMask | None
    chunked: DocumentMask | None  # None: the window is one chunk, and causal
    positions: torch.Tensor  # (b, s)


class Llama4Attention(Attention):
    """GQA (Llama's projections and names); a RoPE block rotates q/k (then L2-normalizes each head
    where `use_qk_norm`) and attends within chunks, a NoPE block attends over the window with
    temperature-tuned queries."""

    def __init__(self, args: Llama4Args, layer_id: int):
        super().__init__(args)
        self.use_rope = args.uses_rope(layer_id)
        self.l2_norm_eps = args.norm_eps if args.use_qk_norm and self.use_rope else None
        self.temperature = (args.floor_scale, args.attn_scale) if args.attn_temperature_tuning and not self.use_rope else None

    def forward(self, x: torch.Tensor, rope: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        q, k, v = self.heads(x)
        if not self.use_rope:
            if self.temperature is not None:
                floor_scale, attn_scale = self.temperature
                scale = torch.log1p(torch.floor((inputs.positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
                q = (q * scale[:, :, None, None]).to(q.dtype)
            return self.attend(q, k, v, inputs.full)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        if self.l2_norm_eps is not None:
            q, k = (F.rms_norm(t.float(), (t.shape[-1],), eps=self.l2_norm_eps).type_as(t) for t in (q, k))
        return self.attend(q, k, v, inputs.chunked)


class Llama4Transformer(Transformer):
    """Llama's transformer with Llama 4's blocks; each forward builds both masks once for all blocks."""

    def make_block(self, layer_id: int, args: Llama4Args) -> TransformerBlock:
        return TransformerBlock(layer_id, args, MoE(args) if args.is_moe(layer_id) else None, Llama4Attention(args, layer_id))

    def position_inputs(self, positions: torch.Tensor | None, document_ids: torch.Tensor | None, seq_len: int) -> tuple:
        rope, full = super().position_inputs(positions, document_ids, seq_len)
        if positions is None:
            positions = torch.arange(seq_len, device=self.rope.device).unsqueeze(0)
        if self.args.max_seq_len <= self.args.attention_chunk_size:
            # One chunk holds the window: the NoPE blocks' mask (under causal, SDPA's causal kernel and torch's ring).
            return rope, AttentionInputs(full, full, positions)
        chunks = positions // self.args.attention_chunk_size
        if document_ids is not None:  # one segment per (document, chunk), numbered in window order
            chunks = document_ids * (self.args.max_seq_len // self.args.attention_chunk_size + 1) + chunks
        chunked = build_mask(chunks, positions, self.args.attn_type)
        return rope, AttentionInputs(full, chunked, positions)
