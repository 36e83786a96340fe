"""Llama 3.1's RoPE scaling (every Llama 3 preset's) against transformers: the frequencies against
ROPE_INIT_FUNCTIONS["llama3"] for Meta's rope_scaling (factor 8, low_freq_factor 1, high_freq_factor 4,
original context 8192), and the logits of a small scaled model against LlamaForCausalLM over a window
long enough that the slowed and blended frequencies turn (2048 tokens). Llama 4 Scout's scaling:
test_llama4_hf.py; DeepSeek's YaRN: test_deepseek_v3.py."""

import math
from dataclasses import replace

import pytest
import torch

from titanlite.models import model_args
from titanlite.models.common.rope import rope_cache

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")

# Meta's Llama 3.1 config.json (8B, 70B, 405B alike).
LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def frequencies(args) -> torch.Tensor:
    """The rotation frequencies of titanlite's RoPE table: the angle of its row for position 1."""
    table = rope_cache(args, 2)
    half = table.shape[1] // 2
    return torch.atan2(table[1, half:], table[1, :half])


def transformers_frequencies(head_dim: int) -> torch.Tensor:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                                      max_position_embeddings=131072, rope_parameters=dict(LLAMA31_ROPE))
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert attention_factor == 1.0
    return inv_freq


@pytest.mark.parametrize("flavor", ["8B", "70B", "405B", "debugmodel"])
def test_llama3_presets_scale_rope_as_transformers_llama3_rope(flavor):
    """Every band: kept (wavelength under 8192/4), slowed 8x (over 8192), and blended in between
    (which the 128-dim heads populate with 6 frequencies, the debug model's 16-dim heads with 1)."""
    args = model_args("llama3", flavor, 0, 8192)
    assert args.rope_scaling and args.rope_theta == LLAMA31_ROPE["rope_theta"]
    expected = transformers_frequencies(args.head_dim)
    wavelength = 2 * math.pi / expected
    band = (wavelength > 2048) & (wavelength < 8192 * 8)  # the blended band, read off transformers' frequencies
    assert band.sum() >= 1, flavor
    torch.testing.assert_close(frequencies(args), expected, rtol=2e-6, atol=0)


def test_llama3_scaled_model_imports_with_transformers_logits_over_a_long_window(tmp_path):
    """A random LlamaForCausalLM with Meta's rope_scaling -> load_hf -> titanlite's debug shapes with the
    presets' scaling: the same logits (fp32, 1e-4) over 2048 tokens, where the blended band's frequency
    turns ~1 rad (a band blended the wrong way round moves the logits by 9)."""
    from titanlite.models.hf import load_hf
    from titanlite.models.llama3.model import Transformer

    args = replace(model_args("llama3", "debugmodel_gqa", 320, 2048), dim=64, n_heads=4, n_kv_heads=2, n_layers=2, multiple_of=32)
    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=args.ffn_hidden_dim, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rms_norm_eps=args.norm_eps,
        rope_parameters=dict(LLAMA31_ROPE), initializer_range=0.2, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).eval()
    reference.save_pretrained(str(tmp_path / "hf"))
    ours = Transformer(args).eval()
    ours.load_state_dict(load_hf(tmp_path / "hf"))
    tokens = torch.randint(0, 320, (1, 2048), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, expected = ours(tokens), reference(tokens).logits
    print(f"llama3 scaled RoPE over 2048 tokens: max logit difference {(logits - expected).abs().max().item():.2e}")
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
