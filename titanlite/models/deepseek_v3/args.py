"""DeepSeek-V3's shapes (DeepSeek's config.json files), its flavors and its checks.

Multi-head latent attention (MLA): queries from a low-rank latent (`q_lora_rank`; 0: straight from
the input, as in V2-Lite), keys and values from one shared latent of `kv_lora_rank`, each head's
query/key split into a part without position (`qk_nope_head_dim`) and a RoPE part
(`qk_rope_head_dim`, one key part shared by all heads); values have `v_head_dim`. RoPE is YaRN-scaled
when `yarn_factor` > 1 (the flavor's, from DeepSeek's rope_scaling), and YaRN's mscale sharpens the softmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from titanlite.errors import ConfigError
from titanlite.models.common.args import MoEArgs, check_overridden
from titanlite.models.moe.args import check_config as check_moe_config
from titanlite.models.moe.args import check_moe


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature: 0.1 * mscale * ln(factor) + 1 (1 without scaling)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


@dataclass(frozen=True)
class DeepSeekV3Args(MoEArgs):
    q_lora_rank: int = 1536  # 0: no query compression
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # YaRN (DeepSeek's rope_scaling): frequencies interpolated by `yarn_factor` over an original context of
    # `yarn_original_seq_len`, blended between beta_fast and beta_slow rotations. On wherever the factor
    # is > 1, at any sequence length, as transformers and TorchTitan apply it: the run's lengths (training's,
    # validation's) never switch it. yarn_factor=1: plain RoPE (V3's pre-training at 4K, before its extension).
    yarn_factor: float = 1.0
    yarn_original_seq_len: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 1.0
    # Multi-token prediction: `mtp_depth` extra modules, each predicting one token further ahead;
    # their mean loss is weighted by `mtp_loss_weight`.
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.1

    @property
    def moe_layer_count(self) -> int:
        return super().moe_layer_count + self.mtp_depth  # a MoE block per depth

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim

    @property
    def yarn_on(self) -> bool:
        return self.yarn_factor > 1

    @property
    def notes(self) -> str:
        """YaRN is on at every length where the flavor has it: said once, since nothing else shows it."""
        if not self.yarn_on:
            return ""
        return (f"YaRN on: factor {self.yarn_factor:g}, original context {self.yarn_original_seq_len}, "
                f"softmax scale x{self.softmax_mscale:.3f}")

    @property
    def softmax_mscale(self) -> float:
        """YaRN's factor on the attention logits (mscale^2 on the softmax scale)."""
        return yarn_mscale(self.yarn_factor, self.yarn_mscale_all_dim) ** 2 if self.yarn_on else 1.0

    @property
    def rope_attention_factor(self) -> float:
        """YaRN's factor on cos/sin: mscale over mscale_all_dim (1 for V3, whose two are equal)."""
        if not self.yarn_on:
            return 1.0
        return yarn_mscale(self.yarn_factor, self.yarn_mscale) / yarn_mscale(self.yarn_factor, self.yarn_mscale_all_dim)

    @property
    def attention_params(self) -> int:
        """MLA's projections and latent norms, and the block's attention norm."""
        h = self.n_heads
        if self.q_lora_rank:
            q = self.dim * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * self.qk_head_dim
        else:
            q = self.dim * h * self.qk_head_dim
        kv = self.dim * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv += self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + h * self.v_head_dim * self.dim + self.dim

    def attention_flops_per_token(self, seq_len: int) -> int:
        """QK^T over the query/key head dim and AV over the value head dim, forward and backward."""
        return 6 * self.n_layers * self.n_heads * (self.qk_head_dim + self.v_head_dim) * seq_len

    def mtp_params(self, active: bool = False, with_shared: bool = False) -> int:
        """Multi-token prediction's modules: per depth two norms, the projection joining them (2 dim
        -> dim), one MoE block and a final norm; `with_shared`: plus the embedding and output head,
        which they share with the model (DeepSeek's count stores them again)."""
        block = self.attention_params + self.feed_forward_params(self.n_layers, active)
        own = 3 * self.dim + 2 * self.dim * self.dim + block
        return self.mtp_depth * (own + (2 * self.vocab_size * self.dim if with_shared else 0))

    def flops_per_token(self, seq_len: int) -> int:
        """The model's, plus each MTP depth's module and output head (attention included)."""
        mtp = self.mtp_params(active=True) + self.mtp_depth * self.dim * self.vocab_size
        mtp_attention = self.mtp_depth * 6 * self.n_heads * (self.qk_head_dim + self.v_head_dim) * seq_len
        return super().flops_per_token(seq_len) + 6 * mtp + mtp_attention


# DeepSeek's config.json shapes. 16B is DeepSeek-V2-Lite (softmax routing without groups or bias,
# no query compression); 671B is DeepSeek-V3. debugmodel trains on CPU with every feature on.
DEEPSEEK_V3_FLAVORS = {
    "debugmodel": DeepSeekV3Args(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=8, vocab_size=0, norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=False, max_seq_len=2048, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, num_experts=8, num_shared_experts=1, top_k=2, moe_hidden_dim=128,
        n_dense_layers=1, dense_hidden_dim=512, score_func="sigmoid", route_norm=True, route_scale=2.5,
        n_group=4, topk_group=2, mtp_depth=1, attn_type="sdpa",
    ),
    "16B": DeepSeekV3Args(
        dim=2048, n_layers=27, n_heads=16, n_kv_heads=16, vocab_size=102400, norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=False, max_seq_len=163840, q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, num_experts=64, num_shared_experts=2, top_k=6, moe_hidden_dim=1408,
        n_dense_layers=1, dense_hidden_dim=10944, score_func="softmax", route_norm=False, route_scale=1.0,
        load_balance_coeff=0.0, yarn_factor=40.0, yarn_mscale=0.707, yarn_mscale_all_dim=0.707,
    ),
    "671B": DeepSeekV3Args(
        dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, vocab_size=129280, norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=False, max_seq_len=163840, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, num_experts=256, num_shared_experts=1, top_k=8, moe_hidden_dim=2048,
        n_dense_layers=3, dense_hidden_dim=18432, score_func="sigmoid", route_norm=True, route_scale=2.5,
        n_group=8, topk_group=4, yarn_factor=40.0, mtp_depth=1, mtp_loss_weight=0.1,
    ),
}


def check_deepseek_v3(args: DeepSeekV3Args, dims) -> None:
    """The MoE checks (experts over ep, heads over tp), and MLA's shapes."""
    check_moe(args, dims)
    check_shapes(args)


def check_shapes(args: DeepSeekV3Args) -> None:
    """MLA and routing shapes that cannot work, whatever the layout."""
    for name in ("q_lora_rank", "qk_nope_head_dim", "mtp_depth", "mtp_loss_weight"):
        if getattr(args, name) < 0:
            raise ConfigError(f"{name}={getattr(args, name)} must be >= 0" + (" (0: no query latent)" if name == "q_lora_rank" else ""))
    if args.v_head_dim <= 0:
        raise ConfigError(f"v_head_dim={args.v_head_dim} must be > 0 (DeepSeek's: 128)")
    if args.kv_lora_rank <= 0:
        raise ConfigError(
            f"DeepSeek-V3's multi-head latent attention needs kv_lora_rank > 0 (got {args.kv_lora_rank}): keys and "
            "values come from that latent; use a flavor with kv_lora_rank >= 1 (DeepSeek's: 512)"
        )
    if args.qk_rope_head_dim <= 0 or args.qk_rope_head_dim % 2:
        raise ConfigError(
            f"qk_rope_head_dim={args.qk_rope_head_dim} must be even and > 0: RoPE rotates pairs of dims; "
            "use an even size (DeepSeek's: 64)"
        )
    if args.v_head_dim > args.qk_head_dim:
        raise ConfigError(
            f"v_head_dim={args.v_head_dim} is wider than the query/key head ({args.qk_nope_head_dim} + {args.qk_rope_head_dim}); "
            "MLA pads values to the query/key head dim: use v_head_dim <= qk_nope_head_dim + qk_rope_head_dim"
        )
    if args.n_kv_heads != args.n_heads:
        raise ConfigError(f"MLA gives every head its own key and value: n_kv_heads={args.n_kv_heads} must equal n_heads={args.n_heads}")


def check_hf_exportable(args: DeepSeekV3Args) -> None:
    """DeepseekV3ForCausalLM routes by sigmoid scores, weights the experts' outputs, and always has
    shared experts."""
    if args.score_func != "sigmoid" or not args.num_shared_experts or args.score_before_experts:
        raise ConfigError(
            f"this DeepSeek model routes by {args.score_func} scores with {args.num_shared_experts} shared experts"
            f"{', weighting the experts inputs' if args.score_before_experts else ''}, and DeepseekV3ForCausalLM (the "
            "Hugging Face architecture it exports as) by sigmoid scores with shared experts, weighting their outputs; "
            "export a flavor with all three (671B, debugmodel), or set checkpoint.last_save_in_hf=false"
        )


def check_config(model, args: DeepSeekV3Args) -> None:
    """The MoE family's [model] keys and routing shapes (heads of their own sizes), and MLA's shapes."""
    check_moe_config(model, args, heads_from_dim=False)
    check_overridden(model, args, check_shapes)
