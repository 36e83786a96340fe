"""MuonClip's QK-clip: each head's largest logit as the attention core reports it, against the logits
computed by hand; after a clip, each head (GQA: key/value group) that passed the threshold has it as
its largest logit, and nothing else moved (MHA, GQA, MLA with and without query compression); bad
settings in one line. On TP and FSDP x TP against one process: test_parallel_parity.py's
muon_qkclip_* cases."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers import launch, tiny_args

MODELS = {  # (family, flavor, changes): one block, no multi-token prediction (a clipped block changes the next one's input)
    "mha": ("llama3", "debugmodel", {}),
    "gqa": ("llama3", "debugmodel_gqa", {}),
    "mla": ("deepseek_v3", "debugmodel", {"mtp_depth": 0}),
    "mla_no_query_latent": ("deepseek_v3", "debugmodel", {"mtp_depth": 0, "q_lora_rank": 0}),
}


def one_block(name: str):
    from titanlite.models import FAMILIES, build_model, model_args

    family, flavor, changes = MODELS[name]
    args = replace(model_args(family, flavor, 512, 64), n_layers=1, **changes)
    model = build_model(family, args)
    model.to_empty(device="cpu")
    model.init_weights(0)
    return model, FAMILIES[family].plan


def test_largest_logits_are_the_logits_by_hand():
    """Causal and within documents, GQA's shared keys, a few queries at a time: each head's largest
    q.k / sqrt(d) over the pairs it may attend, against the whole score matrix by hand."""
    from titanlite.models.common.attention import DocumentMask, largest_logits

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 8, 24, 16, generator=gen) * 3, torch.randn(2, 2, 24, 16, generator=gen)
    ids = torch.tensor([[0] * 10 + [1] * 14, [0] * 5 + [1] * 5 + [2] * 14])
    positions = torch.arange(24).expand(2, 24)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(4, dim=1)) / 4.0
    causal = torch.ones(24, 24, dtype=torch.bool).tril()
    same_document = ids[:, None, :, None] == ids[:, None, None, :]
    for mask, allowed in [(None, causal), (DocumentMask(ids, positions), causal & same_document)]:
        by_hand = scores.masked_fill(~allowed, -torch.inf).amax(dim=(0, 2, 3))
        torch.testing.assert_close(largest_logits(q, k, mask, elements=500), by_hand, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(largest_logits(q, k, DocumentMask(ids, positions)), scores.amax(dim=(0, 2, 3)))


@pytest.mark.parametrize("name", list(MODELS))
def test_a_clipped_head_has_the_threshold_as_its_largest_logit_and_nothing_else_moves(name):
    from titanlite.optim.qk_clip import QKClip

    model, plan = one_block(name)
    core = model.layers["0"].attention.inner_attention
    kv_groups, rows = plan.qk_clip_rows(model.args)
    clip = QKClip(model, (kv_groups, rows), threshold=1.0)
    tokens = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    model(tokens)  # a training forward (with grad): validation's do not count
    before = core.max_logits.clone()
    # Scale the threshold between the smallest and largest group maxima: some groups are clipped, some not.
    group_max = before.view(kv_groups, -1).amax(dim=1)
    clip.threshold = group_max.median().item()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    clip.clip()
    assert torch.isinf(core.max_logits).all()  # the next step starts afresh
    with torch.no_grad():
        model(tokens)
    assert torch.isinf(core.max_logits).all()
    model(tokens)
    after = core.max_logits
    gamma = (clip.threshold / group_max).clamp(max=1.0).repeat_interleave(before.numel() // kv_groups)
    assert (gamma < 1).any() and (gamma == 1).any()
    torch.testing.assert_close(after, before * gamma, rtol=2e-5, atol=0)  # each logit of a head shrinks by its gamma
    torch.testing.assert_close(after.view(kv_groups, -1).amax(dim=1), group_max.clamp(max=clip.threshold), rtol=2e-5, atol=0)
    scaled = {f"layers.0.attention.{n}" for n in rows}
    for n, p in model.named_parameters():
        if n not in scaled:
            assert torch.equal(p, start[n]), n
    if name.startswith("mla"):  # the value rows of wkv_b stay; the shared rotary key lives in wkv_a, unmoved above
        a = model.args
        wkv_b = model.layers["0"].attention.wkv_b.weight.view(a.n_heads, -1, a.kv_lora_rank)
        assert torch.equal(wkv_b[:, a.qk_nope_head_dim:], start["layers.0.attention.wkv_b.weight"].view_as(wkv_b)[:, a.qk_nope_head_dim:])


def test_a_head_that_saw_nothing_or_only_negative_logits_is_left_alone():
    """Largest logits of -inf (no training forward) or below 0 are not past any threshold: no row moves."""
    from titanlite.optim.qk_clip import QKClip

    model, plan = one_block("mha")
    clip = QKClip(model, plan.qk_clip_rows(model.args), threshold=1.0)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    core = model.layers["0"].attention.inner_attention
    clip.clip()  # -inf: nothing seen
    core.max_logits.copy_(torch.linspace(-3.0, -0.5, core.max_logits.numel()))
    clip.clip()
    assert clip.clipped == 0 and all(torch.equal(p, start[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("args, words", [
    (["--optimizer.qk_clip_threshold", "-1"], "optimizer.qk_clip_threshold=-1.0 must be >= 0"),
    (["--optimizer.name", "AdamW", "--optimizer.qk_clip_threshold", "100"], "QK-clip is MuonClip's"),
    (["--parallelism.context_parallel_degree", "2"], "ring attention cannot report each head's largest logit"),
])
def test_bad_qk_clip_settings_are_one_line(args, words):
    from titanlite.config import parse_args
    from titanlite.errors import ConfigError

    with pytest.raises(ConfigError, match=words):
        parse_args(["--optimizer.name", "Muon", "--optimizer.qk_clip_threshold", "100", *args])


def test_qk_clip_on_query_key_norms_is_refused_in_one_line(corpus_jsonl, tmp_path):
    """Qwen3's q/k head norms undo any scaling of W_q and W_k: the run stops before training, exit 2."""
    out = launch(1, tiny_args(corpus_jsonl, tmp_path, "--model.name", "moe", "--model.flavor", "debugmoe_qwen3", "--optimizer.name",
                              "Muon", "--optimizer.qk_clip_threshold", "100"), expect=2)
    assert out.stderr.strip().startswith("titanlite: config error: optimizer.qk_clip_threshold=100.0 with model moe flavor debugmoe_qwen3: "
                                         "its q/k head norms undo any scaling of the projections"), out.stderr[-2000:]
