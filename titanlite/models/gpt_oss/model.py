"""gpt-oss as a plain nn.Module: Llama's transformer with biased GQA projections, a sink logit per
head, sliding-window attention on even blocks, YaRN RoPE, and a mixture of clamped-SwiGLU experts
with biases in every block (models/gpt_oss/args.py).

The window is a mask rule (models/common/attention.py's DocumentMask.window): query i sees key j of
its document when 0 <= i - j < window, in RoPE positions, so it holds under document masking and
every kernel and context parallel take it as they take documents. Each forward builds two masks, the
full one and the sliding one, once for all blocks; every block has a mask (without documents, one
document), so context parallel can run the sinks through its document ring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from titanlite.models.common.attention import Attention, DocumentMask, build_mask
from titanlite.models.common.moe import GroupedExperts, MoE, expert_groups, local_shard, per_expert
from titanlite.models.common.rope import apply_rope, rope_cache, yarn_frequencies
from titanlite.models.gpt_oss.args import GptOssArgs
from titanlite.models.llama3.model import Transformer, TransformerBlock


@dataclass
class LayerMasks:
    full: DocumentMask
    sliding: DocumentMask


class AttentionSinks(nn.Module):
    """One learned logit per query head, which joins every softmax of that head. Tensor parallel
    splits it by heads (parallel/tensor.py's ShardedHeads); the forward returns this rank's."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_heads))

    def forward(self) -> torch.Tensor:
        return local_shard(self.weight)


class GptOssAttention(Attention):
    def __init__(self, args: GptOssArgs, layer_id: int):
        super().__init__(args)
        self.sinks = AttentionSinks(args.n_heads)
        self.sliding = args.is_sliding(layer_id)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, masks: LayerMasks) -> torch.Tensor:
        q, k, v = self.heads(x)
        mask = masks.sliding if self.sliding else masks.full
        return self.attend(apply_rope(q, rope), apply_rope(k, rope), v, mask, self.sinks())


class ClampedSwiGLUExperts(GroupedExperts):
    """GroupedExperts with a bias on each projection and gpt-oss's clamped SwiGLU:
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=limit)."""

    def __init__(self, args: GptOssArgs):
        super().__init__(args.dim, args.moe_hidden_dim, args.num_experts, args.use_grouped_mm)
        self.w1_bias = nn.Parameter(torch.empty(args.num_experts, args.moe_hidden_dim))
        self.w3_bias = nn.Parameter(torch.empty(args.num_experts, args.moe_hidden_dim))
        self.w2_bias = nn.Parameter(torch.empty(args.num_experts, args.dim))
        self.limit, self.alpha = args.swiglu_limit, args.swiglu_alpha

    def forward(self, x: torch.Tensor, counts: torch.Tensor, meanwhile=None) -> torch.Tensor:
        dtype = self.compute_dtype or x.dtype
        w1, w2, w3 = self.weights(dtype)
        groups = expert_groups(counts, self.kernel)

        def by_row(bias: torch.Tensor) -> torch.Tensor:  # each row's expert's bias
            return local_shard(bias).to(dtype).repeat_interleave(counts, dim=0, output_size=x.shape[0])

        rows = x.to(dtype)
        gate = (per_expert(rows, groups, w1) + by_row(self.w1_bias)).clamp(max=self.limit)
        up = (per_expert(rows, groups, w3) + by_row(self.w3_bias)).clamp(-self.limit, self.limit)
        hidden = (up + 1) * gate * torch.sigmoid(self.alpha * gate)
        return (per_expert(hidden, groups, w2) + by_row(self.w2_bias)).to(x.dtype)


class GptOssTransformer(Transformer):
    def rope_table(self, device=None) -> torch.Tensor:
        a = self.args
        if a.yarn_factor <= 1:
            return super().rope_table(device)
        freqs = yarn_frequencies(a.rope_dim, a.rope_theta, a.yarn_factor, a.yarn_original_seq_len, a.yarn_beta_fast,
                                 a.yarn_beta_slow, device, truncate=False)
        return rope_cache(a, a.max_seq_len, device, freqs, amplitude=a.rope_attention_factor)

    def make_block(self, layer_id: int, args: GptOssArgs) -> nn.Module:
        return TransformerBlock(layer_id, args, MoE(args, ClampedSwiGLUExperts(args)), GptOssAttention(args, layer_id))

    def position_inputs(self, positions: torch.Tensor | None, document_ids: torch.Tensor | None, seq_len: int) -> tuple:
        if positions is None:
            positions = torch.arange(seq_len, device=self.rope.device).unsqueeze(0)
        if document_ids is None:  # one document: causal
            document_ids = torch.zeros_like(positions)
        rope, full = super().position_inputs(positions, document_ids, seq_len)
        sliding = build_mask(full.document_ids, full.positions, self.args.attn_type, window=self.args.sliding_window)
        return rope, LayerMasks(full, sliding)

    def initial_value(self, fqn: str, shape, device, seed: int) -> torch.Tensor:
        """Biases start at zero (as transformers initializes them); the rest as Llama's."""
        if fqn.endswith("bias"):
            return torch.zeros(shape, device=device)
        return super().initial_value(fqn, shape, device, seed)
