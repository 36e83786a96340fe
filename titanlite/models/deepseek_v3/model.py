"""DeepSeek-V3 as a plain nn.Module: multi-head latent attention (MLA) with YaRN RoPE, Llama's block
around it, DeepSeek's mixture of experts (group-limited sigmoid routing, shared experts; the layer:
models/common/moe.py) from block `n_dense_layers` on. Parameter names follow TorchTitan's DeepSeek-V3.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.common.attention import CoreAttention, DocumentMask
from titanlite.models.common.linear import FusedLinear, plain_linears
from titanlite.models.common.moe import MoE
from titanlite.models.common.rope import apply_rope, rope_cache, yarn_frequencies
from titanlite.models.deepseek_v3.args import DeepSeekV3Args
from titanlite.models.llama3.model import Transformer, TransformerBlock

LATENT_NORM_EPS = 1e-6  # DeepSeek's (and Hugging Face's) latent norms use this whatever norm_eps says


class LatentAttention(nn.Module):
    """MLA. Queries: wq (or wq_a -> q_norm -> wq_b, through a `q_lora_rank` latent), per head a part
    without position and a RoPE part. Keys and values: wkv_a gives a `kv_lora_rank` latent and one RoPE
    key part shared by all heads; kv_norm -> wkv_b expands the latent to each head's key part and value.

    Values are zero-padded to the query/key head dim before the core attention, and the output cut
    back: every kernel (SDPA's flash, torch's context-parallel ring, the document ring, flex) then
    sees one head dim, and the padding adds exact zeros. YaRN's mscale^2 scales the queries, which is
    the softmax scale it asks for."""

    def __init__(self, args: DeepSeekV3Args):
        super().__init__()
        self.nope_dim, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_lora_rank, self.query_scale = args.kv_lora_rank, args.softmax_mscale
        q_out = args.n_heads * args.qk_head_dim
        if args.q_lora_rank:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(args.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, q_out, bias=False)
        else:
            self.wq = nn.Linear(args.dim, q_out, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(args.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        # The two down projections read the same input: one matmul (they are small and never split over tp).
        self.down = FusedLinear() if args.fused_projections and args.q_lora_rank else None
        # The RoPE key part all heads share passes here (tensor parallel sums its gradient over the tp ranks' heads).
        self.shared_key = nn.Identity()
        self.inner_attention = CoreAttention()

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: DocumentMask | None = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        if hasattr(self, "wq_a"):
            if self.down is not None and plain_linears(self.wq_a, self.wkv_a):
                q_latent, kv = self.down(x, self.wq_a.weight, self.wkv_a.weight)
            else:
                q_latent, kv = self.wq_a(x), self.wkv_a(x)
            q = self.wq_b(self.q_norm(q_latent))
        else:
            q, kv = self.wq(x), self.wkv_a(x)
        # -1 heads: under tensor parallel each rank holds a slice of the heads.
        q_nope, q_pe = q.view(bsz, seqlen, -1, self.nope_dim + self.rope_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        kv_latent, k_pe = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_nope, v = self.wkv_b(self.kv_norm(kv_latent)).view(bsz, seqlen, -1, self.nope_dim + self.v_dim).split(
            [self.nope_dim, self.v_dim], dim=-1
        )
        heads = k_nope.shape[2]
        q = torch.cat([q_nope, apply_rope(q_pe, rope)], dim=-1)
        k_pe = apply_rope(self.shared_key(k_pe).unsqueeze(2), rope)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, heads, -1)], dim=-1)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        v = F.pad(v, (0, q.shape[-1] - self.v_dim))
        out = self.inner_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.wo(out[..., : self.v_dim].transpose(1, 2).reshape(bsz, seqlen, -1))


def deepseek_block(layer_id: int, args: DeepSeekV3Args) -> TransformerBlock:
    return TransformerBlock(layer_id, args, MoE(args) if args.is_moe(layer_id) else None, LatentAttention(args))


class MultiTokenPrediction(nn.Module):
    """Depth k of multi-token prediction (DeepSeek-V3, section 2.2): the hidden state of depth k-1 at
    each position i, as the output head read it (after the model's final norm, or depth k-1's), and
    the embedding of token i+k, each RMS-normed (hnorm, enorm), joined by one projection (embedding
    first), through one block; its own final norm precedes the shared output head. Megatron-Core and
    vLLM (which runs DeepSeek's released MTP layer) wire it so."""

    def __init__(self, layer_id: int, args: DeepSeekV3Args):
        super().__init__()
        self.enorm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.hnorm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = deepseek_block(layer_id, args)
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, h: torch.Tensor, embedded: torch.Tensor, rope: torch.Tensor, mask: DocumentMask | None) -> torch.Tensor:
        return self.block(self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1)), rope, mask)


class DeepSeekV3Transformer(Transformer):
    """Llama's transformer with latent attention in every block, MoE feed-forwards from block
    `n_dense_layers` on, YaRN's RoPE table, and `mtp_depth` multi-token prediction modules after the
    final block (the `mtp` ModuleDict; None without them, or on a pipeline stage without the tail).

    With MTP the model takes `future_tokens` (b, s, depth): token i+k of each position i (the trainer
    makes them from the whole window, so a sequence shard's come exact from its neighbours' tokens).
    A stage without the tail returns (hidden states, the future tokens' embeddings) for the next
    one; the last returns (logits, logits of each depth), the output head shared by all; in
    evaluation the logits alone."""

    def __init__(self, args: DeepSeekV3Args):
        super().__init__(args)
        depths = range(args.mtp_depth)
        self.mtp = nn.ModuleDict({str(k): MultiTokenPrediction(args.n_layers + k, args) for k in depths}) if depths else None

    def make_block(self, layer_id: int, args: DeepSeekV3Args) -> nn.Module:
        return deepseek_block(layer_id, args)

    def forward(self, tokens, future=None, positions=None, document_ids=None, future_tokens=None, labels=None):
        """`future`: on a later pipeline stage, the future tokens' embeddings from the one before.
        `labels`: the summed losses instead of the logits (the chunked loss): labels (b, s, 1 + depth)
        give the model's own loss and, in training, each MTP depth's."""
        if self.args.mtp_depth == 0:
            return super().forward(tokens, positions, document_ids, labels)
        h = tokens
        if self.tok_embeddings is not None:
            h, future = self.tok_embeddings(tokens), self.tok_embeddings(future_tokens)
        rope, mask = self.position_inputs(positions, document_ids, h.shape[1])
        for layer in self.layers.values():
            h = layer(h, rope, mask)
        if self.output is None:
            return h, future

        def depth_labels(k: int):
            return None if labels is None else labels[..., k]

        h = self.norm(h)
        outputs = [self.output(h, depth_labels(0))]
        if not self.training:  # evaluation: the model's own prediction
            return outputs[0]
        for k, module in self.mtp.items():
            h = module.norm(module(h, future[:, :, int(k)], rope, mask))
            outputs.append(self.output(h, depth_labels(int(k) + 1)))
        return tuple(outputs)

    def init_std(self, fqn: str) -> float | None:
        """An MTP module's block initializes as the block after the model's (depth-scaled as such)."""
        parts = fqn.split(".")
        if parts[0] == "mtp" and parts[2] == "block":
            fqn = ".".join(["layers", str(self.args.n_layers + int(parts[1])), *parts[3:]])
        elif parts[0] == "mtp":
            return None if "norm" in parts[2] else 0.02
        return super().init_std(fqn)

    def rope_table(self, device=None) -> torch.Tensor:
        a = self.args
        if not a.yarn_on:
            return rope_cache(a, a.max_seq_len, device)
        freqs = yarn_frequencies(
            a.rope_dim, a.rope_theta, a.yarn_factor, a.yarn_original_seq_len, a.yarn_beta_fast, a.yarn_beta_slow, device
        )
        return rope_cache(a, a.max_seq_len, device, freqs=freqs, amplitude=a.rope_attention_factor)
