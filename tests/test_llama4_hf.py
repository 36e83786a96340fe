"""Llama 4's Hugging Face mapping against transformers' Llama4ForCausalLM: export and import with the
same logits (fp32, 1e-4) on a small model with every feature that changes them (MoE and dense blocks
interleaved, a NoPE block with temperature tuning, chunked attention over 3 chunks, QK-norm, Llama 3.1
RoPE scaling), the trainer's import from a Hugging Face folder, and the refusals."""

import json
from dataclasses import replace

import pytest
import torch

from helpers import random_hf_model
from titanlite.config import ConfigError, parse_args
from titanlite.models import FAMILIES, family_of_hf_model, model_args

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")

VOCAB, SEQ_LEN = 320, 48  # 320: the byte tokenizer's vocab padded to 64 (tiny_args); 48: three chunks of 16

# Two models that differ wherever Llama 4's flavors do: Scout's (QK-norm, RoPE scaled by 16 with no
# blend band, top-1) with MoE every other block as Maverick's, and one with neither QK-norm nor
# scaling, MoE in every block and two experts per token.
VARIANTS = {
    "qk_norm_scaled_rope": dict(use_qk_norm=True, rope_scaling=True, rope_scaling_factor=16.0, rope_high_freq_factor=1.0,
                                interleave_moe_layer_step=2, top_k=1),
    "plain_rope_top2": dict(use_qk_norm=False, rope_scaling=False, interleave_moe_layer_step=1, top_k=2),
}
SHAPE = dict(dim=64, n_heads=4, n_kv_heads=2, n_layers=4, num_experts=4, moe_hidden_dim=32, dense_hidden_dim=96,
             attention_chunk_size=16, floor_scale=8.0)  # layer 3 is NoPE; its queries scale up from position 7


def our_args(variant: str, **overrides):
    return replace(model_args("llama4", "debugmodel", VOCAB, SEQ_LEN), **SHAPE | VARIANTS[variant] | overrides)


def hf_config(variant: str, **overrides) -> "transformers.Llama4TextConfig":
    """transformers' config of a variant's shapes, written out apart from the mapping under test."""
    v = VARIANTS[variant]
    rope = {"rope_type": "default", "rope_theta": 500000.0}
    if v["rope_scaling"]:
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": v["rope_scaling_factor"], "low_freq_factor": 1.0,
                "high_freq_factor": v["rope_high_freq_factor"], "original_max_position_embeddings": 8192}
    settings = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=v["top_k"],
        interleave_moe_layer_step=v["interleave_moe_layer_step"], no_rope_layer_interval=4, attention_chunk_size=16,
        use_qk_norm=v["use_qk_norm"], attn_temperature_tuning=True, floor_scale=8, attn_scale=0.1,
        rope_parameters=rope, max_position_embeddings=SEQ_LEN, rms_norm_eps=1e-5, initializer_range=0.1,
    )
    return transformers.Llama4TextConfig(**(settings | overrides))


def tokens():
    return torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))


def random_llama4(args):
    """Our model with weights wide enough that routing, temperature and chunks change the logits, and
    norms away from 1 so misplaced ones show."""
    from titanlite.models.llama4.model import Llama4Transformer

    model = Llama4Transformer(args).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5, generator=generator)
            else:
                p.normal_(0.0, 1.0 if name == "tok_embeddings.weight" else 0.1, generator=generator)
    return model


def save(model, folder, args=None, shard_bytes=2**30):
    from titanlite.models.llama4.hf import save_hf

    state = model.state_dict()
    save_hf(lambda names: {n: state[n] for n in names}, {n: w.numel() for n, w in state.items()},
            args or model.args, folder, torch.float32, shard_bytes)


def max_difference(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_loads_in_transformers_with_our_logits(variant, tmp_path):
    """Our model -> save_hf (in shards, gate_up_proj joined across them) -> Llama4ForCausalLM: the same
    logits, and iter_hf reads back every weight as it was (the expert bias as zeros)."""
    from titanlite.models.llama4.hf import iter_hf

    args = our_args(variant)
    ours = random_llama4(args)
    save(ours, tmp_path / "hf", shard_bytes=2**16)
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 2
    reference = transformers.Llama4ForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert reference.config.layer_types == ["chunked_attention"] * 3 + ["full_attention"]
    with torch.no_grad():
        logits = ours(tokens())
        expected = reference(tokens()).logits
    assert logits.dtype == expected.dtype == torch.float32
    print(f"{variant}: export, max logit difference {max_difference(logits, expected):.2e}")
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)

    state = ours.state_dict()
    back = dict(iter_hf(tmp_path / "hf"))
    assert back.keys() == state.keys()
    assert all(torch.equal(back[name], w) for name, w in state.items())


@pytest.mark.parametrize("variant", VARIANTS)
def test_transformers_model_imports_with_its_logits(variant, tmp_path):
    """A random Llama4ForCausalLM, as transformers saves it (rope_parameters, derived layer lists) ->
    load_hf (picked by model_type) -> our model: the same logits."""
    from titanlite.models.hf import load_hf
    from titanlite.models.llama4.model import Llama4Transformer

    reference = random_hf_model(transformers.Llama4ForCausalLM, hf_config(variant))
    reference.save_pretrained(str(tmp_path / "hf"))
    ours = Llama4Transformer(our_args(variant)).eval()
    ours.load_state_dict(load_hf(tmp_path / "hf"))  # strict: every weight and buffer of ours
    with torch.no_grad():
        logits = ours(tokens())
        expected = reference(tokens()).logits
    assert logits.dtype == torch.float32
    print(f"{variant}: import, max logit difference {max_difference(logits, expected):.2e}")
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


# Meta's Llama 4 Scout config.json: Llama 3.1's scaling with factor 16 and no blend band (both factors 1).
SCOUT_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
              "original_max_position_embeddings": 8192}


def scout_rope(args):
    """`args` with the RoPE of titanlite's Scout flavor (the code under test), not values written here."""
    scout = FAMILIES["llama4"].flavors["17bx16e"]
    return replace(args, rope_theta=scout.rope_theta, rope_scaling=scout.rope_scaling, rope_scaling_factor=scout.rope_scaling_factor,
                   rope_high_freq_factor=scout.rope_high_freq_factor)


@pytest.mark.parametrize("head_dim", [128, 16])  # Scout's heads, and the small model's below
def test_scout_rope_frequencies_are_transformers_for_scouts_rope_scaling(head_dim):
    """The angle of the RoPE table's row 1 is each frequency: transformers' llama3 RoPE init for Scout's
    rope_scaling, kept under 8192 positions of wavelength and 16 times slower over."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from titanlite.models.common.rope import rope_cache

    args = scout_rope(replace(our_args("plain_rope_top2"), dim=4 * head_dim, n_heads=4, head_dim_override=head_dim))
    config = transformers.Llama4TextConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                                           rope_parameters=dict(SCOUT_ROPE))
    expected, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert attention_factor == 1.0 and (2 * torch.pi / expected > 8192).any()  # some frequencies are slowed
    table = rope_cache(args, 2)
    torch.testing.assert_close(torch.atan2(table[1, head_dim // 2 :], table[1, : head_dim // 2]), expected, rtol=2e-6, atol=0)


def test_scout_rope_imports_with_transformers_logits_over_a_long_window(tmp_path):
    """At 48 tokens in chunks of 16 Scout's slowed frequencies hardly turn (a factor of 8 instead of 16
    moves the logits 1e-4): here one chunk of 2048 tokens (where factor 8 moves them 0.66), with Scout's
    RoPE taken from its flavor and transformers' from Meta's config: the same logits (fp32, 1e-4)."""
    from titanlite.models.hf import load_hf
    from titanlite.models.llama4.model import Llama4Transformer

    seq_len = 2048
    torch.manual_seed(0)
    reference = transformers.Llama4ForCausalLM(hf_config("qk_norm_scaled_rope", attention_chunk_size=seq_len,
                                                         max_position_embeddings=seq_len, rope_parameters=dict(SCOUT_ROPE))).eval()
    reference.save_pretrained(str(tmp_path / "hf"))
    ours = Llama4Transformer(scout_rope(our_args("qk_norm_scaled_rope", attention_chunk_size=seq_len, max_seq_len=seq_len))).eval()
    ours.load_state_dict(load_hf(tmp_path / "hf"))
    window = torch.randint(0, VOCAB, (1, seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, expected = ours(window), reference(window).logits
    print(f"Scout RoPE over {seq_len} tokens: max logit difference {max_difference(logits, expected):.2e}")
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_trainer_loads_a_hugging_face_folder_and_refuses_one_of_another_shape(tmp_path):
    """The trainer's import (checkpoint.initial_load_in_hf's load_hf_weights) takes every parameter from
    the folder; a config.json that differs from the model in one value is refused, naming it, in
    either of transformers' RoPE formats."""
    import torch.distributed as dist

    from helpers import tiny_args
    from titanlite.models.hf import load_hf
    from titanlite.trainer import Trainer

    assert family_of_hf_model("llama4_text", tmp_path) is FAMILIES["llama4"]
    save(random_llama4(our_args("qk_norm_scaled_rope")), tmp_path / "hf")
    variant = VARIANTS["qk_norm_scaled_rope"]
    pairs = ",".join(f"{k}={v}" for k, v in (SHAPE | variant).items() if k != "n_layers")
    cli = ["--model.name", "llama4", "--model.n_layers", "4", "--model.flavor_overrides", pairs,
           "--training.seq_len", str(SEQ_LEN)]
    (tmp_path / "c.jsonl").write_text('{"text": "unused"}\n')
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trainer = Trainer(parse_args(tiny_args(tmp_path / "c.jsonl", tmp_path, *cli)), torch.device("cpu"))
        trainer.checkpointer.load_hf_weights(tmp_path / "hf")
        expected = load_hf(tmp_path / "hf")
        for name, p in trainer.model_parts[0].named_parameters():
            assert torch.equal(p.detach(), expected[name]), name

        config_json = tmp_path / "hf" / "config.json"
        written = json.loads(config_json.read_text())
        rope_parameters = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}
        without_rope = {k: v for k, v in written.items() if k not in ("rope_scaling", "rope_theta")}
        for config, words in [
            (written | {"attention_chunk_size": 32}, "attention_chunk_size=32, the model being trained 16"),
            (written | {"no_rope_layers": [1, 1, 0, 1]}, r"no_rope_layers=\[1, 1, 0, 1\], the model being trained \[1, 1, 1, 0\]"),
            (written | {"moe_layers": None, "interleave_moe_layer_step": 1}, r"moe_layers=\[0, 1, 2, 3\], the model being trained \[1, 3\]"),
            (written | {"floor_scale": 8192}, "floor_scale=8192, the model being trained 8.0"),
            (written | {"use_qk_norm": False}, "use_qk_norm=False, the model being trained True"),
            (written | {"num_experts_per_tok": 2}, "num_experts_per_tok=2, the model being trained 1"),
            (written | {"intermediate_size_mlp": 128}, "intermediate_size_mlp=128, the model being trained 96"),
            (written | {"rope_scaling": None}, "rope_type=default, the model being trained llama3"),
            (without_rope | {"rope_parameters": rope_parameters}, "rope_scaling.factor=8.0, the model being trained 16.0"),
        ]:
            config_json.write_text(json.dumps(config))
            with pytest.raises(ConfigError, match=f"'{tmp_path / 'hf'}' has {words}; choose the model.flavor"):
                trainer.checkpointer.load_hf_weights(tmp_path / "hf")
        # The same RoPE in transformers 5's format reads as Meta's.
        config_json.write_text(json.dumps(without_rope | {"rope_parameters": rope_parameters | {"factor": 16.0}}))
        trainer.checkpointer.load_hf_weights(tmp_path / "hf")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("change, words", [
    (dict(score_func="softmax"), "softmax scores"),
    (dict(num_shared_experts=0), "0 shared experts"),
    (dict(route_norm=True), "renormalized routing weights"),
    (dict(score_before_experts=False), "routing weights on the experts' outputs"),
    (dict(floor_scale=8.5), "floor_scale=8.5"),
    (dict(load_balance_coeff=1e-3), r"an expert bias \(model.moe_load_balance_coeff\)"),
])
def test_export_refuses_what_llama4_cannot_hold(change, words, tmp_path):
    """Before training (the family's check_hf_export) and at export: one ConfigError naming what differs."""
    args = our_args("qk_norm_scaled_rope", **change)
    with pytest.raises(ConfigError, match=f"this Llama 4 model has {words}, which Llama4ForCausalLM"):
        FAMILIES["llama4"].check_hf_export(args)
    with pytest.raises(ConfigError, match=words):
        save(random_llama4(our_args("qk_norm_scaled_rope")), tmp_path, args)


def test_export_refuses_a_nonzero_expert_bias(tmp_path):
    """Llama 4 routes without a bias: weights trained with one would route differently there."""
    model = random_llama4(our_args("qk_norm_scaled_rope"))
    model.layers["1"].feed_forward.expert_bias[2] = 0.5
    with pytest.raises(ConfigError, match="layers.1.feed_forward.expert_bias is not zero, and Llama4ForCausalLM has no expert bias"):
        save(model, tmp_path)
