"""DeepSeek-V3's Hugging Face import checks config.json against the model being trained: every key
transformers would run differently (shapes, routing, RoPE and YaRN's parameters), read as transformers
reads it (its DeepseekV3Config defaults for absent keys, either RoPE format), refused in one line naming
the key, both values and the fix; through the trainer's import and through run_train.sh."""

import json

import pytest
import torch

from titanlite.config import ConfigError, parse_args
from titanlite.models import model_args

try:
    import transformers
except ImportError:
    transformers = None


# The debug model with YaRN, as the import checks below train it (vocab: the byte tokenizer's, padded).
YARN_DEBUG = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--model.n_layers", "2", "--model.flavor_overrides",
              "mtp_depth=0,yarn_factor=4,yarn_original_seq_len=16,yarn_mscale=0.9,yarn_mscale_all_dim=0.7"]


def exported_debug_model(folder, cli: list[str]):
    """A DeepSeek-V3 folder as titanlite exports the model `cli` trains (random weights)."""
    from titanlite.data.tokenizer import build_tokenizer
    from titanlite.models.deepseek_v3.hf import save_hf
    from titanlite.models.deepseek_v3.model import DeepSeekV3Transformer

    config = parse_args(cli)
    vocab = build_tokenizer(*config.tokenizer).vocab_size
    args = model_args("deepseek_v3", "debugmodel", vocab, config.longest_sequence, config.model.n_layers, config.model)
    model = DeepSeekV3Transformer(args)
    model.init_weights(seed=0)
    state = model.state_dict()
    save_hf(lambda names: {n: state[n] for n in names}, {n: w.numel() for n, w in state.items()}, args, folder, torch.float32)
    return json.loads((folder / "config.json").read_text())


def without(config: dict, *keys: str) -> dict:
    return {k: v for k, v in config.items() if k not in keys}


def with_rope(config: dict, **changes) -> dict:
    return config | {"rope_scaling": config["rope_scaling"] | changes}


# A config.json differing from the model in one value (what transformers would run), and the words of
# the refusal: the key, the file's value (transformers' default where the key is absent), the model's, the fix.
CONFIG_DISAGREEMENTS = [
    (lambda c: c | {"moe_intermediate_size": 48}, "moe_intermediate_size=48, the model being trained moe_hidden_dim=128; "
     "set model.flavor_overrides moe_hidden_dim=48"),
    (lambda c: c | {"hidden_size": 128}, "hidden_size=128, the model being trained dim=256"),
    (lambda c: c | {"num_hidden_layers": 3}, "num_hidden_layers=3, the model being trained n_layers=2; set model.n_layers"),
    (lambda c: c | {"vocab_size": 384}, "vocab_size=384, the model being trained vocab_size=320; set model.hf_assets_path"),
    (lambda c: c | {"num_attention_heads": 4}, "num_attention_heads=4, the model being trained n_heads=8"),
    (lambda c: c | {"num_key_value_heads": 4}, "num_key_value_heads=4, the model being trained n_kv_heads=8"),
    (lambda c: c | {"kv_lora_rank": 32}, "kv_lora_rank=32, the model being trained kv_lora_rank=64"),
    (lambda c: c | {"q_lora_rank": None}, "q_lora_rank=0, the model being trained q_lora_rank=128"),  # null: no query latent
    (lambda c: c | {"qk_nope_head_dim": 16}, "qk_nope_head_dim=16, the model being trained qk_nope_head_dim=32"),
    (lambda c: c | {"qk_rope_head_dim": 8}, "qk_rope_head_dim=8, the model being trained qk_rope_head_dim=16"),
    (lambda c: c | {"v_head_dim": 16}, "v_head_dim=16, the model being trained v_head_dim=32"),
    (lambda c: c | {"n_routed_experts": 16}, "n_routed_experts=16, the model being trained num_experts=8"),
    (lambda c: c | {"n_shared_experts": 2}, "n_shared_experts=2, the model being trained num_shared_experts=1"),
    (lambda c: c | {"num_experts_per_tok": 3}, "num_experts_per_tok=3, the model being trained top_k=2"),
    (lambda c: c | {"first_k_dense_replace": 0}, "first_k_dense_replace=0, the model being trained n_dense_layers=1"),
    (lambda c: c | {"intermediate_size": 256}, "intermediate_size=256, the model being trained dense_hidden_dim=512"),
    (lambda c: c | {"n_group": 2}, "n_group=2, the model being trained n_group=4"),
    (lambda c: c | {"topk_group": 1}, "topk_group=1, the model being trained topk_group=2"),
    (lambda c: c | {"rope_interleave": False}, "rope_interleave=False, the model being trained True"),
    (lambda c: c | {"scoring_func": "softmax"}, "scoring_func=softmax, the model being trained score_func=sigmoid"),
    # Keys left out mean transformers' DeepseekV3Config defaults, here not the model's.
    (lambda c: without(c, "q_lora_rank"), r"q_lora_rank=1536 \(absent: transformers' default\), the model being trained q_lora_rank=128; "
     "set model.flavor_overrides q_lora_rank=1536"),
    (lambda c: without(c, "n_group"), r"n_group=8 \(absent: transformers' default\), the model being trained n_group=4"),
    (lambda c: without(c, "topk_group"), r"topk_group=4 \(absent: transformers' default\), the model being trained topk_group=2"),
    (lambda c: without(c, "first_k_dense_replace"), r"first_k_dense_replace=3 \(absent: transformers' default\)"),
    # RoPE: YaRN's every parameter, in either of transformers' formats.
    (lambda c: with_rope(c, factor=8.0), "rope_scaling.factor=8.0, the model being trained yarn_factor=4.0; "
     "set model.flavor_overrides yarn_factor=8.0"),
    (lambda c: without(c, "rope_scaling"), r"rope_scaling.factor=1.0 \(absent: transformers' default\), the model being trained yarn_factor=4.0"),
    (lambda c: with_rope(c, original_max_position_embeddings=32), "rope_scaling.original_max_position_embeddings=32, the model "
     "being trained yarn_original_seq_len=16; set model.flavor_overrides yarn_original_seq_len=32"),
    (lambda c: c | {"max_position_embeddings": 32, "rope_scaling": without(c["rope_scaling"], "original_max_position_embeddings")},
     r"rope_scaling.original_max_position_embeddings=32 \(absent: transformers' default\)"),  # transformers: max_position_embeddings
    (lambda c: with_rope(c, beta_fast=16), "rope_scaling.beta_fast=16, the model being trained yarn_beta_fast=32.0"),
    (lambda c: with_rope(c, beta_slow=2), "rope_scaling.beta_slow=2, the model being trained yarn_beta_slow=1.0"),
    (lambda c: with_rope(c, mscale=1.0), "rope_scaling.mscale=1.0, the model being trained yarn_mscale=0.9"),
    (lambda c: with_rope(c, mscale_all_dim=1.0), "rope_scaling.mscale_all_dim=1.0, the model being trained yarn_mscale_all_dim=0.7"),
    # transformers reads YaRN without mscale_all_dim as mscale 1 on cos/sin and none on the softmax.
    (lambda c: c | {"rope_scaling": without(c["rope_scaling"], "mscale_all_dim")},
     r"rope_scaling.mscale_all_dim=0.0 \(absent: transformers' default\), the model being trained yarn_mscale_all_dim=0.7"),
    (lambda c: c | {"rope_scaling": without(c["rope_scaling"], "mscale")}, "mscale_all_dim=0.7 in rope_scaling without mscale"),
    (lambda c: without(c, "rope_scaling") | {"rope_parameters": c["rope_scaling"] | {"beta_fast": 16, "rope_theta": 10000.0}},
     "rope_scaling.beta_fast=16, the model being trained yarn_beta_fast=32.0"),
    (lambda c: c | {"rope_theta": 5e5}, "rope_theta=500000.0, the model being trained rope_theta=10000.0"),
    (lambda c: with_rope(c, type="linear"), "rope_scaling type linear, which titanlite's DeepSeek-V3 does not apply"),
    (lambda c: with_rope(c, truncate=False), "rope_scaling.truncate=False, which titanlite's YaRN does not take"),
]


def test_hugging_face_config_is_checked_key_by_key_against_the_model(tmp_path):
    """The trainer's import (checkpoint.initial_load_in_hf) reads a folder whose config.json describes the
    model being trained, and refuses one that differs in any value transformers would run differently:
    every shape, the routing, RoPE's theta, layout and YaRN parameters; a key left out counts as
    transformers' DeepseekV3Config default. One ConfigError each, naming the key, both values and the fix."""
    import torch.distributed as dist

    from helpers import tiny_args
    from titanlite.trainer import Trainer

    (tmp_path / "c.jsonl").write_text('{"text": "unused"}\n')
    cli = tiny_args(tmp_path / "c.jsonl", tmp_path, *YARN_DEBUG)
    written = exported_debug_model(tmp_path / "hf", cli)
    assert written["rope_scaling"]["factor"] == 4.0 and written["q_lora_rank"] == 128
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trainer = Trainer(parse_args(cli), torch.device("cpu"))
        trainer.checkpointer.load_hf_weights(tmp_path / "hf")
        config_json = tmp_path / "hf" / "config.json"
        for change, words in CONFIG_DISAGREEMENTS:
            config_json.write_text(json.dumps(change(written)))
            with pytest.raises(ConfigError, match=f"'{tmp_path / 'hf'}' has {words}") as refused:
                trainer.checkpointer.load_hf_weights(tmp_path / "hf")
            assert "\n" not in str(refused.value)
        # The same model in transformers' own formats loads: rope_parameters (with the theta inside), q_lora_rank's
        # default where it is DeepSeek-V3's, and YaRN's mscale pair left out where the model's is transformers' reading.
        for same in [without(written, "rope_scaling", "rope_theta") | {"rope_parameters": written["rope_scaling"] | {"rope_theta": 1e4}},
                     written | {"rope_scaling": written["rope_scaling"] | {"type": None, "rope_type": "yarn"}}]:
            config_json.write_text(json.dumps(same))
            trainer.checkpointer.load_hf_weights(tmp_path / "hf")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(transformers is None, reason="transformers is not installed (pip install -e '.[test]')")
def test_the_import_reads_absent_keys_as_transformers_deepseek_v3_config_does():
    """The defaults the check assumes for keys a config.json leaves out are DeepseekV3Config's own."""
    from titanlite.models.deepseek_v3.hf import HF_FIELDS

    defaults = transformers.DeepseekV3Config()
    for key, (_, default) in HF_FIELDS.items():
        assert getattr(defaults, key) == default, key
    assert defaults.rope_interleave is True and defaults.max_position_embeddings == 4096


@pytest.mark.slow
def test_run_train_sh_refuses_a_hugging_face_config_of_another_shape_in_one_line(tmp_path):
    """Through run_train.sh: one line naming the key, both values and the fix, exit 2, nothing trained."""
    import os
    import sys

    from helpers import REPO, run_command

    cli = ["--job.dump_folder", str(tmp_path / "run"), "--training.steps", "1", "--training.seq_len", "32",
           "--validation.enable", "false", "--metrics.enable_tensorboard", "false", *YARN_DEBUG]
    written = exported_debug_model(tmp_path / "hf", cli)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(without(written, "q_lora_rank")))
    load = ["--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(tmp_path / "hf")]
    env = {**os.environ, "NGPU": "1", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    out = run_command(["./run_train.sh", *cli, *load], timeout=300, cwd=REPO, env=env)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip().count("\n") == 0, out.stderr[-3000:]
    assert "has q_lora_rank=1536 (absent: transformers' default), the model being trained q_lora_rank=128; " \
           "set model.flavor_overrides q_lora_rank=1536" in out.stderr, out.stderr[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
