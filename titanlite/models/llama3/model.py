"""Llama 3 as a plain nn.Module: RoPE (theta + Llama 3.1 scaling), GQA, SwiGLU, RMSNorm, attention
causal over the window or within each packed document (the layers: models/common/).

No parallel code lives here. Layers sit in an nn.ModuleDict keyed "0".."n-1" and the embedding,
final norm and output may be None, so a pipeline stage is this model with modules removed and
parameter names (FQNs) stay the same on every layout.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from titanlite.models.common.args import ModelArgs
from titanlite.models.common.attention import Attention, DocumentMask, build_mask
from titanlite.models.common.feed_forward import FeedForward
from titanlite.models.common.fqn import canonical_fqn
from titanlite.models.common.linear import OutputProjection
from titanlite.models.common.rope import rope_cache


class TransformerBlock(nn.Module):
    """Attention, then a feed-forward: Llama's GQA and SwiGLU unless given others (latent attention, a
    mixture of experts)."""

    def __init__(self, layer_id: int, args: ModelArgs, feed_forward: nn.Module | None = None, attention: nn.Module | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = attention or Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = feed_forward or FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: DocumentMask | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.make_block(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = OutputProjection(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:  # one parameter, named tok_embeddings.weight (the first module that holds it)
            self.output.weight = self.tok_embeddings.weight
        # Not persistent: recomputed after materialization, never checkpointed.
        self.register_buffer("rope", self.rope_table(), persistent=False)

    def rope_table(self, device=None) -> torch.Tensor:
        return rope_cache(self.args, self.args.max_seq_len, device)

    def make_block(self, layer_id: int, args: ModelArgs) -> nn.Module:
        return TransformerBlock(layer_id, args)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, document_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens (b, s) (a later pipeline stage: the hidden states); `positions` (b, s) pick each
        token's RoPE rows (default 0..s-1); with `document_ids` (b, s) attention stays within each
        document (models/common/attention.py's document_layout gives both). With `labels` (b, s)
        the model returns their summed cross entropy (chunked: OutputProjection), not the logits."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope, mask = self.position_inputs(positions, document_ids, h.shape[1])
        for layer in self.layers.values():
            h = layer(h, rope, mask)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h
        return self.output(h) if labels is None else self.output(h, labels)

    def position_inputs(self, positions: torch.Tensor | None, document_ids: torch.Tensor | None, seq_len: int) -> tuple:
        """(each token's RoPE rows, what the blocks' attention masks by: the document mask or None) of
        one forward over `seq_len` tokens."""
        if document_ids is not None and positions is None:
            positions = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
        rope = self.rope if positions is None else self.rope[positions]
        mask = None if document_ids is None else build_mask(document_ids, positions, self.args.attn_type)
        return rope, mask

    # ---- initialization ----

    def init_std(self, fqn: str) -> float | None:
        """Init std of a parameter by name; None means ones (norm weights)."""
        args, parts = self.args, fqn.split(".")
        if parts[-2:] == ["tok_embeddings", "weight"] and not args.tie_embeddings:
            return 1.0
        if parts[0] in ("output", "tok_embeddings"):  # a tied embedding starts as the output it also is
            return args.dim**-0.5
        if "norm" in parts[-2]:
            return None
        layer_id = int(parts[1])
        depth_std = 0.02 / (2 * (layer_id + 1)) ** 0.5 if args.depth_init else 0.02 / (2 * args.n_layers) ** 0.5
        projection = parts[-2] if parts[-1] in ("weight", "bias") else parts[-1]  # a raw parameter: experts.w2
        return depth_std if projection in ("wo", "w2", "w3") else 0.02

    def initial_value(self, fqn: str, shape, device, seed: int) -> torch.Tensor:
        """The full initial tensor of one parameter, from a generator seeded by (seed, name).

        Seeding per name makes the weights identical whether the model is whole, sharded or split
        into pipeline stages: every layout builds the same full tensor and keeps its own slice.
        """
        std = self.init_std(fqn)
        if std is None:
            return torch.ones(shape, device=device)
        gen = torch.Generator(device=device)
        gen.manual_seed(zlib.crc32(f"{seed}:{fqn}".encode()))
        out = torch.empty(shape, device=device)
        if fqn.startswith("tok_embeddings"):
            return out.normal_(0.0, std, generator=gen)
        return nn.init.trunc_normal_(out, std=std, a=-3 * std, b=3 * std, generator=gen)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, assign=None) -> None:
        """Initialize every parameter (depth-scaled) and recompute the RoPE table.

        `assign(param, full_value)` copies a full tensor into a parameter; the parallel code passes
        one that keeps only the local shard of a DTensor.
        """
        assign = assign or (lambda param, value: param.copy_(value))
        if self.args.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight  # to_empty gives each module a parameter of its own
        for name, param in self.named_parameters():
            assign(param, self.initial_value(canonical_fqn(name), param.shape, param.device, seed))
        self.rope = self.rope_table(self.rope.device)
        for module in self.modules():
            if module is not self and hasattr(module, "reset_state"):
                module.reset_state()  # state buffers (a MoE's expert bias) start from zero

    # ---- size and cost ----

    def num_params(self, exclude_embedding: bool = False) -> int:
        total = sum(p.numel() for p in self.parameters())
        if exclude_embedding and self.tok_embeddings is not None and not self.args.tie_embeddings:
            total -= self.tok_embeddings.weight.numel()
        return total

    def flops_per_token(self, seq_len: int) -> int:
        return self.args.flops_per_token(seq_len)
