"""The mixture-of-experts family's flavors (published MoE shapes and debug presets) and its checks."""

from __future__ import annotations

from titanlite.errors import ConfigError
from titanlite.models.common.args import MoEArgs, check_heads, check_overridden, check_shapes

# Published shapes. Qwen3-MoE: GQA with q/k head norms, softmax top-8 of 128 experts renormalized, no
# shared experts, balanced by Qwen's global-batch aux loss (coefficient 0.001) and no expert bias (Qwen's config.json). DeepSeek-MoE 16B: standard multi-head attention, 64 routed
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
        route_norm=True, max_seq_len=40960, load_balance_coeff=0.0, aux_loss_coeff=0.001, aux_loss_type="global_batch",
        dense_hidden_dim=6144,  # config.json's intermediate_size (no block is dense)
    ),
    "qwen3_235b_a22b": MoEArgs(
        dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim_override=128, qk_norm=True, vocab_size=151936,
        norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=False, num_experts=128, top_k=8, moe_hidden_dim=1536,
        route_norm=True, max_seq_len=40960, load_balance_coeff=0.0, aux_loss_coeff=0.001, aux_loss_type="global_batch",
        dense_hidden_dim=12288,  # config.json's intermediate_size (no block is dense)
    ),
    "deepseek_moe_16b": MoEArgs(
        dim=2048, n_layers=28, n_heads=16, n_kv_heads=16, vocab_size=102400, norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=False, num_experts=64, num_shared_experts=2, top_k=6, moe_hidden_dim=1408, n_dense_layers=1,
        dense_hidden_dim=10944, max_seq_len=4096,
    ),
}


def check_moe(args: MoEArgs, dims) -> None:
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
    check_groups(args)
    if args.score_func not in ("softmax", "sigmoid"):
        raise ConfigError(f"MoE score_func='{args.score_func}' is not softmax or sigmoid; choose one of them")


def check_groups(args: MoEArgs) -> None:
    """top_k within the experts; group-limited routing: groups split the experts evenly, at least two
    each (a group scores its two best), and the chosen groups hold at least top_k experts."""
    if not 0 < args.top_k <= args.num_experts:
        raise ConfigError(
            f"the MoE flavor routes each token to top_k={args.top_k} of num_experts={args.num_experts} experts; "
            f"choose 1 <= top_k <= {args.num_experts}"
        )
    n_group, topk_group = args.n_group, args.topk_group
    if n_group < 1 or args.num_experts % n_group or (n_group > 1 and args.num_experts // n_group < 2):
        raise ConfigError(
            f"n_group={n_group} must divide num_experts={args.num_experts} into groups of 2 or more experts; "
            "choose such a divisor (1: no group limit)"
        )
    if not 1 <= topk_group <= n_group:
        raise ConfigError(f"topk_group={topk_group} must be between 1 and n_group={n_group}; choose 1 <= topk_group <= {n_group}")
    if topk_group * (args.num_experts // n_group) < args.top_k:
        raise ConfigError(
            f"topk_group={topk_group} groups of {args.num_experts // n_group} experts hold fewer than top_k={args.top_k}; "
            "raise topk_group or lower top_k"
        )


def check_hf_exportable(args: MoEArgs) -> None:
    """ConfigError, before any training, when the model has no Hugging Face architecture to export to:
    a MoE flavor must have Qwen3-MoE's (and no expert bias, which Qwen3MoeForCausalLM lacks)."""
    differences = [
        (not args.qk_norm, "no q/k head norms"), (args.num_shared_experts, "shared experts"),
        (args.score_func != "softmax", f"{args.score_func} scores"), (args.route_scale != 1.0, "a route scale"),
        (args.rope_scaling, "Llama 3.1 RoPE scaling"), (args.n_group > 1, "group-limited routing"), (args.load_balance_coeff, "an expert bias (model.moe_load_balance_coeff)"),
        (args.score_before_experts, "routing weights on the experts' inputs"),
    ]
    if found := [what for differs, what in differences if differs]:
        raise ConfigError(
            f"this MoE model has {', '.join(found)}, which Qwen3MoeForCausalLM (the Hugging Face architecture "
            "titanlite exports MoE models as) does not; export a Qwen3-MoE flavor (qwen3_30b_a3b, qwen3_235b_a22b, "
            "debugmoe_qwen3) trained with model.moe_load_balance_coeff=0"
        )


def check_config(model, args: MoEArgs, heads_from_dim: bool = True) -> None:
    """The [model] keys of this family's own (`model`: the config's Model section), and the shapes
    (`args`: the flavor's, as model.flavor_overrides changes them; `heads_from_dim`: common/args.py's
    check_shapes)."""
    check_overridden(model, args, lambda a: check_shapes(a, heads_from_dim), check_groups)
    for name in ("moe_load_balance_coeff", "moe_aux_loss_coeff"):
        value = getattr(model, name)
        if value is not None and value < 0:
            raise ConfigError(f"model.{name}={value} must be >= 0 (0 = off; none = the flavor's)")
