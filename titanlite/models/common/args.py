"""Transformer shapes the families share: the dense decoder (ModelArgs) and its mixture-of-experts
form (MoEArgs), with their parameter and FLOP counts (no torch import: run_train.sh checks layouts
against them before launching). Each family's flavors and checks sit in its own folder."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from titanlite.errors import ConfigError


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    vocab_size: int = 128256  # 0 = take it from the tokenizer
    multiple_of: int = 1024  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = 1.3
    dense_hidden_dim: int = 0  # the dense SwiGLU's hidden size as published; 0: from dim, multiple_of, ffn_dim_multiplier
    tie_embeddings: bool = False  # the output projection is the embedding's weight (Qwen3's small models)
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: bool = True  # Llama 3.1 long-context frequency scaling (Llama 4 Scout's, with its factors)
    rope_scaling_factor: float = 8.0  # low frequencies slow down by this much
    rope_high_freq_factor: float = 4.0  # wavelengths under original context / this keep their frequency
    max_seq_len: int = 131072
    depth_init: bool = True  # scale output projections' init std by depth
    head_dim_override: int = 0  # 0: dim / n_heads (Qwen3's heads are wider than that)
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3)
    attention_bias: bool = False  # q/k/v/o projections with biases (gpt-oss)
    # TorchTitan's names. block_causal: attention within each packed document (common/attention.py);
    # attn_type: its kernel, flex (CUDA; SDPA with a boolean mask elsewhere) or sdpa (varlen,
    # TorchTitan's other one, runs on flex here). Causal attention runs SDPA's causal kernel.
    attn_mask_type: str = "causal"
    attn_type: str = "flex"
    # q/k/v in one matmul, and MLA's down projections in one (the parameters stay separate; common/linear.py).
    fused_projections: bool = False

    @property
    def masked_attention(self) -> bool:
        """Attention runs with a mask (not SDPA's causal kernel): documents, or (Llama 4) chunks."""
        return self.attn_mask_type == "block_causal"

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.dim // self.n_heads

    @property
    def notes(self) -> str:
        """What the run's start-up log says of this model beyond its name and size ('': nothing)."""
        return ""

    @property
    def rope_dim(self) -> int:
        """The dims of each query/key head that RoPE rotates."""
        return self.head_dim

    @property
    def ffn_hidden_dim(self) -> int:
        if self.dense_hidden_dim:
            return self.dense_hidden_dim
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def attention_params(self) -> int:
        """wq, wk, wv, wo (and their biases), the attention norm (and the q/k head norms)."""
        q_dim = self.n_heads * self.head_dim
        biases = q_dim + 2 * self.kv_dim + self.dim if self.attention_bias else 0
        return 2 * self.dim * q_dim + 2 * self.dim * self.kv_dim + self.dim + (2 * self.head_dim if self.qk_norm else 0) + biases

    def feed_forward_params(self, layer: int, active: bool = False) -> int:
        """The FFN norm and SwiGLU (w1, w2, w3) of one block."""
        return self.dim + 3 * self.dim * self.ffn_hidden_dim

    @property
    def block_params(self) -> int:
        """One TransformerBlock (the last one: a MoE block where blocks differ)."""
        return self.attention_params + self.feed_forward_params(self.n_layers - 1)

    def num_params(self, exclude_embedding: bool = False, active: bool = False) -> int:
        """All weights, or with `active` those one token uses (the routed experts it visits). A tied
        output is the embedding: counted once, and kept when the embedding is excluded (its matmul runs)."""
        embedding = 0 if exclude_embedding else self.vocab_size * self.dim
        blocks = sum(self.attention_params + self.feed_forward_params(i, active) for i in range(self.n_layers))
        output = 0 if self.tie_embeddings and not exclude_embedding else self.dim * self.vocab_size
        return embedding + blocks + self.dim + output  # + norm

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 per non-embedding weight it uses (a MoE token: its experts'
        only), plus attention scores and values.

        12 * layers * heads * head_dim * seq_len counts QK^T and AV (2 matmuls x 2 FLOPs x 3 for
        forward + backward) without halving for the causal mask, as PaLM, nanoGPT and TorchTitan do.
        """
        weights = self.num_params(exclude_embedding=True, active=True)
        return 6 * weights + self.attention_flops_per_token(seq_len)

    def attention_flops_per_token(self, seq_len: int) -> int:
        return 12 * self.n_layers * self.n_heads * self.head_dim * seq_len

    def with_vocab(self, tokenizer_vocab: int) -> "ModelArgs":
        """Flavors with vocab_size 0 take the tokenizer's, padded to a multiple of 64 so the embedding
        and output split evenly under tensor parallel (and matmuls align)."""
        return self if self.vocab_size else replace(self, vocab_size=-(-tokenizer_vocab // 64) * 64)


def check_tied(args: ModelArgs, dims) -> None:
    """Tied embeddings live on the first and the last pipeline stage at once: refused there (TorchTitan too)."""
    if args.tie_embeddings and dims.pp > 1:
        raise ConfigError(
            f"parallelism.pipeline_parallel_degree={dims.pp} with tied embeddings (this flavor's output projection is its "
            "embedding, which the first and last stages would each hold); set it to 1, or add "
            "tie_embeddings=false to model.flavor_overrides"
        )


def check_heads(args: ModelArgs, tp: int) -> None:
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
    score_func: str = "softmax"  # router scores: softmax or sigmoid
    route_norm: bool = False  # renormalize the top-k scores to sum to 1
    route_scale: float = 1.0
    # Group-limited routing (DeepSeek-V3): the experts form `n_group` groups, and each token picks its
    # top_k among the `topk_group` groups whose two best experts score highest. 1 and 1: no limit.
    n_group: int = 1
    topk_group: int = 1
    # DeepSeek-V3's auxiliary-loss-free balancing: after each optimizer step the expert bias (added to
    # the scores for choosing, never for weighting) moves by this much towards balance. 0: off.
    load_balance_coeff: float = 1e-3
    aux_loss_coeff: float = 0.0  # the balance loss's coefficient; 0: off
    # "sequence": DeepSeek-V3's, per sequence and summed over layers; "global_batch": Qwen's, over each
    # forward's tokens on all data ranks (transformers' load_balancing_loss_func per layer), averaged over layers.
    aux_loss_type: str = "sequence"
    use_grouped_mm: bool = True  # torch._grouped_mm for the experts (False: an exact loop over experts)
    score_before_experts: bool = False  # the routing weight scales each token's input to its expert (Llama 4), not its output
    router_bias: bool = False  # the router's gate has a bias (gpt-oss)

    def is_moe(self, layer: int) -> bool:
        return layer >= self.n_dense_layers

    @property
    def moe_layer_count(self) -> int:
        return sum(self.is_moe(i) for i in range(self.n_layers))

    def feed_forward_params(self, layer: int, active: bool = False) -> int:
        if not self.is_moe(layer):
            return super().feed_forward_params(layer)
        experts = (self.top_k if active else self.num_experts) + self.num_shared_experts
        router = self.dim * self.num_experts + (self.num_experts if self.router_bias else 0)
        return self.dim + router + experts * self.expert_params

    @property
    def expert_params(self) -> int:
        """One expert's SwiGLU."""
        return 3 * self.dim * self.moe_hidden_dim


def check_shapes(args: ModelArgs, heads_from_dim: bool = True) -> None:
    """Shapes no model can have, whatever the layout (every flavor obeys these; model.flavor_overrides
    can break them). `heads_from_dim`: attention heads split dim (not MLA's, whose heads have sizes of
    their own)."""
    sizes = ["dim", "n_heads", "n_kv_heads", "multiple_of", "norm_eps", "rope_theta"]
    counts = ["head_dim_override", "dense_hidden_dim"]
    if isinstance(args, MoEArgs):
        sizes += ["num_experts", "moe_hidden_dim", "route_scale"]
        counts += ["num_shared_experts", "n_dense_layers"]
    for name in sizes:
        if not getattr(args, name) > 0:
            raise ConfigError(f"{name}={getattr(args, name)} must be > 0")
    for name in counts:
        if getattr(args, name) < 0:
            raise ConfigError(f"{name}={getattr(args, name)} must be >= 0 (0: none, or the default)")
    if args.ffn_dim_multiplier is not None and args.ffn_dim_multiplier <= 0:
        raise ConfigError(f"ffn_dim_multiplier={args.ffn_dim_multiplier} must be > 0 (or none)")
    if heads_from_dim:
        if not args.head_dim_override and args.dim % args.n_heads:
            raise ConfigError(f"n_heads={args.n_heads} must divide dim={args.dim}: each head is dim / n_heads wide "
                              "(or set head_dim_override)")
        if args.n_heads % args.n_kv_heads:
            raise ConfigError(f"n_kv_heads={args.n_kv_heads} must divide n_heads={args.n_heads}: each kv head serves "
                              "n_heads / n_kv_heads query heads")
        if args.head_dim % 2:
            raise ConfigError(f"the head dim {args.head_dim} (n_heads={args.n_heads}, dim={args.dim}) must be even: RoPE "
                              "rotates pairs")
    if isinstance(args, MoEArgs) and args.score_func not in ("softmax", "sigmoid"):
        raise ConfigError(f"score_func='{args.score_func}' must be softmax or sigmoid")


def check_overridden(model, args: ModelArgs, *checks) -> None:
    """The family's shape `checks` on the flavor as model.flavor_overrides changes it (`model`: the
    config's Model section): the flavors pass them, so a rule broken is the overrides'."""
    try:
        for check in checks:
            check(args)
    except ConfigError as e:
        raise ConfigError(f"model.flavor_overrides={model.flavor_overrides}: {e}") from None


# Fields the config sets through keys of their own.
SET_ELSEWHERE = {
    "max_seq_len": "training.seq_len", "n_layers": "model.n_layers", "vocab_size": "model.hf_assets_path (the tokenizer)",
    "attn_mask_type": "model.attn_mask_type", "attn_type": "model.attn_type", "fused_projections": "model.fused_projections",
    "use_grouped_mm": "model.moe_grouped_mm", "load_balance_coeff": "model.moe_load_balance_coeff",
    "aux_loss_coeff": "model.moe_aux_loss_coeff", "aux_loss_type": "model.moe_aux_loss_type",
}


def with_overrides(args: ModelArgs, pairs: list[str]) -> ModelArgs:
    """The args with `name=value` pairs (the config's model.flavor_overrides) replacing the flavor's
    fields, each value read as its field's type; ConfigError naming a pair that does not fit."""
    types = {f.name: f.type for f in fields(args) if f.name not in SET_ELSEWHERE}
    changes = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        name = name.strip()
        if name in SET_ELSEWHERE:
            raise ConfigError(f"model.flavor_overrides entry '{pair}': {name} has its own key; set {SET_ELSEWHERE[name]} instead")
        if not sep or name not in types:
            raise ConfigError(
                f"model.flavor_overrides entry '{pair}' is not name=value with a name of the flavor's shape; "
                f"names: {', '.join(types)}"
            )
        kind = types[name] if isinstance(types[name], str) else types[name].__name__
        try:
            changes[name] = _read_value(kind, text.strip())
        except ValueError:
            raise ConfigError(f"model.flavor_overrides entry '{pair}': '{text.strip()}' is not a valid {kind} for {name}")
    return replace(args, **changes)


def _read_value(kind: str, text: str):
    if kind == "bool":
        if text.lower() not in ("true", "false"):
            raise ValueError(text)
        return text.lower() == "true"
    if kind.startswith("float"):
        return None if kind.endswith("None") and text.lower() == "none" else float(text)
    return {"int": int, "str": str}[kind](text)
