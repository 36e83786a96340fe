"""Damaged and hostile inputs stop with one line naming the file or key, what is wrong and what to
do, exit code 2: through run_train.sh (preflight finds them before any process starts) and through
plain `torchrun -m titanlite.train` (each rank finds the same itself). Nothing is deleted, and
nothing trains. Then preflight.check itself, for every class of input it claims to check, so a
check removed from preflight fails here even though the rank would print the same line."""

import json
import os
import re
import sys
from pathlib import Path

import pytest

from helpers import REPO, launch, run_command, tiny_args

pytestmark = pytest.mark.slow

MOE = ["--model.name", "moe", "--model.flavor", "debugmoe"]
DSV3 = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"]
L4 = ["--model.name", "llama4", "--model.flavor", "debugmodel"]


def run_train_sh(args: list[str], ngpu: int = 1):
    env = {**os.environ, "NGPU": str(ngpu), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    return run_command(["./run_train.sh", *args], timeout=300, cwd=REPO, env=env)


def assert_one_line(out, words: str) -> None:
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip().count("\n") == 0 and words in out.stderr, out.stderr[-3000:]


def assert_the_rank_said(out, words: str) -> None:
    """Under plain torchrun each rank that gets there prints the same one line and exits 2 (the ranks
    run preflight's checks before they join the group: none dies inside a collective); torchrun adds
    its own report of the failure (that part is torchrun's), but there is no titanlite traceback."""
    lines = {line for line in out.stderr.splitlines() if line.startswith("titanlite: config error:")}
    assert len(lines) == 1 and words in lines.pop(), out.stderr[-3000:]
    assert "exitcode  : 2" in out.stderr and not re.search(r'File ".*titanlite/', out.stderr), out.stderr[-3000:]


def bad_files(root: Path) -> dict[str, Path]:
    """Files a user could hand titanlite by mistake, each named by what is wrong with it."""
    root.mkdir(parents=True, exist_ok=True)
    files = {
        "tokenizer_not_json": root / "broken_tok" / "tokenizer.json",
        "tokenizer_no_vocabulary": root / "empty_tok" / "tokenizer.json",
        "empty_jsonl": root / "empty.jsonl",
        "binary_jsonl": root / "binary.jsonl",
        "text_as_parquet": root / "text.parquet",
        "binary_txt": root / "binary" / "doc.txt",
        "a_file": root / "a_file",
    }
    for path in files.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    files["tokenizer_not_json"].write_text('{"version": "1.0", "model": ')
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE()).save(str(files["tokenizer_no_vocabulary"]))
    files["empty_jsonl"].write_bytes(b"")
    files["binary_jsonl"].write_bytes(bytes(range(256)) * 8)
    files["text_as_parquet"].write_text('{"text": "not parquet at all"}\n')
    files["binary_txt"].write_bytes(b"caf\xe9 latin-1, not UTF-8 " * 100)
    files["a_file"].write_text("not a folder")
    from safetensors.torch import save_file
    import torch

    hf = root / "hf_truncated"
    hf.mkdir(exist_ok=True)
    (hf / "config.json").write_text(json.dumps({"num_attention_heads": 16, "num_key_value_heads": 16}))
    save_file({"model.embed_tokens.weight": torch.zeros(64, 16)}, str(hf / "model.safetensors"))
    (hf / "model.safetensors").write_bytes((hf / "model.safetensors").read_bytes()[:-100])
    files["hf_truncated"] = hf / "model.safetensors"
    hf_config = root / "hf_bad_config"
    hf_config.mkdir(exist_ok=True)
    (hf_config / "config.json").write_text("{'single': 'quotes'}")
    save_file({"model.embed_tokens.weight": torch.zeros(64, 16)}, str(hf_config / "model.safetensors"))
    files["hf_bad_config"] = hf_config / "config.json"
    return files


CASES = {  # name: (arguments given the bad files, words of the line)
    "tokenizer_not_json": (lambda f: ["--model.hf_assets_path", str(f["tokenizer_not_json"].parent)], "cannot be read as a tokenizer"),
    "tokenizer_no_vocabulary": (lambda f: ["--model.hf_assets_path", str(f["tokenizer_no_vocabulary"])], "has no vocabulary"),
    "empty_dataset": (lambda f: ["--training.dataset", str(f["empty_jsonl"])], "empty.jsonl' is empty"),
    "binary_dataset": (lambda f: ["--training.dataset", str(f["binary_jsonl"])], "binary.jsonl' is binary, not text"),
    "parquet_that_is_text": (lambda f: ["--training.dataset", str(f["text_as_parquet"])], "is not a parquet file"),
    "binary_txt_folder": (lambda f: ["--training.dataset_path", str(f["binary_txt"].parent)], "doc.txt' is not UTF-8 text"),
    "dump_folder_under_a_file": (lambda f: ["--job.dump_folder", str(f["a_file"] / "run")], "cannot be created or written (Not a directory"),
    "checkpoint_folder_a_file": (lambda f: ["--checkpoint.enable", "--checkpoint.folder", str(f["a_file"])],
                                 "a_file' is a file, not a folder; set checkpoint.folder to a folder you can write"),
    "config_file_not_text": (lambda f: ["--job.config_file", str(f["binary_jsonl"])], "binary.jsonl' is not valid TOML"),
    "config_file_a_folder": (lambda f: ["--job.config_file", str(f["a_file"].parent)], "cannot be read (Is a directory)"),
    "hf_weights_truncated": (lambda f: ["--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(f["hf_truncated"].parent)],
                             "model.safetensors' cannot be read"),
    "hf_config_not_json": (lambda f: ["--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(f["hf_bad_config"].parent)],
                           "config.json' cannot be read (JSONDecodeError"),
    "negative_load_balance_coeff": (lambda f: [*MOE, "--model.moe_load_balance_coeff", "-0.001"], "moe_load_balance_coeff=-0.001 must be >= 0"),
    "negative_aux_loss_coeff": (lambda f: [*MOE, "--model.moe_aux_loss_coeff", "-1"], "moe_aux_loss_coeff=-1.0 must be >= 0"),
    "expert_parallel_without_experts": (lambda f: ["--parallelism.expert_parallel_degree", "2"], "this model has none"),
    "expert_tensor_parallel_without_tp": (lambda f: [*MOE, "--parallelism.expert_tensor_parallel_degree", "2"],
                                          "but tensor_parallel_degree=1; set expert_tensor_parallel_degree=1"),
    "unknown_attn_mask_type": (lambda f: ["--model.attn_mask_type", "sliding"], "'sliding' is not allowed; choose from: none, causal, block_causal"),
    "unknown_attn_type": (lambda f: ["--model.attn_type", "xformers"], "'xformers' is not allowed; choose from: none, sdpa, flex, varlen"),
    "unknown_converter": (lambda f: ["--model.converters", "int4"], "'int4' is not allowed; choose from: quantize.linear.float8, float8"),
    "unknown_float8_recipe": (lambda f: ["--model.converters", "float8", "--quantize.linear.float8.recipe_name", "blockwise"],
                              "'blockwise' is not allowed; choose from: tensorwise, rowwise"),
    "moe_flavor_under_llama3": (lambda f: ["--model.flavor", "debugmoe"], "(it is a flavor of model.name='moe')"),
    "dsv3_topk_group_above_n_group": (lambda f: [*DSV3, "--model.flavor_overrides", "topk_group=5"], "topk_group=5 must be between 1 and n_group=4"),
    "dsv3_n_group_not_dividing": (lambda f: [*DSV3, "--model.flavor_overrides", "n_group=3"], "n_group=3 must divide num_experts=8"),
    "dsv3_no_kv_latent": (lambda f: [*DSV3, "--model.flavor_overrides", "kv_lora_rank=0"], "needs kv_lora_rank > 0"),
    "dsv3_odd_rope_dim": (lambda f: [*DSV3, "--model.flavor_overrides", "qk_rope_head_dim=15"], "qk_rope_head_dim=15 must be even"),
    "dsv3_mtp_apart_from_the_output": (lambda f: [*DSV3, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.module_fqns_per_model_part",
                                                 '[["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "output"], ["mtp"]]',
                                                 "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B", "--training.local_batch_size", "4"],
                                       "splits norm, output, mtp over stages"),
    "l4_chunk_zero": (lambda f: [*L4, "--model.flavor_overrides", "attention_chunk_size=0"], "attention_chunk_size=0 must be > 0"),
    "l4_chunk_negative": (lambda f: [*L4, "--model.flavor_overrides", "attention_chunk_size=-8"], "attention_chunk_size=-8 must be > 0"),
    "l4_interleave_step_zero": (lambda f: [*L4, "--model.flavor_overrides", "interleave_moe_layer_step=0"],
                                "interleave_moe_layer_step=0 must be >= 1"),
    "l4_weighted_qk_norm": (lambda f: [*L4, "--model.flavor_overrides", "qk_norm=true"], "qk_norm=true (Qwen3's q/k head norms with weights) is not part of Llama 4"),
    "n_heads_not_dividing_dim": (lambda f: ["--model.flavor_overrides", "n_heads=7"],
                                 "model.flavor_overrides=['n_heads=7']: n_heads=7 must divide dim=256"),
    "l4_top_k_above_experts": (lambda f: [*L4, "--model.flavor_overrides", "top_k=9"], "top_k=9 of num_experts=8"),
}
# What only the files decide: each also stops every rank of a plain torchrun, before training.
RANK_CASES = ["tokenizer_not_json", "binary_dataset", "dump_folder_under_a_file", "checkpoint_folder_a_file", "negative_load_balance_coeff"]


def test_bad_inputs_stop_run_train_sh_in_one_line(tmp_path):
    files = bad_files(tmp_path / "files")
    for name, (args, words) in CASES.items():
        ngpu = 2 if "expert_parallel" in name or "apart" in name else 1
        out = run_train_sh(["--job.dump_folder", str(tmp_path / "run"), *args(files)], ngpu)
        assert_one_line(out, words)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("name", RANK_CASES)
def test_bad_inputs_stop_every_rank_of_plain_torchrun(tmp_path, corpus_jsonl, name):
    args, words = CASES[name]
    out = launch(2, tiny_args(corpus_jsonl, tmp_path / "run", *args(bad_files(tmp_path / "files"))), expect=None)
    assert_the_rank_said(out, words)


def checkpoint_listing(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_damaged_checkpoint_names_the_newest_whole_step_and_deletes_nothing(corpus_jsonl, tmp_path):
    """Saved at steps 2 and 4; then step 4's shard is truncated, overwritten and removed in turn."""
    args = tiny_args(corpus_jsonl, tmp_path, "--checkpoint.enable", "--checkpoint.interval", "2", "--training.steps", "4")
    launch(1, args)
    metrics = (tmp_path / "metrics.jsonl").read_text()
    shard = tmp_path / "checkpoint" / "step-4" / "__0_0.distcp"
    data = shard.read_bytes()
    longer = [*args, "--training.steps", "6"]

    shard.write_bytes(data[: len(data) // 2])
    listing = checkpoint_listing(tmp_path / "checkpoint")
    out = run_train_sh(longer[2:])  # run_train.sh passes the same --job.config_file itself
    assert_one_line(out, "checkpoint step 4 is damaged (its shard file __0_0.distcp is truncated")
    assert "nothing was deleted. The newest whole checkpoint is step 2: resume from it with --checkpoint.load_step 2" in out.stderr

    shard.write_bytes(bytes(len(data)))  # whole length, zeros: found only when its tensors are read
    out = launch(1, longer, expect=None, agent=True)
    assert_the_rank_said(out, "checkpoint step 4 is damaged (reading its shards failed: UnpicklingError: Weights only load failed.)")
    assert "--checkpoint.load_step 2" in out.stderr

    shard.unlink()
    out = run_train_sh([*longer[2:], "--checkpoint.load_step", "4"])
    assert_one_line(out, "checkpoint step 4 is damaged (its shard file __0_0.distcp is missing)")

    out = run_train_sh([*longer[2:], "--checkpoint.load_step", "2", "--model.flavor", "debugmodel_gqa"])
    assert_one_line(out, "it was saved from another model shape; load it with the model config that saved it")
    assert re.search(r"entry 'model\.layers\.\d+\.attention\.w[kv]\.weight' has shape \[256, 256\], this run's \[\d+, 256\]", out.stderr), out.stderr

    listing.pop("step-4/__0_0.distcp")
    assert checkpoint_listing(tmp_path / "checkpoint") == listing  # nothing deleted, nothing added
    assert (tmp_path / "metrics.jsonl").read_text() == metrics  # and nothing trained


def test_under_pp_validation_follows_training_unless_set_apart():
    from titanlite.config import ConfigError, parse_args

    base = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), "--parallelism.pipeline_parallel_degree", "2"]
    config = parse_args([*base, "--training.local_batch_size", "4", "--training.seq_len", "128"])
    assert (config.validation.local_batch_size, config.validation.seq_len) == (4, 128)
    assert parse_args(["--training.local_batch_size", "4"]).validation.local_batch_size == 8  # no PP: its own
    from titanlite.parallel.dims import ParallelDims

    set_apart = parse_args([*base, "--training.local_batch_size", "4", "--validation.local_batch_size", "8"])
    with pytest.raises(ConfigError, match=r"validation.local_batch_size=8 and validation.seq_len=256 must equal training's \(4, 256\)"):
        ParallelDims.from_config(set_apart, 2)


@pytest.fixture()
def preflight_inputs(tmp_path, corpus_jsonl):
    from titanlite.config import parse_args

    files = bad_files(tmp_path / "files")

    def config(*extra: str):
        return parse_args(tiny_args(corpus_jsonl, tmp_path / "run", "--validation.enable", "false", *extra))

    return config, files


def test_preflight_checks_each_input_class_itself(preflight_inputs, tmp_path):
    """preflight.check, called directly: each class of input its docstring names is refused by it."""
    from titanlite.config import ConfigError
    from titanlite.preflight import check

    config, files = preflight_inputs
    check(config(), 1)  # a good config passes
    import torch
    import torch.distributed.checkpoint as dcp

    damaged = tmp_path / "damaged_run" / "checkpoint" / "step-3"
    dcp.save({"model": {"w": torch.zeros(64, 64)}}, checkpoint_id=str(damaged), no_dist=True)
    (damaged / "__0_0.distcp").write_bytes((damaged / "__0_0.distcp").read_bytes()[:1000])
    for world, extra, words in [
        (3, ["--parallelism.tensor_parallel_degree", "2"], "do not divide the world size 3"),  # layout
        (8, ["--parallelism.tensor_parallel_degree", "8", "--model.flavor", "debugmodel_gqa"], "does not divide the model's n_kv_heads"),
        (2, ["--training.global_batch_size", "6"], "not a multiple of local_batch_size x dp"),  # batch sizes
        (2, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
             "--parallelism.pipeline_parallel_layers_per_stage", "2"], "runs one stage per rank"),  # pipeline split
        (1, ["--model.hf_assets_path", str(files["tokenizer_not_json"])], "cannot be read as a tokenizer"),  # tokenizer
        (1, ["--training.dataset", str(files["binary_jsonl"])], "is binary, not text"),  # dataset files
        (1, ["--validation.enable", "true", "--validation.dataset", str(files["empty_jsonl"])], "is empty"),
        (1, ["--job.dump_folder", str(files["a_file"] / "run")], "cannot be created or written"),  # dump folder
        # the folders the run writes into inside the dump folder, each where the run writes it
        (1, ["--checkpoint.enable", "--checkpoint.folder", str(files["a_file"] / "ckpt")], "a_file' is a file, not a folder; set checkpoint.folder"),
        (1, ["--checkpoint.create_seed_checkpoint", "--checkpoint.enable", "--checkpoint.folder", str(files["a_file"])],
         "set checkpoint.folder"),
        (1, ["--metrics.enable_tensorboard", "--metrics.save_tb_folder", str(files["a_file"])], "a_file' is a file, not a folder; set metrics.save_tb_folder"),
        (1, ["--profiling.enable_profiling", "--profiling.save_traces_folder", str(files["a_file"])], "set profiling.save_traces_folder"),
        (1, ["--profiling.enable_memory_snapshot", "--profiling.save_memory_snapshot_folder", str(files["a_file"])],
         "set profiling.save_memory_snapshot_folder"),
        (1, ["--comm.save_traces_folder", str(files["a_file"])], "set comm.save_traces_folder"),  # the flight recorder's, on by default
        (1, ["--checkpoint.initial_load_path", str(tmp_path / "nowhere")], "holds no complete DCP checkpoint"),  # checkpoint
        (1, ["--checkpoint.enable", "--checkpoint.load_step", "3"], "load_step=3 has no complete checkpoint"),
        (1, ["--checkpoint.enable", "--job.dump_folder", str(damaged.parent.parent)], "checkpoint step 3 is damaged (its shard file"),
    ]:
        try:
            check(config(*extra), world)
        except ConfigError as e:
            assert words in str(e), (extra, str(e))
        else:
            pytest.fail(f"preflight passed {extra} on {world} ranks")


def test_preflight_accepts_a_read_only_checkpoint_folder_under_load_only(preflight_inputs, tmp_path, monkeypatch):
    """checkpoint.load_only (TorchTitan's: load, never save) reads the checkpoint folder: one the user
    cannot write passes, one that cannot be written still stops a run that saves, and a file does either way."""
    import titanlite.preflight as preflight
    from titanlite.config import ConfigError

    config, files = preflight_inputs
    shared = tmp_path / "shared_checkpoints"
    shared.mkdir()
    real = os.access  # the tests run as root, for whom every folder is writable: os.access says no for this one
    monkeypatch.setattr(preflight.os, "access", lambda path, mode: Path(path) != shared and real(path, mode))
    preflight.check(config("--checkpoint.enable", "--checkpoint.load_only", "--checkpoint.folder", str(shared)), 1)
    with pytest.raises(ConfigError, match="is not writable; set checkpoint.folder"):
        preflight.check(config("--checkpoint.enable", "--checkpoint.folder", str(shared)), 1)
    with pytest.raises(ConfigError, match="a_file' is a file, not a folder; set checkpoint.folder"):
        preflight.check(config("--checkpoint.enable", "--checkpoint.load_only", "--checkpoint.folder", str(files["a_file"])), 1)


def test_preflight_checks_wandb_is_installed(preflight_inputs, monkeypatch):
    import importlib.util

    from titanlite.config import ConfigError
    from titanlite.preflight import check

    config, _ = preflight_inputs
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="needs the wandb package"):
        check(config("--metrics.enable_wandb", "true"), 1)


def test_the_rank_checks_the_dump_folder_before_joining_the_group(tmp_path, corpus_jsonl):
    """The rank's own check (train.main), not preflight's: one line and exit 2 from plain python."""
    (tmp_path / "a_file").write_text("")
    out = launch(1, tiny_args(corpus_jsonl, tmp_path / "a_file" / "run"), expect=2)
    assert out.stderr.strip().count("\n") == 0, out.stderr[-2000:]
    assert "job.dump_folder=" in out.stderr and "cannot be created or written" in out.stderr


def tiny_llama_hf(folder: Path, vocab: int, **change) -> Path:
    """transformers' Llama at debugmodel's shapes with 2 blocks, saved as a Hugging Face folder; `change`:
    tensors (Hugging Face names) replaced in the file, config.json left as it is."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=16,
                                      num_key_value_heads=16, vocab_size=vocab, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(folder))
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({**tensors, **{k: f(tensors[k]) for k, f in change.items()}}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


UP = "model.layers.1.mlp.up_proj.weight"
HF_CASES = {  # what is wrong: (the tensor's change, words of the line)
    "wrong_shape": (lambda t: t[:700], f"tensor {UP} gives layers.1.feed_forward.w3.weight shape [700, 256], the model being trained [768, 256]"),
    "nan": (lambda t: t.index_put_((t.new_tensor([3], dtype=int), t.new_tensor([5], dtype=int)), t.new_tensor([float("nan")])),
            f"tensor {UP} (torch.float32) holds NaN or infinity"),
    "integer": (lambda t: t.to(int), "a torch.int64 (not floating point) tensor"),
}


@pytest.mark.parametrize("name", ["wrong_shape", "nan"])
def test_hugging_face_weights_that_disagree_stop_run_train_sh_in_one_line(name, tmp_path):
    change, words = HF_CASES[name]
    folder = tiny_llama_hf(tmp_path / "hf", 8192, **{UP: change})  # the bundled tokenizer's 8192 tokens
    out = run_train_sh(["--job.dump_folder", str(tmp_path / "run"), "--model.n_layers", "2", "--training.steps", "1",
                        "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(folder)])
    assert_one_line(out, words)
    assert "model.safetensors'" in out.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("name", list(HF_CASES))
def test_hugging_face_tensor_checks_name_the_tensor_and_its_file(name, tmp_path):
    from titanlite.checkpoint.hf import read_hf_config
    from titanlite.config import ConfigError
    from titanlite.models import model_args
    from titanlite.checkpoint.hf import checked_hf_weights
    from titanlite.models.llama3 import hf as llama3_hf
    from titanlite.models.llama3.model import Transformer

    change, words = HF_CASES[name]
    folder = tiny_llama_hf(tmp_path / "hf", 320, **{UP: change})
    args = model_args("llama3", "debugmodel", 259, 64, n_layers=2)  # the byte tokenizer's vocabulary, padded to 320
    with pytest.raises(ConfigError, match=re.escape(words)) as e:
        dict(checked_hf_weights(llama3_hf.iter_hf, folder, Transformer, args))  # as the checkpointer loads them
    assert str(folder / "model.safetensors") in str(e.value)
    good = tiny_llama_hf(tmp_path / "good", 320)  # the unchanged file passes
    llama3_hf.check_hf_shapes(read_hf_config(good)[0], args, good)
    dict(checked_hf_weights(llama3_hf.iter_hf, good, Transformer, args))


def test_the_converter_refuses_non_finite_hugging_face_weights(tmp_path):
    """scripts/convert_hf.py from-hf (load_hf) knows no model to check shapes against, but a NaN weight
    still stops it in one line naming the tensor and its file."""
    from titanlite.config import ConfigError
    from titanlite.models.hf import load_hf

    change, words = HF_CASES["nan"]
    folder = tiny_llama_hf(tmp_path / "hf", 320, **{UP: change})
    with pytest.raises(ConfigError, match=re.escape(words)) as e:
        load_hf(folder)
    assert str(folder / "model.safetensors") in str(e.value)
    assert "layers.1.feed_forward.w3.weight" in load_hf(tiny_llama_hf(tmp_path / "good", 320))


def test_hugging_face_tensors_the_model_does_not_load_are_not_checked(tmp_path, corpus_jsonl):
    """A folder may hold tensors the family's mapping never reads (a buffer, statistics): the trainer's
    import loads the weights whatever their dtype or values, and only the model's weights are checked."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file

    from titanlite.config import parse_args
    from titanlite.trainer import Trainer

    folder = tiny_llama_hf(tmp_path / "hf", 320)
    tensors = load_file(str(folder / "model.safetensors"))
    extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.arange(8), "model.layers.1.stats.weight": torch.full((4,), float("nan"))}
    save_file(tensors | extra, str(folder / "model.safetensors"), metadata={"format": "pt"})
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trainer = Trainer(parse_args(tiny_args(corpus_jsonl, tmp_path / "run", "--model.n_layers", "2")), torch.device("cpu"))
        trainer.checkpointer.load_hf_weights(folder)
    finally:
        dist.destroy_process_group()
    loaded = dict(trainer.model_parts[0].named_parameters())
    assert torch.equal(loaded["tok_embeddings.weight"], tensors["model.embed_tokens.weight"])
    assert torch.equal(loaded["layers.1.feed_forward.w3.weight"], tensors[UP])


OVERRIDES = [  # (model.name, flavor, model.flavor_overrides, words of the rule)
    ("llama3", "debugmodel", "n_heads=7", "n_heads=7 must divide dim=256"),
    ("llama3", "debugmodel_gqa", "n_kv_heads=3", "n_kv_heads=3 must divide n_heads=16"),
    ("llama3", "debugmodel", "dim=0", "dim=0 must be > 0"),
    ("llama3", "debugmodel", "n_heads=-4", "n_heads=-4 must be > 0"),
    ("llama3", "debugmodel", "dim=264,n_heads=8,n_kv_heads=8", "the head dim 33 (n_heads=8, dim=264) must be even"),
    ("llama3", "debugmodel", "ffn_dim_multiplier=-1", "ffn_dim_multiplier=-1.0 must be > 0"),
    ("llama3", "debugmodel", "norm_eps=0", "norm_eps=0.0 must be > 0"),
    ("llama3", "debugmodel", "head_dim_override=-2", "head_dim_override=-2 must be >= 0"),
    ("moe", "debugmoe", "top_k=9", "top_k=9 of num_experts=8"),
    ("moe", "debugmoe", "top_k=0", "top_k=0 of num_experts=8"),
    ("moe", "debugmoe", "num_experts=0", "num_experts=0 must be > 0"),
    ("moe", "debugmoe", "moe_hidden_dim=-8", "moe_hidden_dim=-8 must be > 0"),
    ("moe", "debugmoe", "num_shared_experts=-1", "num_shared_experts=-1 must be >= 0"),
    ("moe", "debugmoe", "score_func=relu", "score_func='relu' must be softmax or sigmoid"),
    ("deepseek_v3", "debugmodel", "n_group=3", "n_group=3 must divide num_experts=8"),
    ("deepseek_v3", "debugmodel", "topk_group=5", "topk_group=5 must be between 1 and n_group=4"),
    ("deepseek_v3", "debugmodel", "q_lora_rank=-1", "q_lora_rank=-1 must be >= 0"),
    ("deepseek_v3", "debugmodel", "v_head_dim=0", "v_head_dim=0 must be > 0"),
    ("deepseek_v3", "debugmodel", "mtp_depth=-1", "mtp_depth=-1 must be >= 0"),
    ("llama4", "debugmodel", "interleave_moe_layer_step=0", "interleave_moe_layer_step=0 must be >= 1"),
    ("llama4", "debugmodel", "n_kv_heads=5", "n_kv_heads=5 must divide n_heads=16"),
]


@pytest.mark.parametrize("name, flavor, overrides, words", OVERRIDES, ids=[o[2] for o in OVERRIDES])
def test_flavor_overrides_obey_the_rules_the_flavors_do(name, flavor, overrides, words):
    from titanlite.config import ConfigError, parse_args

    with pytest.raises(ConfigError, match=re.escape(f"model.flavor_overrides={overrides.split(',')}: ") + ".*" + re.escape(words)):
        parse_args(["--model.name", name, "--model.flavor", flavor, "--model.flavor_overrides", overrides])


def test_every_flavor_passes_the_shape_rules_and_mla_heads_need_not_split_dim():
    from titanlite.config import parse_args
    from titanlite.models import FAMILIES

    for name, family in FAMILIES.items():
        for flavor in family.flavors:
            parse_args(["--model.name", name, "--model.flavor", flavor])
    parse_args(["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--model.flavor_overrides", "n_heads=12,n_kv_heads=12"])
