"""Qwen3's dense family: the published sizes, logits equal to transformers' Qwen3ForCausalLM through the
Hugging Face import (tied and untied embeddings), the export transformers reads back, and the layouts a
tied embedding cannot take refused in one line. Parity on the layouts: tests/parity_cases.py (qwen3_*)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch

from helpers import random_hf_model, tiny_args
from titanlite.models import build_model, model_args

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")


# Qwen's model cards: total and non-embedding parameters (the embedding, and an untied lm_head, left out).
@pytest.mark.parametrize("flavor, total, non_embedding", [
    ("0.6B", 0.6, 0.44), ("1.7B", 1.7, 1.4), ("4B", 4.0, 3.6), ("8B", 8.2, 6.95), ("14B", 14.8, 13.2), ("32B", 32.8, 31.2),
])
def test_flavors_have_the_published_sizes(flavor, total, non_embedding):
    args = model_args("qwen3", flavor, 0, 4096)
    model = build_model("qwen3", args)  # on the meta device: a fake-backend dry run counts these
    counted = sum(p.numel() for p in model.parameters())  # a tied weight once
    assert counted == args.num_params()
    embeddings = args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)
    digits = lambda published: len(str(published).split(".")[1])  # as many as the card gives
    assert round(counted / 1e9, digits(total)) == total
    assert round((counted - embeddings) / 1e9, digits(non_embedding)) == non_embedding
    assert (model.output.weight is model.tok_embeddings.weight) == (flavor in ("0.6B", "1.7B", "4B"))


def test_a_tied_model_built_on_meta_stays_tied_through_materialization():
    """The trainer's path: built on the meta device, to_empty (which gives each module a parameter of
    its own), init_weights: one parameter again, holding the output's initialization."""
    model = build_model("qwen3", model_args("qwen3", "debugmodel_tied", 320, 64))
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    assert model.output.weight is model.tok_embeddings.weight
    assert [name for name, _ in model.named_parameters()].count("tok_embeddings.weight") == 1
    assert "output.weight" not in dict(model.named_parameters())
    assert model.output.weight.std().item() == pytest.approx(256**-0.5, rel=0.05)  # the output's dim**-0.5, not the embedding's 1


def tiny_config(tied: bool) -> "transformers.Qwen3Config":
    # Heads of 32 over a hidden size of 64 (4 heads): wider than hidden / heads, as Qwen3's are.
    return transformers.Qwen3Config(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=tied,
        max_position_embeddings=128, initializer_range=0.1,
    )


def our_args(tied: bool):
    flavor = "debugmodel_tied" if tied else "debugmodel"
    return replace(model_args("qwen3", flavor, 320, 128), dim=64, dense_hidden_dim=96, n_layers=2, n_heads=4,
                   n_kv_heads=2, head_dim_override=32)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_transformers_logits_through_the_import_and_back_through_the_export(tied, tmp_path):
    """A random Qwen3ForCausalLM (norms away from 1, so an ignored q/k norm weight shows) imports with its
    logits (fp32, 1e-4); our export loads in transformers with the same logits, a tied one without an
    lm_head tensor in its files (as transformers writes it)."""
    from safetensors import safe_open

    from titanlite.models.hf import load_hf
    from titanlite.models.llama3.model import Transformer
    from titanlite.models.qwen3.hf import save_hf

    reference = random_hf_model(transformers.Qwen3ForCausalLM, tiny_config(tied))
    reference.save_pretrained(str(tmp_path / "hf"))
    ours = Transformer(our_args(tied)).eval()
    imported = load_hf(tmp_path / "hf")
    assert ("output.weight" in imported) != tied
    ours.load_state_dict(imported, strict=not tied)
    assert (ours.output.weight is ours.tok_embeddings.weight) == tied
    tokens = torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
        torch.testing.assert_close(ours(tokens), expected, rtol=1e-4, atol=1e-4)

    state = ours.state_dict()
    save_hf(lambda names: {n: state[n] for n in names}, {n: w.numel() for n, w in state.items()}, our_args(tied),
            tmp_path / "out", torch.float32)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["model_type"], config["tie_word_embeddings"], config["head_dim"]) == ("qwen3", tied, 32)
    with safe_open(str(next((tmp_path / "out").glob("*.safetensors"))), "pt") as f:
        assert ("lm_head.weight" in f.keys()) != tied
    back = transformers.Qwen3ForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, expected, rtol=1e-4, atol=1e-4)


def test_tied_embeddings_under_pipeline_parallel_are_one_line(corpus_jsonl, tmp_path):
    from titanlite import preflight
    from titanlite.config import parse_args
    from titanlite.errors import ConfigError

    args = ["--model.name", "qwen3", "--model.flavor", "debugmodel_tied", "--parallelism.pipeline_parallel_degree", "2"]
    config = parse_args(tiny_args(corpus_jsonl, tmp_path, *args))
    with pytest.raises(ConfigError, match=re.escape("parallelism.pipeline_parallel_degree=2 with tied embeddings")):
        preflight.check(config, 2)
    untied = parse_args(tiny_args(corpus_jsonl, tmp_path, *args, "--model.flavor_overrides", "tie_embeddings=false"))
    preflight.check(untied, 2)
