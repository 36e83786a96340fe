"""gpt-oss's shapes (OpenAI's config.json files, as transformers' GptOssConfig reads them), its
flavors and its checks.

Blocks alternate between attention over a sliding window of `sliding_window` positions (block 0,
and every even block) and attention over the whole window; every head has a learned sink logit
(models/common/sinks.py); q/k/v/o have biases. RoPE is YaRN-scaled (factor 32 over a 4,096 context,
the ramp not rounded). Every block is a mixture of experts: top-4 by softmax over the chosen logits
(softmax scores renormalized over the top 4, the same numbers) from a router with a bias, and
experts with biases whose SwiGLU is clamped: gate <= limit, |up| <= limit, (up + 1) * gate *
sigmoid(alpha * gate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from titanlite.errors import ConfigError
from titanlite.models.common.args import MoEArgs, check_overridden
from titanlite.models.moe.args import check_config as check_moe_config
from titanlite.models.moe.args import check_moe


@dataclass(frozen=True)
class GptOssArgs(MoEArgs):
    sliding_window: int = 128  # the sliding blocks' queries see the keys fewer than this many positions back
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    yarn_factor: float = 32.0  # 1: plain RoPE
    yarn_original_seq_len: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0

    def is_sliding(self, layer: int) -> bool:
        return layer % 2 == 0

    @property
    def masked_attention(self) -> bool:
        return True  # the sliding blocks' windows

    @property
    def rope_attention_factor(self) -> float:
        """YaRN's factor on cos/sin: 0.1 ln(factor) + 1."""
        return 0.1 * math.log(self.yarn_factor) + 1.0 if self.yarn_factor > 1 else 1.0

    @property
    def notes(self) -> str:
        return f"sliding window {self.sliding_window} on even blocks, attention sinks, YaRN x{self.yarn_factor:g}"

    @property
    def attention_params(self) -> int:
        return super().attention_params + self.n_heads  # + each head's sink

    @property
    def expert_params(self) -> int:
        return super().expert_params + 2 * self.moe_hidden_dim + self.dim  # + biases

    def attention_flops_per_token(self, seq_len: int) -> int:
        """As ModelArgs counts them, each sliding block's keys limited to its window."""
        keys = sum(min(seq_len, self.sliding_window) if self.is_sliding(i) else seq_len for i in range(self.n_layers))
        return 12 * self.n_heads * self.head_dim * keys


def _gpt_oss(**shape) -> GptOssArgs:
    common = dict(
        dim=2880, n_heads=64, n_kv_heads=8, head_dim_override=64, vocab_size=201088, norm_eps=1e-5,
        rope_theta=150000.0, rope_scaling=False, top_k=4, moe_hidden_dim=2880, route_norm=True,
        router_bias=True, attention_bias=True, max_seq_len=131072, load_balance_coeff=0.0,
        aux_loss_coeff=0.001, aux_loss_type="global_batch",  # HF's router_aux_loss_coef
    )
    return GptOssArgs(**(common | shape))


GPT_OSS_FLAVORS = {
    # Every feature on, on CPU: windows of 16 on blocks 0 and 2, sinks, biases, YaRN, top-4 of 8
    # clamped experts; heads (8 x 32) wider than dim, as gpt-oss's are (64 x 64 against 2880).
    "debugmodel": _gpt_oss(
        dim=192, n_layers=4, n_heads=8, n_kv_heads=4, head_dim_override=32, vocab_size=0, num_experts=8,
        moe_hidden_dim=128, sliding_window=16, max_seq_len=2048,
    ),
    "20b": _gpt_oss(n_layers=24, num_experts=32),
    "120b": _gpt_oss(n_layers=36, num_experts=128),
}


def check_shapes(args: GptOssArgs) -> None:
    if args.sliding_window < 1:
        raise ConfigError(f"sliding_window={args.sliding_window} must be >= 1 (gpt-oss's: 128)")
    if args.swiglu_limit <= 0:
        raise ConfigError(f"swiglu_limit={args.swiglu_limit} must be > 0 (gpt-oss's: 7)")
    if args.yarn_factor < 1:
        raise ConfigError(f"yarn_factor={args.yarn_factor} must be >= 1 (1: plain RoPE; gpt-oss's: 32)")


def check_gpt_oss(args: GptOssArgs, dims) -> None:
    """The MoE checks; expert tensor parallel would add the experts' output bias once per tp rank."""
    check_moe(args, dims)
    if dims.etp > 1:
        raise ConfigError(
            f"parallelism.expert_tensor_parallel_degree={dims.etp}: gpt-oss's experts have output biases, which "
            "splitting each expert over tp ranks would add once per rank; set it to 1 (expert parallel borrows tp)"
        )


def check_config(model, args: GptOssArgs) -> None:
    """The MoE family's [model] keys and gpt-oss's shapes; float8 grouped GEMMs run SwiGLU experts
    without biases, not these."""
    check_moe_config(model, args)
    check_overridden(model, args, check_shapes)
    if "quantize.grouped_mm.float8" in model.converters:
        raise ConfigError(
            "model.converters has quantize.grouped_mm.float8, and gpt-oss's experts (biases, the clamped SwiGLU) "
            "do not run on float8 grouped GEMMs; leave it out (float8 linears still apply to attention)"
        )


def check_hf_exportable(args: GptOssArgs) -> None:
    """ConfigError, before any training, when GptOssForCausalLM would compute something else."""
    differences = [
        (args.load_balance_coeff, "an expert bias (model.moe_load_balance_coeff)"), (not args.route_norm, "unnormalized top-k weights"),
        (args.score_func != "softmax", f"{args.score_func} scores"), (args.route_scale != 1.0, "a route scale"),
        (args.n_group > 1, "group-limited routing"), (args.score_before_experts, "routing weights on the experts' inputs"),
        (args.num_shared_experts, "shared experts"), (args.n_dense_layers, "dense blocks"),
        (not args.attention_bias, "attention without biases"), (not args.router_bias, "a router without a bias"),
        (args.qk_norm, "q/k head norms"), (args.tie_embeddings, "tied embeddings"),
    ]
    if found := [what for differs, what in differences if differs]:
        raise ConfigError(
            f"this gpt-oss model has {', '.join(found)}, which GptOssForCausalLM (the Hugging Face architecture it "
            "exports as) does not; export a flavor as published (with model.moe_load_balance_coeff=0), or set "
            "checkpoint.last_save_in_hf=false"
        )
