"""The DeepSeek-V3 family on one process: published sizes, the logits of transformers'
DeepseekV3ForCausalLM (import and export, group-limited routing and the route scale exercised),
DeepSeek's float8 release format, YaRN, and the shape checks. Layouts: test_parallel_parity.py."""

import json
import math
import re

import pytest
import torch

from helpers import launch, random_hf_model, tiny_args
from titanlite.config import ConfigError, parse_args
from titanlite.models import build_model, model_args

try:
    import transformers
except ImportError:
    transformers = None
# Only the comparisons with transformers' model need it; the others run without it.
needs_transformers = pytest.mark.skipif(transformers is None, reason="transformers is not installed (pip install -e '.[test]')")


# Published totals and activated parameters in billions (DeepSeek-V2-Lite's and V3's model cards;
# DeepSeek counts activated parameters without the embedding). V3's release adds 14B for its MTP
# module, which stores the embedding and output head again.
@pytest.mark.parametrize("flavor, total, active, mtp", [("16B", 15.7, 2.4, 0.0), ("671B", 671.0, 37.0, 14.0)])
def test_flavors_have_the_published_sizes(flavor, total, active, mtp):
    args = model_args("deepseek_v3", flavor, 0, 4096)
    model = build_model("deepseek_v3", args)
    assert model.num_params() == args.num_params() + args.mtp_params()  # the planner counts from the shapes alone
    assert args.num_params() / 1e9 == pytest.approx(total, rel=0.01)
    assert args.num_params(exclude_embedding=True, active=True) / 1e9 == pytest.approx(active, rel=0.03)
    assert args.mtp_params(with_shared=True) / 1e9 == pytest.approx(mtp, rel=0.05, abs=1e-9)


def hf_config(**overrides):
    """A small DeepseekV3Config: 8 experts in 4 groups of which 2 are chosen, sigmoid scores scaled by 2.5."""
    settings = dict(
        vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
        kv_lora_rank=24, q_lora_rank=40, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=4, topk_group=2,
        num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=64,
        rms_norm_eps=1e-6, initializer_range=0.1, num_nextn_predict_layers=0,
    )
    return transformers.DeepseekV3Config(**(settings | overrides))


def our_args_pairs(config, **overrides) -> list[str]:
    """model.flavor_overrides giving the shapes of a DeepseekV3Config."""
    c = config
    pairs = dict(
        dim=c.hidden_size, n_heads=c.num_attention_heads, n_kv_heads=c.num_attention_heads,
        dense_hidden_dim=c.intermediate_size, moe_hidden_dim=c.moe_intermediate_size, num_shared_experts=c.n_shared_experts,
        num_experts=c.n_routed_experts, route_scale=c.routed_scaling_factor, kv_lora_rank=c.kv_lora_rank,
        q_lora_rank=c.q_lora_rank or 0, qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
        qk_nope_head_dim=c.qk_nope_head_dim, n_group=c.n_group, topk_group=c.topk_group, top_k=c.num_experts_per_tok,
        n_dense_layers=c.first_k_dense_replace, mtp_depth=0,
    ) | overrides
    return [f"{k}={v}" for k, v in pairs.items()]


def our_cli(config, **overrides) -> list[str]:
    """The [model] settings of a DeepseekV3Config's shapes, as a user would write them."""
    pairs = ",".join(our_args_pairs(config, **overrides))
    return ["--model.name", "deepseek_v3", "--model.n_layers", str(config.num_hidden_layers), "--model.flavor_overrides", pairs]


def our_args(config, **overrides):
    """The titanlite args of the same shapes."""
    model = parse_args(our_cli(config, **overrides)).model
    return model_args("deepseek_v3", "debugmodel", config.vocab_size, config.max_position_embeddings, model.n_layers, model)


def random_reference(config):
    reference = random_hf_model(transformers.DeepseekV3ForCausalLM, config)
    with torch.no_grad():  # and a nonzero expert bias, so a misplaced one shows
        for name, b in reference.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    return reference


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.7}


@needs_transformers
@pytest.mark.parametrize("variant", ["q_lora", "no_q_lora_yarn"])
def test_hugging_face_import_and_export_match_transformers(variant, tmp_path):
    """A random DeepseekV3ForCausalLM imports with its logits (fp32, 1e-4), and our model exports to
    weights transformers loads with the same logits. Group-limited routing changes the result here."""
    from titanlite.models.deepseek_v3.hf import save_hf
    from titanlite.models.deepseek_v3.model import DeepSeekV3Transformer
    from titanlite.models.hf import load_hf

    if variant == "q_lora":
        config, extra = hf_config(), {}
    else:  # V2-Lite's attention (no query compression) with YaRN past 16 positions, mscale != mscale_all_dim
        config = hf_config(q_lora_rank=None, rope_parameters=YARN)
        extra = dict(yarn_factor=4.0, yarn_original_seq_len=16, yarn_mscale=0.9, yarn_mscale_all_dim=0.7)
    reference = random_reference(config)
    reference.save_pretrained(str(tmp_path / "hf"))
    args = our_args(config, **extra)
    ours = DeepSeekV3Transformer(args).eval()
    ours.load_state_dict(load_hf(tmp_path / "hf"))
    tokens = torch.randint(0, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
        torch.testing.assert_close(ours(tokens), expected, rtol=1e-4, atol=1e-4)
        unlimited = DeepSeekV3Transformer(our_args(config, topk_group=4, **extra)).eval()
        unlimited.load_state_dict(ours.state_dict())
        assert (unlimited(tokens) - expected).abs().max() > 1e-2  # the group limit changed some token's experts

    state = ours.state_dict()
    save_hf(lambda names: {n: state[n] for n in names}, {n: w.numel() for n, w in state.items()}, args, tmp_path / "out", torch.float32)
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, expected, rtol=1e-4, atol=1e-4)


@needs_transformers
def test_float8_release_weights_are_multiplied_out_by_their_block_scales(tmp_path):
    """DeepSeek-V3's release format: float8_e4m3fn weights with a float32 weight_scale_inv per 128x128
    block (edge blocks partial). Import gives weight * scale, block by block."""
    from safetensors.torch import save_file

    from titanlite.models.hf import load_hf

    config = hf_config(hidden_size=160, num_hidden_layers=1, first_k_dense_replace=1, intermediate_size=200)
    reference = random_reference(config)
    reference.save_pretrained(str(tmp_path / "hf"))
    weights = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"] if (
        tmp_path / "hf" / "model.safetensors.index.json").exists() else None
    assert weights is None
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    gen = torch.Generator().manual_seed(2)
    expected = {}
    for name in ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.self_attn.kv_b_proj.weight"]:
        rows, cols = tensors[name].shape
        scale_inv = torch.rand(-(-rows // 128), -(-cols // 128), generator=gen) + 0.5
        fp8 = (tensors[name] * 100).to(torch.float8_e4m3fn)
        full = torch.empty(rows, cols)
        for i in range(rows):  # the formula, element by element over rows
            full[i] = fp8[i].float() * scale_inv[i // 128].repeat_interleave(128)[:cols]
        tensors[name], tensors[name.replace(".weight", ".weight_scale_inv")] = fp8, scale_inv
        expected[name] = full
    (tmp_path / "hf" / "model.safetensors").unlink()
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    state = load_hf(tmp_path / "hf")
    assert torch.equal(state["layers.0.feed_forward.w1.weight"], expected["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(state["layers.0.attention.wkv_b.weight"], expected["model.layers.0.self_attn.kv_b_proj.weight"])
    # The trainer's checks read this format too: config.json, then the shapes from the headers (float8
    # weights multiplied out on the meta device), and a float8 weight of another shape is refused.
    from titanlite.checkpoint.hf import check_hf_tensors, read_hf_config
    from titanlite.models.deepseek_v3.hf import check_hf_shapes, iter_hf
    from titanlite.models.deepseek_v3.model import DeepSeekV3Transformer

    check_hf_shapes(read_hf_config(tmp_path / "hf")[0], our_args(config), tmp_path / "hf")
    check_hf_tensors(iter_hf, tmp_path / "hf", DeepSeekV3Transformer, our_args(config))
    kv_b = "model.layers.0.self_attn.kv_b_proj.weight"
    short = tensors | {kv_b: tensors[kv_b][:-8], kv_b + "_scale_inv": tensors[kv_b + "_scale_inv"]}
    save_file(short, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    rows, cols = tensors[kv_b].shape
    with pytest.raises(ConfigError, match=re.escape(f"gives layers.0.attention.wkv_b.weight shape [{rows - 8}, {cols}], "
                                                     f"the model being trained [{rows}, {cols}]")):
        check_hf_tensors(iter_hf, tmp_path / "hf", DeepSeekV3Transformer, our_args(config))

    del tensors["model.layers.0.mlp.gate_proj.weight_scale_inv"]
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="float8 weight model.layers.0.mlp.gate_proj.weight without .*weight_scale_inv"):
        load_hf(tmp_path / "hf")


@pytest.mark.parametrize("pairs, message", [
    ("n_group=4,topk_group=5", "topk_group=5 must be between 1 and n_group=4"),
    ("n_group=3", "n_group=3 must divide num_experts=8"),
    ("kv_lora_rank=0", "needs kv_lora_rank > 0"),
    ("qk_rope_head_dim=15", "qk_rope_head_dim=15 must be even"),
    ("n_group=4,topk_group=1,top_k=3", "topk_group=1 groups of 2 experts hold fewer than top_k=3"),
    ("kv_rank=3", "model.flavor_overrides entry 'kv_rank=3' is not name=value with a name of the flavor's shape"),
    ("n_group=two", "'two' is not a valid int for n_group"),
    ("v_head_dim=64", "v_head_dim=64 is wider than the query/key head"),
    ("max_seq_len=16", "max_seq_len has its own key; set training.seq_len instead"),
])
def test_bad_shapes_are_refused_before_launch(pairs, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(["--model.name", "deepseek_v3", "--model.flavor_overrides", pairs])


def test_multi_token_prediction_loss_follows_deepseeks_formula(tmp_path):
    """L = L_main + lambda/D sum_k L_MTP^k, L_MTP^k = -1/T sum_i log P_i^k[t_(i+k+1)] over the positions
    whose target lies in the window: computed here by hand from the model's modules, each depth on
    the sequence cut to its T-k positions (causal attention: the positions after cannot matter), each
    depth reading the hidden state the head before it read (normed). Norm weights are random, so a
    depth fed the un-normed state would differ. The trainer's loss (and gradients) must agree."""
    import torch.distributed as dist

    from helpers import tiny_args
    from titanlite.loss import cross_entropy_sum
    from titanlite.trainer import Trainer

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        (tmp_path / "c.jsonl").write_text('{"text": "unused"}\n')
        overrides = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--model.flavor_overrides",
                     "mtp_depth=2,mtp_loss_weight=0.3", "--model.n_layers", "2", "--model.moe_load_balance_coeff", "0"]
        trainer = Trainer(parse_args(tiny_args(tmp_path / "c.jsonl", tmp_path, *overrides)), torch.device("cpu"))
        model = trainer.model_parts[0]
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
        tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(3))
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        b, s = inputs.shape

        trainer.loss_scale = b * s
        loss = trainer.forward(inputs, labels, backward=True)
        ours = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()

        h = model.tok_embeddings(inputs)
        for layer in model.layers.values():
            h = layer(h, model.rope)
        h = model.norm(h)
        by_hand = cross_entropy_sum(model.output(h), labels) / (b * s)
        depths = []
        for k in (1, 2):
            h = h[:, : s - k]  # position i of depth k reads the token k ahead and predicts the one after
            module = model.mtp[str(k - 1)]
            h = module.norm(module(h, model.tok_embeddings(tokens[:, k : s]), model.rope, None))
            depths.append(cross_entropy_sum(model.output(h), tokens[:, k + 1 : s + 1]) / (b * s))
        by_hand = by_hand + 0.3 / 2 * sum(depths)
        by_hand.backward()
        torch.testing.assert_close(loss, by_hand.detach(), rtol=1e-6, atol=1e-6)  # forward returns the objective
        torch.testing.assert_close(trainer.mtp_loss, sum(depths).detach() / 2, rtol=1e-6, atol=1e-6)
        for name, p in model.named_parameters():
            torch.testing.assert_close(ours[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
    finally:
        dist.destroy_process_group()


@needs_transformers
def test_mtp_layers_round_trip_as_deepseeks_layer_after_the_model_and_may_be_absent(tmp_path):
    """Export writes MTP depth k as layer n_layers + k in DeepSeek's names (enorm, hnorm, eh_proj,
    shared_head.norm, the block, and copies of the embedding and head); import reads it back into the
    MTP modules. transformers' model (which has no MTP) loads the export with the same logits. A
    Hugging Face file without MTP layers loads into a model with them, which keep their initialization."""
    import torch.distributed as dist

    from helpers import tiny_args
    from titanlite.models.deepseek_v3.hf import save_hf
    from titanlite.models.deepseek_v3.model import DeepSeekV3Transformer
    from titanlite.models.hf import load_hf
    from titanlite.trainer import Trainer

    config = hf_config()
    args = our_args(config, mtp_depth=2)
    torch.manual_seed(0)
    ours = DeepSeekV3Transformer(args)
    ours.init_weights(seed=5)
    state = ours.state_dict()
    save_hf(lambda names: {n: state[n] for n in names}, {n: w.numel() for n, w in state.items()}, args, tmp_path / "out", torch.float32)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"model.layers.4.enorm.weight", "model.layers.4.shared_head.norm.weight", "model.layers.3.eh_proj.weight",
            "model.layers.4.mlp.experts.7.down_proj.weight", "model.layers.3.embed_tokens.weight",
            "model.layers.4.shared_head.head.weight", "model.layers.3.self_attn.kv_b_proj.weight"} <= names
    back = load_hf(tmp_path / "out")
    assert back.keys() == state.keys() and all(torch.equal(back[n], w) for n, w in state.items())
    tokens = torch.randint(0, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    reference = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    without_mtp = DeepSeekV3Transformer(our_args(config)).eval()
    without_mtp.load_state_dict({n: w for n, w in state.items() if not n.startswith("mtp.")})
    with torch.no_grad():
        torch.testing.assert_close(reference(tokens).logits, without_mtp(tokens), rtol=1e-4, atol=1e-4)

    # transformers' own file has no MTP layers: the trainer's MTP modules keep their initialization.
    random_reference(config).save_pretrained(str(tmp_path / "hf"))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        (tmp_path / "c.jsonl").write_text('{"text": "unused"}\n')
        cli = [*our_cli(config, mtp_depth=1), "--training.seq_len", "64"]
        trainer = Trainer(parse_args(tiny_args(tmp_path / "c.jsonl", tmp_path, *cli)), torch.device("cpu"))
        model = trainer.model_parts[0]
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        trainer.checkpointer.load_hf_weights(tmp_path / "hf")
        hf_state = load_hf(tmp_path / "hf")
        for name, p in model.named_parameters():
            expected = initial[name] if name.startswith("mtp.") else hf_state[name]
            assert torch.equal(p.detach(), expected), name
        # A file whose routing or RoPE differs from the model's is refused, naming the key.
        config_json = tmp_path / "hf" / "config.json"
        original = json.loads(config_json.read_text())
        for change, words in [({"routed_scaling_factor": 1.0}, "routed_scaling_factor=1.0"),
                              ({"rope_parameters": YARN}, "rope_scaling.factor=4.0, the model being trained yarn_factor=1.0")]:
            config_json.write_text(json.dumps(original | change))
            with pytest.raises(ConfigError, match=words):
                trainer.checkpointer.load_hf_weights(tmp_path / "hf")
    finally:
        dist.destroy_process_group()


def test_float8_skips_the_router_and_ac_wraps_the_mtp_block():
    """float8 converts MLA's projections, the dense SwiGLU and the shared experts (DeepSeek-V3 trained
    its GEMMs in float8), not the router; activation checkpointing wraps the MTP block as it does
    the model's blocks."""
    from types import SimpleNamespace

    from titanlite.float8 import Float8Linear, convert_to_float8
    from titanlite.models import FAMILIES
    from titanlite.models.deepseek_v3.model import DeepSeekV3Transformer
    from titanlite.parallel.activation_checkpoint import apply_ac

    plan = FAMILIES["deepseek_v3"].plan
    model = DeepSeekV3Transformer(model_args("deepseek_v3", "debugmodel", 256, 32))
    convert_to_float8(model, "tensorwise", ["output", *plan.float8_excluded], True)
    converted = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert {"layers.0.attention.wq_b", "layers.0.attention.wkv_b", "layers.0.attention.wo", "layers.0.feed_forward.w1",
            "layers.1.feed_forward.shared_experts.w2", "mtp.0.block.attention.wkv_b", "mtp.0.eh_proj"} <= converted
    assert "layers.1.attention.wq_a" in converted and "layers.1.attention.wkv_a" in converted
    assert not converted & {"layers.1.feed_forward.router.gate", "mtp.0.block.feed_forward.router.gate", "output"}

    ac = SimpleNamespace(mode="full", selective_ac_option="op", preserve_rng_state=False, determinism_check="default",
                         debug=False, early_stop=True)
    apply_ac(model, plan, ac)
    assert hasattr(model.mtp["0"].block, "_checkpoint_wrapped_module") and hasattr(model.layers["3"], "_checkpoint_wrapped_module")


def test_mtp_module_joins_the_normed_embedding_and_hidden_state_embedding_first():
    """eh_proj's first `dim` input columns read enorm(embedding of the token ahead), the rest hnorm(hidden
    state), as DeepSeek's released layer is laid out: computed here with the weight split by hand,
    distinct norm weights, and the block's input caught on its way in."""
    from titanlite.models.deepseek_v3.model import MultiTokenPrediction

    args = model_args("deepseek_v3", "debugmodel", 256, 16)
    module = MultiTokenPrediction(args.n_layers, args)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.5) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    h, embedded = torch.randn(2, 16, args.dim), torch.randn(2, 16, args.dim)
    seen = []
    module.block.register_forward_pre_hook(lambda block, inputs: seen.append(inputs[0]))
    module(h, embedded, torch.zeros(16, args.rope_dim), None)

    def rms_normed(x, weight):
        return x / x.pow(2).mean(-1, keepdim=True).add(args.norm_eps).sqrt() * weight

    w = module.eh_proj.weight
    expected = rms_normed(embedded, module.enorm.weight) @ w[:, : args.dim].T + rms_normed(h, module.hnorm.weight) @ w[:, args.dim :].T
    torch.testing.assert_close(seen[0], expected, rtol=1e-5, atol=1e-5)


def test_yarn_comes_from_the_flavor_never_from_the_run_lengths():
    """Whether YaRN applies is the flavor's (DeepSeek's rope_scaling), as in transformers and TorchTitan:
    V3 and V2-Lite get YaRN's frequencies and softmax mscale at any length, and a validation longer
    than training (the RoPE table grows to it, JobConfig.longest_sequence) changes neither. Expected values:
    DeepSeek's formulas, mscale = 0.1 * mscale_all_dim * ln(40) + 1 squared on the softmax, and
    frequencies turning fewer than beta_slow=1 times over 4096 positions divided by 40."""
    from titanlite.models.deepseek_v3.model import DeepSeekV3Transformer

    plain = 1.0 / 10000 ** (torch.arange(0, 64, 2) / 64)
    slow = 4096 * plain / (2 * torch.pi) < 1  # the dims YaRN interpolates fully
    for flavor, mscale_all_dim in [("671B", 1.0), ("16B", 0.707)]:
        tables = []
        for seq_len, validation in [(4096, None), (4096, 8192), (128, None), (8192, None)]:
            cli = ["--model.name", "deepseek_v3", "--model.flavor", flavor, "--model.n_layers", "1",
                   "--training.seq_len", str(seq_len), "--validation.enable", str(validation is not None).lower(),
                   "--validation.seq_len", str(validation or seq_len)]
            config = parse_args(cli)
            args = model_args("deepseek_v3", flavor, 0, config.longest_sequence, 1, config.model)
            assert args.max_seq_len == (validation or seq_len)
            expected_mscale = (0.1 * mscale_all_dim * math.log(40) + 1) ** 2
            assert args.softmax_mscale == pytest.approx(expected_mscale, rel=1e-12), (flavor, seq_len, validation)
            with torch.device("meta"):
                model = DeepSeekV3Transformer(args)
            assert model.layers["0"].attention.query_scale == args.softmax_mscale
            table = model.rope_table()[:128]
            frequencies = torch.atan2(table[1, 32:], table[1, :32])
            torch.testing.assert_close(frequencies[slow], plain[slow] / 40, rtol=1e-5, atol=0)
            tables.append(table)
        assert all(torch.equal(t, tables[0]) for t in tables[1:]), flavor
    # Plain RoPE is a flavor override away (V3's pre-training before its context extension), at any length.
    config = parse_args(["--model.name", "deepseek_v3", "--model.flavor", "671B", "--model.flavor_overrides", "yarn_factor=1"])
    args = model_args("deepseek_v3", "671B", 0, 163840, 1, config.model)
    assert not args.yarn_on and args.softmax_mscale == 1.0 and args.rope_attention_factor == 1.0


def test_yarn_is_said_at_start_up(tmp_path, corpus_jsonl):
    """YaRN is on at every length for 671B and 16B: the start-up log says so (train.py logs the args'
    `notes`), with DeepSeek's factor, original context and softmax scale ((0.1 * mscale_all_dim * ln 40 + 1)^2)."""
    for flavor, mscale_all_dim in [("671B", 1.0), ("16B", 0.707)]:
        args = model_args("deepseek_v3", flavor, 0, 4096, 1)
        scale = (0.1 * mscale_all_dim * math.log(40) + 1) ** 2
        assert args.notes == f"YaRN on: factor 40, original context 4096, softmax scale x{scale:.3f}", flavor
    assert model_args("deepseek_v3", "debugmodel", 256, 2048, 1).notes == ""  # plain RoPE: nothing to say
    # The line in a run's log: a debug model given YaRN by a flavor override (factor 4: (0.1 ln 4 + 1)^2).
    out = launch(1, tiny_args(corpus_jsonl, tmp_path / "run", "--training.steps", "1", "--model.name", "deepseek_v3", "--model.flavor",
                              "debugmodel", "--model.flavor_overrides", "yarn_factor=4"))
    assert f"YaRN on: factor 4, original context 4096, softmax scale x{(0.1 * math.log(4) + 1) ** 2:.3f}" in out.stdout + out.stderr
