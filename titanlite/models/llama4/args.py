"""Llama 4's shapes (Meta's config.json files, as transformers' Llama4TextConfig reads them), its
flavors and its checks.

A Llama 4 block is a RoPE block or a NoPE block. Every `nope_layer_interval`-th block (1-based) is
NoPE: no rotary embedding, attention over the whole window (causal, or within documents), queries
scaled up with the log of their position (`attn_temperature_tuning`). The others rotate q/k with
RoPE, optionally L2-normalize each head after it (`use_qk_norm`), and attend causally only within
chunks of `attention_chunk_size` tokens. Every `interleave_moe_layer_step`-th block has a mixture of
experts (top-1 sigmoid routing, the weight scaling the token before its expert, plus one shared
expert); the others a dense SwiGLU of `dense_hidden_dim` (Meta's intermediate_size_mlp).
"""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.errors import ConfigError
from titanlite.models.common.args import MoEArgs, check_overridden
from titanlite.models.moe.args import check_config as check_moe_config
from titanlite.models.moe.args import check_moe


@dataclass(frozen=True)
class Llama4Args(MoEArgs):
    interleave_moe_layer_step: int = 1  # block i is a MoE block when (i + 1) % step == 0
    nope_layer_interval: int = 4  # block i is NoPE when (i + 1) % interval == 0
    attention_chunk_size: int = 8192  # RoPE blocks attend within chunks of this many positions
    use_qk_norm: bool = True  # L2 norm (RMS, no weight) of each q/k head after RoPE, on RoPE blocks
    # Temperature tuning on NoPE blocks: q *= 1 + attn_scale * log(1 + floor((position + 1) / floor_scale)).
    attn_temperature_tuning: bool = True
    floor_scale: float = 8192.0
    attn_scale: float = 0.1

    def is_moe(self, layer: int) -> bool:
        return (layer + 1) % self.interleave_moe_layer_step == 0

    def uses_rope(self, layer: int) -> bool:
        return (layer + 1) % self.nope_layer_interval != 0

    @property
    def masked_attention(self) -> bool:
        return True  # the RoPE blocks' chunks

    def attention_flops_per_token(self, seq_len: int) -> int:
        """As ModelArgs counts them, each RoPE block's keys limited to its chunk."""
        per_layer_keys = sum(
            min(seq_len, self.attention_chunk_size) if self.uses_rope(i) else seq_len for i in range(self.n_layers)
        )
        return 12 * self.n_heads * self.head_dim * per_layer_keys


def _llama4(**shape) -> Llama4Args:
    """Meta's Llama 4 text model: top-1 of the routed experts by sigmoid, its weight on the expert's
    input, one shared expert, no expert bias or aux loss (Meta's recipe; both stay available)."""
    common = dict(
        dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, head_dim_override=128, vocab_size=202048, norm_eps=1e-5,
        rope_theta=500000.0, top_k=1, score_func="sigmoid", route_norm=False, num_shared_experts=1,
        moe_hidden_dim=8192, dense_hidden_dim=16384, score_before_experts=True, load_balance_coeff=0.0,
        max_seq_len=131072,
    )
    return Llama4Args(**(common | shape))


LLAMA4_FLAVORS = {
    # Every feature on, on CPU: MoE every other block, a NoPE block in four, chunks of 64, temperature
    # tuning from position 31 on, Scout's RoPE scaling and QK-norm.
    "debugmodel": _llama4(
        dim=256, n_layers=8, n_heads=16, n_kv_heads=8, head_dim_override=0, vocab_size=0, num_experts=8,
        moe_hidden_dim=256, dense_hidden_dim=512, interleave_moe_layer_step=2, attention_chunk_size=64,
        floor_scale=32.0, rope_scaling=True, rope_scaling_factor=16.0, rope_high_freq_factor=1.0, max_seq_len=2048,
        attn_type="sdpa",
    ),
    # Scout: 16 experts in every block, QK-norm, RoPE scaled by 16 (no blend band).
    "17bx16e": _llama4(
        num_experts=16, interleave_moe_layer_step=1, use_qk_norm=True, rope_scaling=True, rope_scaling_factor=16.0,
        rope_high_freq_factor=1.0,
    ),
    # Maverick: 128 experts in every other block (dense SwiGLU between), no QK-norm, unscaled RoPE.
    "17bx128e": _llama4(num_experts=128, interleave_moe_layer_step=2, use_qk_norm=False, rope_scaling=False),
}


def check_shapes(args: Llama4Args) -> None:
    """Shapes that cannot work whatever the layout."""
    if args.attention_chunk_size <= 0:
        raise ConfigError(
            f"attention_chunk_size={args.attention_chunk_size} must be > 0: Llama 4's RoPE blocks attend within chunks "
            "of that many tokens; use a positive size (Meta's: 8192)"
        )
    for name, what in (("interleave_moe_layer_step", "a MoE block"), ("nope_layer_interval", "a NoPE block")):
        if getattr(args, name) <= 0:
            raise ConfigError(
                f"{name}={getattr(args, name)} must be >= 1: every {name}-th block is {what}; use 1 (every block) "
                "or more (Scout's interleave_moe_layer_step: 1, Maverick's: 2; nope_layer_interval: 4)"
            )
    if args.n_dense_layers:
        raise ConfigError(
            f"n_dense_layers={args.n_dense_layers} does not apply to Llama 4, whose dense blocks are those between its "
            "MoE blocks: set interleave_moe_layer_step instead, and n_dense_layers=0"
        )
    if args.floor_scale <= 0:
        raise ConfigError(f"floor_scale={args.floor_scale} must be > 0 (Meta's: 8192)")
    if args.qk_norm:
        raise ConfigError(
            "qk_norm=true (Qwen3's q/k head norms with weights) is not part of Llama 4; its QK-norm is use_qk_norm "
            "(an L2 norm without weights, on the RoPE blocks): set qk_norm=false"
        )


def check_hf_exportable(args: Llama4Args) -> None:
    """ConfigError, before any training, when the model has something Llama4ForCausalLM (the Hugging
    Face architecture it exports as) cannot hold: it routes as Meta's model does, has one shared
    expert, no expert bias, and an integer floor_scale (its config's type)."""
    differences = [
        (args.num_shared_experts != 1, f"{args.num_shared_experts} shared experts"),
        (args.score_func != "sigmoid", f"{args.score_func} scores"), (args.route_norm, "renormalized routing weights"),
        (args.route_scale != 1.0, "a route scale"), (args.n_group > 1, "group-limited routing"),
        (not args.score_before_experts, "routing weights on the experts' outputs"),
        (args.floor_scale != int(args.floor_scale), f"floor_scale={args.floor_scale}"),
        (args.load_balance_coeff, "an expert bias (model.moe_load_balance_coeff)"),
    ]
    if found := [what for differs, what in differences if differs]:
        raise ConfigError(
            f"this Llama 4 model has {', '.join(found)}, which Llama4ForCausalLM (the Hugging Face architecture "
            "titanlite exports Llama 4 as) does not: it routes by sigmoid to top-k experts, scaling their input, with "
            "one shared expert and an integer floor_scale; export such a model trained with "
            "model.moe_load_balance_coeff=0 (the flavors' defaults), or set checkpoint.last_save_in_hf=false"
        )


def check_llama4(args: Llama4Args, dims) -> None:
    """The MoE checks (experts over ep, heads over tp, top_k), and Llama 4's shapes."""
    check_shapes(args)
    check_moe(args, dims)


def check_config(model, args: Llama4Args) -> None:
    """The MoE family's [model] keys and routing shapes, and Llama 4's shapes."""
    check_overridden(model, args, check_shapes)
    check_moe_config(model, args)
