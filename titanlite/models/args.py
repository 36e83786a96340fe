"""Model shapes: Llama 3 and the mixture-of-experts family (no torch import: run_train.sh checks
layouts against them before launching)."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    vocab_size: int = 128256  # 0 = take it from the tokenizer
    multiple_of: int = 1024  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = 1.3
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: bool = True  # Llama 3.1 long-context frequency scaling
    max_seq_len: int = 131072
    depth_init: bool = True  # scale output projections' init std by depth
    head_dim_override: int = 0  # 0: dim / n_heads (Qwen3's heads are wider than that)
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3)
    # TorchTitan's names. block_causal: attention within each packed document (models/attention.py);
    # attn_type: its kernel, flex (CUDA; SDPA with a boolean mask elsewhere) or sdpa (varlen,
    # TorchTitan's other one, runs on flex here). Causal attention runs SDPA's causal kernel.
    attn_mask_type: str = "causal"
    attn_type: str = "flex"
    # q/k/v in one matmul, and SwiGLU's w1/w3 in one (the parameters stay separate; models/llama.py).
    fused_projections: bool = False

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def attention_params(self) -> int:
        """wq, wk, wv, wo, the attention norm (and the q/k head norms)."""
        q_dim = self.n_heads * self.head_dim
        return 2 * self.dim * q_dim + 2 * self.dim * self.kv_dim + self.dim + (2 * self.head_dim if self.qk_norm else 0)

    def feed_forward_params(self, layer: int, active: bool = False) -> int:
        """The FFN norm and SwiGLU (w1, w2, w3) of one block."""
        return self.dim + 3 * self.dim * self.ffn_hidden_dim

    @property
    def block_params(self) -> int:
        """One TransformerBlock (the last one: a MoE block where blocks differ)."""
        return self.attention_params + self.feed_forward_params(self.n_layers - 1)

    def num_params(self, exclude_embedding: bool = False, active: bool = False) -> int:
        """All weights, or with `active` those one token uses (the routed experts it visits)."""
        embedding = 0 if exclude_embedding else self.vocab_size * self.dim
        blocks = sum(self.attention_params + self.feed_forward_params(i, active) for i in range(self.n_layers))
        return embedding + blocks + self.dim + self.dim * self.vocab_size  # + norm, output

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 per non-embedding weight it uses (a MoE token: its experts'
        only), plus attention scores and values.

        12 * layers * heads * head_dim * seq_len counts QK^T and AV (2 matmuls x 2 FLOPs x 3 for
        forward + backward) without halving for the causal mask, as PaLM, nanoGPT and TorchTitan do.
        """
        weights = self.num_params(exclude_embedding=True, active=True)
        return 6 * weights + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len

    def with_vocab(self, tokenizer_vocab: int) -> "ModelArgs":
        """Flavors with vocab_size 0 take the tokenizer's, padded to a multiple of 64 so the embedding
        and output split evenly under tensor parallel (and matmuls align)."""
        return self if self.vocab_size else replace(self, vocab_size=-(-tokenizer_vocab // 64) * 64)


# Meta's published shapes (Llama 3.1); debugmodel follows TorchTitan's, with the tokenizer's vocab.
LLAMA3_FLAVORS = {
    "debugmodel": ModelArgs(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=16, vocab_size=0, multiple_of=256, ffn_dim_multiplier=None
    ),
    # The debug model with grouped-query attention (4 query heads per kv head), as the big flavors have.
    "debugmodel_gqa": ModelArgs(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=4, vocab_size=0, multiple_of=256, ffn_dim_multiplier=None
    ),
    "8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, multiple_of=1024, ffn_dim_multiplier=1.3),
    "70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, multiple_of=4096, ffn_dim_multiplier=1.3),
    "405B": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, multiple_of=4096, ffn_dim_multiplier=1.2),
}




def _block_causal(flavor: str, attn_type: str) -> ModelArgs:
    return replace(LLAMA3_FLAVORS[flavor], attn_mask_type="block_causal", attn_type=attn_type)


# TorchTitan's document-masked presets: the same shapes, block-causal attention on its kernels.
LLAMA3_FLAVORS |= {
    "debugmodel_flex_attn": _block_causal("debugmodel", "flex"),
    "debugmodel_varlen_attn": _block_causal("debugmodel", "varlen"),
    "8B_flex": _block_causal("8B", "flex"),
    "8B_varlen": _block_causal("8B", "varlen"),
}


def check_llama3(args: ModelArgs, dims) -> None:
    """No experts to split; tensor parallel splits attention by heads: both head counts must divide
    by tp. `dims`: the layout (titanlite.parallel.dims.ParallelDims)."""
    from titanlite.config import ConfigError

    for key, degree in (("expert_parallel_degree", dims.ep), ("expert_tensor_parallel_degree", dims.etp)):
        if degree > 1:
            raise ConfigError(
                f"parallelism.{key}={degree} splits the experts of a MoE model, and this model has none; "
                "set it to 1, or choose model.name='moe'"
            )
    check_heads(args, dims.tp)


def check_heads(args: ModelArgs, tp: int) -> None:
    from titanlite.config import ConfigError

    for name, value in (("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads)):
        if value % tp:
            raise ConfigError(
                f"parallelism.tensor_parallel_degree={tp} does not divide the model's {name}={value}; "
                f"choose a divisor of {value}"
            )


@dataclass(frozen=True)
class MoEArgs(ModelArgs):
    """A mixture-of-experts transformer: blocks from `n_dense_layers` on replace the dense SwiGLU by
    `num_experts` routed SwiGLU experts (hidden `moe_hidden_dim`; each token visits `top_k`) plus
    `num_shared_experts` that every token visits. Names follow TorchTitan's MoEArgs where it has one."""

    num_experts: int = 8
    num_shared_experts: int = 0
    top_k: int = 2
    moe_hidden_dim: int = 512
    n_dense_layers: int = 0  # the first blocks keep a dense FFN of ffn_hidden_dim (DeepSeek's first_k_dense)
    dense_hidden_dim: int = 0  # that FFN's hidden size; 0: from dim, multiple_of, ffn_dim_multiplier
    score_func: str = "softmax"  # router scores: softmax or sigmoid
    route_norm: bool = False  # renormalize the top-k scores to sum to 1
    route_scale: float = 1.0
    # DeepSeek-V3's auxiliary-loss-free balancing: after each optimizer step the expert bias (added to
    # the scores for choosing, never for weighting) moves by this much towards balance. 0: off.
    load_balance_coeff: float = 1e-3
    aux_loss_coeff: float = 0.0  # DeepSeek-V3's sequence-wise balance loss; 0: off
    use_grouped_mm: bool = True  # torch._grouped_mm for the experts (False: an exact loop over experts)

    @property
    def ffn_hidden_dim(self) -> int:
        return self.dense_hidden_dim or super().ffn_hidden_dim

    def is_moe(self, layer: int) -> bool:
        return layer >= self.n_dense_layers

    def feed_forward_params(self, layer: int, active: bool = False) -> int:
        if not self.is_moe(layer):
            return super().feed_forward_params(layer)
        experts = (self.top_k if active else self.num_experts) + self.num_shared_experts
        return self.dim + self.dim * self.num_experts + experts * 3 * self.dim * self.moe_hidden_dim  # + router


# Published shapes. Qwen3-MoE: GQA with q/k head norms, softmax top-8 of 128 experts renormalized, no
# shared experts, balanced by an aux loss (coefficient 0.001) and no expert bias (Qwen's config.json;
# Qwen's loss is global-batch, ours sequence-wise). DeepSeek-MoE 16B: standard multi-head attention, 64 routed
# experts (top 6) + 2 shared, the first block dense (DeepSeek's config.json; not DeepSeek-V3, whose
# attention is MLA).
MOE_FLAVORS = {
    "debugmoe": MoEArgs(
        dim=256, n_layers=4, n_heads=16, n_kv_heads=4, vocab_size=0, multiple_of=256, ffn_dim_multiplier=None,
        num_experts=8, num_shared_experts=1, top_k=2, moe_hidden_dim=256, n_dense_layers=1, route_norm=True,
        rope_scaling=False, rope_theta=10000.0,
    ),
    # DeepSeek-V3's routing on the debug shape: sigmoid scores, renormalized and scaled, no shared expert.
    "debugmoe_sigmoid": MoEArgs(
        dim=256, n_layers=4, n_heads=16, n_kv_heads=4, vocab_size=0, multiple_of=256, ffn_dim_multiplier=None,
        num_experts=8, top_k=2, moe_hidden_dim=256, n_dense_layers=1, score_func="sigmoid", route_norm=True,
        route_scale=2.5, rope_scaling=False, rope_theta=10000.0,
    ),
    # Qwen3-MoE's architecture on the debug shape: what the Hugging Face export and import are tested on.
    "debugmoe_qwen3": MoEArgs(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim_override=64, qk_norm=True, vocab_size=0, multiple_of=256,
        ffn_dim_multiplier=None, norm_eps=1e-6, num_experts=8, top_k=2, moe_hidden_dim=128, n_dense_layers=1,
        route_norm=True, load_balance_coeff=0.0, rope_scaling=False, rope_theta=1000000.0,
    ),
    "qwen3_30b_a3b": MoEArgs(
        dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim_override=128, qk_norm=True, vocab_size=151936,
        norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=False, num_experts=128, top_k=8, moe_hidden_dim=768,
        route_norm=True, max_seq_len=40960, load_balance_coeff=0.0, aux_loss_coeff=0.001,
        dense_hidden_dim=6144,  # config.json's intermediate_size (no block is dense)
    ),
    "qwen3_235b_a22b": MoEArgs(
        dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim_override=128, qk_norm=True, vocab_size=151936,
        norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=False, num_experts=128, top_k=8, moe_hidden_dim=1536,
        route_norm=True, max_seq_len=40960, load_balance_coeff=0.0, aux_loss_coeff=0.001,
        dense_hidden_dim=12288,  # config.json's intermediate_size (no block is dense)
    ),
    "deepseek_moe_16b": MoEArgs(
        dim=2048, n_layers=28, n_heads=16, n_kv_heads=16, vocab_size=102400, norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=False, num_experts=64, num_shared_experts=2, top_k=6, moe_hidden_dim=1408, n_dense_layers=1,
        dense_hidden_dim=10944, max_seq_len=4096,
    ),
}


def check_moe(args: MoEArgs, dims) -> None:
    from titanlite.config import ConfigError

    if dims.tp > 1 and not dims.sequence_parallel:
        raise ConfigError(
            f"parallelism.tensor_parallel_degree={dims.tp} with enable_sequence_parallel=false: a MoE layer under "
            "tensor parallel routes each tp rank's sequence shard; set parallelism.enable_sequence_parallel=true"
        )
    check_heads(args, dims.tp)
    if args.moe_hidden_dim % (8 * dims.etp):
        raise ConfigError(
            f"the experts' hidden size {args.moe_hidden_dim} split over expert_tensor_parallel_degree={dims.etp} is not a "
            "multiple of 8 (the grouped GEMM's rows must be 16-byte aligned); set parallelism.expert_tensor_parallel_degree=1"
        )
    if args.num_experts % dims.ep:
        raise ConfigError(
            f"parallelism.expert_parallel_degree={dims.ep} does not divide the model's num_experts={args.num_experts}; "
            f"choose a divisor of {args.num_experts}"
        )
    if not 0 < args.top_k <= args.num_experts:
        raise ConfigError(
            f"the MoE flavor routes each token to top_k={args.top_k} of num_experts={args.num_experts} experts; "
            f"choose 1 <= top_k <= {args.num_experts}"
        )
    if args.score_func not in ("softmax", "sigmoid"):
        raise ConfigError(f"MoE score_func='{args.score_func}' is not softmax or sigmoid; choose one of them")


def check_hf_exportable(args: ModelArgs) -> None:
    """ConfigError, before any training, when the model has no Hugging Face architecture to export to:
    a MoE flavor must have Qwen3-MoE's (and no expert bias, which Qwen3MoeForCausalLM lacks)."""
    from titanlite.config import ConfigError

    if not isinstance(args, MoEArgs):
        return
    differences = [
        (not args.qk_norm, "no q/k head norms"), (args.num_shared_experts, "shared experts"),
        (args.score_func != "softmax", f"{args.score_func} scores"), (args.route_scale != 1.0, "a route scale"),
        (args.rope_scaling, "Llama 3.1 RoPE scaling"), (args.load_balance_coeff, "an expert bias (model.moe_load_balance_coeff)"),
    ]
    if found := [what for differs, what in differences if differs]:
        raise ConfigError(
            f"this MoE model has {', '.join(found)}, which Qwen3MoeForCausalLM (the Hugging Face architecture "
            "titanlite exports MoE models as) does not; export a Qwen3-MoE flavor (qwen3_30b_a3b, qwen3_235b_a22b, "
            "debugmoe_qwen3) trained with model.moe_load_balance_coeff=0"
        )
