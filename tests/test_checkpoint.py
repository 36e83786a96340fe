"""Checkpoints through the real CLI: exact resume (stop, kill -9), crash during save, resharding across
layouts (data position included), async save, seed checkpoint, Hugging Face export and import."""

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import REPO, launch, random_hf_model, run_command, tiny_args
from titanlite.launch import trainer_command

pytestmark = pytest.mark.slow

# A constant lr after warmup (decay_ratio 0): a 10-step run stops on the same schedule as a 20-step one.
COMMON = ["--checkpoint.enable", "--lr_scheduler.decay_ratio", "0", "--training.data_split", "sequences", "--metrics.log_freq", "1"]


def losses(folder) -> dict[int, float]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def first_logged_step(stdout: str) -> int:
    return int(re.search(r"^step +(\d+) \| loss", stdout, re.MULTILINE).group(1))


@pytest.fixture(scope="module")
def straight(corpus_jsonl, tmp_path_factory) -> dict[int, float]:
    """The losses of an uninterrupted 20-step run (1 process, COMMON's constant lr, a checkpoint at step
    10): what each resumed 1-process run below must log bitwise. Shorter runs log the same steps, as
    the lr does not depend on the run's length and saves do not change training."""
    folder = tmp_path_factory.mktemp("straight")
    launch(1, tiny_args(corpus_jsonl, folder, *COMMON, "--training.steps", "20", "--checkpoint.interval", "10"))
    return losses(folder)


def test_exact_resume_after_stop_one_process(corpus_jsonl, tmp_path, straight):
    args = lambda folder, steps: tiny_args(corpus_jsonl, folder, *COMMON, "--training.steps", str(steps), "--checkpoint.interval", "10")
    launch(1, args(tmp_path / "resumed", 10))
    out = launch(1, args(tmp_path / "resumed", 20))
    assert f"loaded checkpoint {tmp_path / 'resumed' / 'checkpoint' / 'step-10'} (" in out.stdout
    resumed = losses(tmp_path / "resumed")
    assert sorted(resumed) == list(range(1, 21))  # the resumed run appended steps 11-20
    assert [resumed[s] for s in range(11, 21)] == [straight[s] for s in range(11, 21)]  # bitwise
    # Throughput counts this run's 10 steps of 2 x 32 tokens, not the 20 steps since step 0.
    assert "final loss" in out.stdout and "this run: 10 steps, 640 tokens in" in out.stdout


@pytest.mark.full  # in scripts/test_full.sh: the default suite stays under 20 minutes
def test_a_model_only_final_save_is_passed_over_when_resuming(corpus_jsonl, tmp_path, straight):
    """last_save_model_only (TorchTitan's default) makes the last save weights only: extending the run
    resumes from the newest full checkpoint instead of restarting at step 0 from those weights."""
    args = lambda folder, steps: tiny_args(corpus_jsonl, folder, *COMMON, "--training.steps", str(steps),
                                           "--checkpoint.interval", "2", "--checkpoint.last_save_model_only", "true")
    launch(1, args(tmp_path / "extended", 3))  # full step-2, model-only step-3
    out = launch(1, args(tmp_path / "extended", 5))
    assert "step-3 holds the model only (last_save_model_only); resuming from step-2" in out.stdout
    assert f"loaded checkpoint {tmp_path / 'extended' / 'checkpoint' / 'step-2'} (" in out.stdout
    extended = losses(tmp_path / "extended")
    assert [extended[s] for s in (3, 4, 5)] == [straight[s] for s in (3, 4, 5)]
    # Only a model-only checkpoint: one line saying how to start from its weights.
    only = lambda steps: tiny_args(corpus_jsonl, tmp_path / "only", *COMMON, "--training.steps", str(steps),
                                   "--checkpoint.last_save_model_only", "true")
    launch(1, only(1))
    out = launch(1, only(2), expect=2)
    assert "holds the model only (checkpoint.last_save_model_only=true)" in out.stderr, out.stderr
    assert f"checkpoint.initial_load_path={tmp_path / 'only' / 'checkpoint' / 'step-1'}" in out.stderr


def test_a_checkpoint_of_the_older_layout_is_refused_in_one_line(tmp_path):
    import torch.distributed.checkpoint as dcp

    from titanlite.checkpoint.checkpointer import Checkpointer
    from titanlite.config import ConfigError

    old = tmp_path / "step-4"
    dcp.save({"model": {"w": torch.zeros(2)}, "train": {"step": torch.tensor(4)}}, checkpoint_id=str(old), no_dist=True)
    with pytest.raises(ConfigError, match="older than its TorchTitan v0.2.2 schema .*checkpoint.initial_load_path="):
        Checkpointer.resumable(old)
    new = tmp_path / "step-5"
    dcp.save({"model": {"w": torch.zeros(2)}, "train_state": {"step": torch.tensor(5)}}, checkpoint_id=str(new), no_dist=True)
    assert Checkpointer.resumable(new)
    model_only = tmp_path / "step-6"
    dcp.save({"model": {"w": torch.zeros(2)}}, checkpoint_id=str(model_only), no_dist=True)
    assert not Checkpointer.resumable(model_only)


def test_exact_resume_after_kill_9_fsdp2_tp2(corpus_jsonl, tmp_path):
    layout = ["--parallelism.tensor_parallel_degree", "2", "--model.flavor", "debugmodel_gqa"]
    args = lambda folder: tiny_args(corpus_jsonl, folder, *COMMON, *layout, "--training.steps", "10", "--checkpoint.interval", "5")
    launch(4, args(tmp_path / "straight"))

    folder = tmp_path / "killed"
    proc = subprocess.Popen(trainer_command(4, args(folder)), cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not (folder / "checkpoint" / "step-5" / ".metadata").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher, mid-training after its checkpoint
    proc.wait()
    # torchrun gives each rank a session of its own, so the kill reaches the launcher alone: the
    # ranks must notice it and exit rather than train on beside the job that resumes.
    deadline = time.monotonic() + 30
    while subprocess.run(["pgrep", "-f", str(folder)], capture_output=True).returncode == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert subprocess.run(["pgrep", "-f", str(folder)], capture_output=True).returncode == 1, "ranks outlived their launcher"
    assert (folder / "checkpoint" / "step-5").exists() and not (folder / "checkpoint" / "step-10").exists()

    out = launch(4, args(folder))
    assert f"loaded checkpoint {folder / 'checkpoint' / 'step-5'} (" in out.stdout
    assert first_logged_step(out.stdout) == 6  # it continued from the checkpoint, not from step 1
    straight, resumed = losses(tmp_path / "straight"), losses(folder)
    assert [resumed[s] for s in range(6, 11)] == [straight[s] for s in range(6, 11)]


def crash(point: str, args: list[str]) -> None:
    # One thread, as torchrun gives the runs it is compared with: two threads split sums differently.
    out = run_command([sys.executable, str(REPO / "tests" / "crash_during_save.py"), point, *args], cwd=REPO,
                      env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 137, (point, out.stderr[-2000:])


def test_a_crash_at_any_point_of_a_save_resumes_from_the_last_good_checkpoint(corpus_jsonl, tmp_path, straight):
    """Die (exit 137, as kill -9) at each point of the step-4 save, then rerun: the last complete
    checkpoint loads, the run ends like an uninterrupted one, and nothing unfinished is left."""
    from titanlite.checkpoint.paths import complete_steps

    args = lambda folder, *extra: tiny_args(corpus_jsonl, folder, *COMMON, "--training.steps", "6",
                                            "--checkpoint.interval", "2", *extra)
    keep_one = ["--checkpoint.keep_latest_k", "1"]
    for point, last_good in [("data_written", 2), ("before_commit", 2), ("during_removal", 4)]:
        folder = tmp_path / point
        crash(point, args(folder, *keep_one))
        # A half-removed step-2 must not look complete (it still has its .metadata).
        assert complete_steps(folder / "checkpoint") == [last_good], point
        out = launch(1, args(folder, *keep_one))
        assert f"loaded checkpoint {folder / 'checkpoint' / f'step-{last_good}'} (" in out.stdout, (point, out.stdout[-2000:])
        assert sorted(p.name for p in (folder / "checkpoint").iterdir()) == ["step-6"], point  # tmp and half-removed folders gone
        resumed = losses(folder)
        assert [resumed[s] for s in range(last_good + 1, 7)] == [straight[s] for s in range(last_good + 1, 7)], point


def test_a_crash_while_a_step_is_saved_again_keeps_the_old_checkpoint(corpus_jsonl, tmp_path):
    """A run rewound to step 2 saves step 4 again; dying after the old step-4 was moved aside and
    before the new one took its place, the next start puts the old one back: it loads as before."""
    args = lambda *extra: tiny_args(corpus_jsonl, tmp_path, *COMMON, "--training.steps", "6", "--checkpoint.interval", "2",
                                    "--checkpoint.keep_latest_k", "0", *extra)
    launch(1, args())
    crash("between_renames", args("--checkpoint.load_step", "2"))
    assert not (tmp_path / "checkpoint" / "step-4").exists()
    out = launch(1, args("--checkpoint.load_step", "4"))
    assert f"loaded checkpoint {tmp_path / 'checkpoint' / 'step-4'} (" in out.stdout and " at step 4" in out.stdout, out.stdout[-2000:]
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-2", "step-4", "step-6"]


def test_metadata_that_would_patch_a_class_is_refused(tmp_path):
    """Protocol-0 pickle: a DCP metadata class, then BUILD with {'__eq__': None}, which would set the
    attribute on the class itself for the whole process."""
    from titanlite.checkpoint.reader import read_metadata_safely
    from titanlite.config import ConfigError
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = tmp_path / ".metadata"
    path.write_bytes(b"ctorch.distributed.checkpoint.metadata\nTensorStorageMetadata\n}(X\x06\x00\x00\x00__eq__Nub.")
    with pytest.raises(ConfigError, match="sets attributes of <class"):
        read_metadata_safely(path)
    assert TensorStorageMetadata.__eq__ is not None


def test_resharding_fsdp2_to_tp2_one_process_and_pp2(corpus_jsonl, tmp_path):
    """Save on FSDP 2; load on TP 2, 1 process and PP 2: the next step's loss matches FSDP 2's own."""
    source = tmp_path / "fsdp2"
    launch(2, tiny_args(corpus_jsonl, source, *COMMON, "--training.steps", "4", "--checkpoint.interval", "3"))
    expected = losses(source)[4]
    start = ["--checkpoint.initial_load_path", str(source / "checkpoint" / "step-3"), "--checkpoint.initial_load_model_only", "false",
             "--training.steps", "4"]
    for name, nproc, layout in [
        ("tp2", 2, ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"]),
        ("single", 1, ["--training.local_batch_size", "4"]),
        ("pp2", 2, ["--training.local_batch_size", "4", "--parallelism.pipeline_parallel_degree", "2"]),
    ]:
        out = launch(nproc, tiny_args(corpus_jsonl, tmp_path / name, *COMMON, *start, *layout))
        assert "re-split from 2 to 1" in out.stdout, name
        assert list(losses(tmp_path / name)) == [4], name
        assert abs(losses(tmp_path / name)[4] - expected) < 1e-5, (name, losses(tmp_path / name), expected)


@pytest.mark.full  # in scripts/test_full.sh: the default suite stays under 20 minutes
def test_async_save_of_a_float8_fsdp_run_resumes_exactly(corpus_jsonl, tmp_path):
    """Also: float8 all-gather weights (a tensor subclass) are saved as plain tensors and restored."""
    float8 = ["--model.converters", "float8", "--quantize.linear.float8.emulate", "--quantize.linear.float8.enable_fsdp_float8_all_gather"]
    args = lambda folder, steps: tiny_args(corpus_jsonl, folder, *COMMON, *float8, "--training.steps", str(steps),
                                            "--checkpoint.interval", "3", "--checkpoint.async_mode", "async",
                                            "--checkpoint.keep_latest_k", "2")
    launch(2, args(tmp_path / "straight", 8))
    out = launch(2, args(tmp_path / "async", 6))
    assert "async save started" in out.stdout and "async save complete" in out.stdout
    assert sorted(p.name for p in (tmp_path / "async" / "checkpoint").iterdir()) == ["step-3", "step-6"]
    out = launch(2, args(tmp_path / "async", 8))
    assert f"loaded checkpoint {tmp_path / 'async' / 'checkpoint' / 'step-6'} (" in out.stdout
    assert first_logged_step(out.stdout) == 7
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "async")
    assert [resumed[s] for s in (7, 8)] == [straight[s] for s in (7, 8)]
    assert sorted(p.name for p in (tmp_path / "async" / "checkpoint").iterdir()) == ["step-6", "step-8"]  # keep_latest_k


def test_seed_checkpoint_gives_every_layout_the_same_start(corpus_jsonl, tmp_path):
    seed = tmp_path / "seed"
    launch(1, tiny_args(corpus_jsonl, seed, "--checkpoint.create_seed_checkpoint", "--debug.seed", "7"))
    assert (seed / "checkpoint" / "step-0" / ".metadata").exists()
    from_seed = ["--checkpoint.initial_load_path", str(seed / "checkpoint" / "step-0"), "--training.steps", "1",
                 "--training.data_split", "sequences"]
    launch(1, tiny_args(corpus_jsonl, tmp_path / "ref7", "--debug.seed", "7", "--training.steps", "1",
                        "--training.local_batch_size", "4", "--training.data_split", "sequences"))
    launch(2, tiny_args(corpus_jsonl, tmp_path / "fsdp2", *from_seed))  # its own seed (42) is overridden
    assert abs(losses(tmp_path / "fsdp2")[1] - losses(tmp_path / "ref7")[1]) < 1e-5


def test_hugging_face_export_matches_transformers_and_imports_back(corpus_jsonl, tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")
    same = ["--checkpoint.enable", "--training.steps", "3", "--model.flavor", "debugmodel_gqa", "--training.data_split", "sequences"]
    launch(1, tiny_args(corpus_jsonl, tmp_path / "run", *same))
    step = tmp_path / "run" / "checkpoint" / "step-3"
    convert = [sys.executable, str(REPO / "scripts" / "convert_hf.py")]
    assert run_command([*convert, "to-hf", str(step), str(tmp_path / "hf"), "--flavor", "debugmodel_gqa"], cwd=REPO).returncode == 0
    assert run_command([*convert, "from-hf", str(tmp_path / "hf"), str(tmp_path / "back")], cwd=REPO).returncode == 0

    from titanlite.checkpoint.checkpointer import read_model_weights as read_model
    from titanlite.models import model_args
    from titanlite.models.llama3.model import Transformer

    ours = Transformer(model_args("llama3", "debugmodel_gqa", 259, 64))
    ours.load_state_dict(read_model(step))
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32)
    tokens = torch.randint(0, 259, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), rtol=1e-4, atol=1e-4)
    back = read_model(tmp_path / "back")
    for name, value in ours.state_dict().items():
        if name != "rope":
            assert torch.equal(back[name], value), name
    # Large models go out in shards with an index, as transformers writes them.
    from titanlite.checkpoint.checkpointer import write_hf
    from titanlite.models.llama3 import hf as llama3_hf

    write_hf(step, tmp_path / "sharded", ours.args, torch.float32, llama3_hf, shard_bytes=2**20)
    assert len(list((tmp_path / "sharded").glob("model-*-of-*.safetensors"))) > 3
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    sharded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "sharded"), torch_dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(sharded(tokens).logits, hf(tokens).logits, rtol=0, atol=0)

    # The same export from training itself (checkpoint.last_save_in_hf), here by 2 FSDP ranks.
    from safetensors.torch import load_file

    launch(2, tiny_args(corpus_jsonl, tmp_path / "fsdp", *same, "--training.local_batch_size", "1",
                        "--checkpoint.last_save_model_only", "true", "--checkpoint.last_save_in_hf"))
    saved = tmp_path / "fsdp" / "checkpoint" / "step-3"
    assert sorted(p.name for p in saved.iterdir()) == ["config.json", "model.safetensors"]
    exported, converted = load_file(str(saved / "model.safetensors")), load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert exported.keys() == converted.keys()
    for name in converted:
        # 3 AdamW steps on gradients summed in another order: near-zero gradients' round-off moves a
        # weight by up to ~2e-6 (test_parallel_parity.py's free-running bounds), not by a conversion error.
        torch.testing.assert_close(exported[name], converted[name], rtol=1e-5, atol=1e-5)

    # Training starts from HF weights (checkpoint.initial_load_in_hf) as from the same weights in DCP.
    first = ["--training.steps", "1", "--model.flavor", "debugmodel_gqa"]
    from_hf = launch(1, tiny_args(corpus_jsonl, tmp_path / "from_hf", *first, "--checkpoint.initial_load_in_hf",
                                  "--checkpoint.initial_load_path", str(tmp_path / "sharded")))
    launch(1, tiny_args(corpus_jsonl, tmp_path / "from_dcp", *first, "--checkpoint.initial_load_path", str(step)))
    assert "loaded Hugging Face weights" in from_hf.stdout
    assert losses(tmp_path / "from_hf") == losses(tmp_path / "from_dcp")
    assert losses(tmp_path / "from_hf")[1] < 5.0  # trained weights: far below the ~5.6 of random ones (ln 259)
    out = launch(1, tiny_args(corpus_jsonl, tmp_path / "wrong", "--training.steps", "1", "--checkpoint.initial_load_in_hf",
                              "--checkpoint.initial_load_path", str(tmp_path / "hf")), expect=2)
    assert "has num_key_value_heads=4, the model being trained 16" in out.stderr, out.stderr


def _load_pickled_checkpoint(path: str) -> str:
    from types import SimpleNamespace

    import torch.distributed.checkpoint as dcp

    from titanlite.checkpoint.checkpointer import Checkpointer
    from titanlite.config import ConfigError, parse_args

    # A checkpoint whose train_state.step is a Python object: DCP would unpickle it on load.
    dcp.save({"train_state": {"step": 7, "tokens_seen": torch.tensor(0)}}, checkpoint_id=path)
    checkpointer = Checkpointer(parse_args([]), SimpleNamespace())
    try:
        checkpointer.load_from(__import__("pathlib").Path(path), {"train_state"})
    except ConfigError as e:
        return str(e)
    return "loaded"


def test_loading_refuses_non_tensor_entries(tmp_path):
    from distributed import run_distributed

    (message,) = run_distributed(_load_pickled_checkpoint, 1, str(tmp_path / "bad"))
    assert "entry 'train_state.step' is not a tensor; refusing to unpickle it" in message


class _RunsCode:
    """Unpickling this calls os.system: what a crafted checkpoint could do to whoever loads it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_loading_never_unpickles_code_from_the_metadata(corpus_jsonl, tmp_path):
    """A checkpoint whose DCP .metadata pickle would run a command: resuming it, starting from it
    (initial_load_path) and converting it each stop with one line naming the file; nothing runs."""
    marker = tmp_path / "code_ran"
    run = tmp_path / "run"
    launch(1, tiny_args(corpus_jsonl, run, "--checkpoint.enable", "--training.steps", "2", "--checkpoint.interval", "2"))
    step = run / "checkpoint" / "step-2"
    (step / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    env = {**os.environ, "NGPU": "1", "PYTHON": sys.executable}
    message = f"checkpoint metadata '{step / '.metadata'}' is not plain DCP metadata (it references posix.system)"
    for args in (tiny_args(corpus_jsonl, run, "--checkpoint.enable", "--training.steps", "4")[2:],
                 tiny_args(corpus_jsonl, tmp_path / "other", "--checkpoint.initial_load_path", str(step))[2:]):
        out = run_command(["./run_train.sh", *args], cwd=REPO, env=env)
        assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and message in out.stderr, out.stderr[-2000:]
    out = run_command([sys.executable, str(REPO / "scripts" / "convert_hf.py"), "to-hf", str(step), str(tmp_path / "hf")], cwd=REPO)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]
    assert not marker.exists()


@pytest.mark.full  # in scripts/test_full.sh: the default suite stays under 20 minutes
def test_moe_resharding_across_expert_parallel_degrees(corpus_jsonl, tmp_path):
    """Save a MoE run on EP 2; resume on EP 2 (bitwise), 1 process and EP 4 x FSDP: the next step's
    loss matches EP 2's own, and the expert bias (training state, not a weight) comes back."""
    from titanlite.checkpoint.checkpointer import read_model_weights

    moe = [*COMMON, "--model.name", "moe", "--model.flavor", "debugmoe", "--model.moe_load_balance_coeff", "0.01"]
    source = tmp_path / "source"
    launch(2, tiny_args(corpus_jsonl, source, *moe, "--training.steps", "4", "--checkpoint.interval", "3",
                        "--parallelism.expert_parallel_degree", "2"))
    expected = losses(source)[4]
    saved = read_model_weights(source / "checkpoint" / "step-3", {"layers.1.feed_forward.expert_bias"})
    assert saved["layers.1.feed_forward.expert_bias"].abs().sum() > 0  # it moved in 3 steps
    start = ["--checkpoint.initial_load_path", str(source / "checkpoint" / "step-3"), "--checkpoint.initial_load_model_only", "false",
             "--training.steps", "4"]
    for name, nproc, layout in [
        ("ep2", 2, ["--parallelism.expert_parallel_degree", "2"]),
        ("single", 1, ["--training.local_batch_size", "4"]),
        ("ep4", 4, ["--training.local_batch_size", "1", "--parallelism.expert_parallel_degree", "4"]),
    ]:
        launch(nproc, tiny_args(corpus_jsonl, tmp_path / name, *moe, *start, *layout))
        assert list(losses(tmp_path / name)) == [4], name
        if name == "ep2":
            assert losses(tmp_path / name)[4] == expected  # the same layout: bitwise
        assert abs(losses(tmp_path / name)[4] - expected) < 1e-5, (name, losses(tmp_path / name), expected)
        # The bias after step 4 is the saved one moved by one more step (sign steps of 0.01, centered).
        bias = read_model_weights(tmp_path / name / "checkpoint" / "step-4", {"layers.1.feed_forward.expert_bias"})
        step = bias["layers.1.feed_forward.expert_bias"] - saved["layers.1.feed_forward.expert_bias"]
        assert step.abs().max() <= 0.02 + 1e-6 and step.abs().sum() > 0, (name, step)


def test_qwen3_moe_weights_round_trip_through_hugging_face_names(tmp_path):
    """Without transformers (the full suite checks the same against it): every debugmoe_qwen3 weight,
    written in Hugging Face's names and layout (one tensor per expert, q/k rows as halves) in shards,
    reads back equal; a nonzero expert bias is refused, as Qwen3-MoE has none."""
    from titanlite.config import ConfigError
    from titanlite.models.hf import load_hf
    from titanlite.models.moe.hf import save_hf
    from titanlite.models import model_args
    from titanlite.models.moe.model import MoETransformer

    args = model_args("moe", "debugmoe_qwen3", 259, 64)
    torch.manual_seed(0)
    state = {name: torch.randn_like(w) for name, w in MoETransformer(args).state_dict().items()}
    state |= {name: torch.zeros_like(w) for name, w in state.items() if name.endswith("expert_bias")}
    sizes = {name: w.numel() for name, w in state.items()}
    save_hf(lambda names: {n: state[n] for n in names}, sizes, args, tmp_path, torch.float32, shard_bytes=2**20)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    back = load_hf(tmp_path)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[name], w) for name, w in state.items())
    biased = next(name for name in state if name.endswith("expert_bias"))
    with pytest.raises(ConfigError, match="expert_bias is not zero"):
        save_hf(lambda names: {n: state[n] + (n == biased) for n in names}, sizes, args, tmp_path / "biased", torch.float32)


def test_hugging_face_import_picks_the_family_by_model_type(tmp_path):
    """load_hf reads a folder through the mapping of the family config.json's model_type names, and
    refuses, in one line, an architecture no family maps."""
    from titanlite.models.hf import load_hf
    from titanlite.config import ConfigError
    from titanlite.models import FAMILIES, family_of_hf_model

    assert family_of_hf_model("llama", tmp_path) is FAMILIES["llama3"]
    assert family_of_hf_model("qwen3_moe", tmp_path) is FAMILIES["moe"]
    assert family_of_hf_model("qwen3", tmp_path) is FAMILIES["qwen3"]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "num_attention_heads": 4}))
    with pytest.raises(ConfigError, match="model_type='gpt2', which no titanlite family maps; use a model of one of: llama, qwen3, qwen3_moe, deepseek_v3"):
        load_hf(tmp_path)


@pytest.mark.full  # by default the round trip above checks the MoE mapping without transformers
def test_qwen3_moe_hugging_face_import_and_export_match_transformers(corpus_jsonl, tmp_path):
    """A random Qwen3MoeForCausalLM (the debugmoe_qwen3 shapes: a dense first block, 8 experts, q/k
    norms) imports through convert_hf.py with the same logits, exports back to the same weights, and
    a run on EP 2 exports through checkpoint.last_save_in_hf as transformers reads it."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")
    from titanlite.checkpoint.checkpointer import read_model_weights
    from titanlite.models import model_args
    from titanlite.models.moe.model import MoETransformer

    args = model_args("moe", "debugmoe_qwen3", 259, 64)
    config = transformers.Qwen3MoeConfig(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn_hidden_dim, moe_intermediate_size=args.moe_hidden_dim,
        num_experts=args.num_experts, num_experts_per_tok=args.top_k, norm_topk_prob=True, num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads, head_dim=args.head_dim, mlp_only_layers=[0],
        rope_theta=args.rope_theta, rms_norm_eps=args.norm_eps, initializer_range=0.1,  # wide enough to spread the routing
    )
    reference = random_hf_model(transformers.Qwen3MoeForCausalLM, config)  # a misplaced q/k norm permutation shows
    reference.save_pretrained(str(tmp_path / "hf"))
    convert = [sys.executable, str(REPO / "scripts" / "convert_hf.py")]
    out = run_command([*convert, "from-hf", str(tmp_path / "hf"), str(tmp_path / "dcp")], cwd=REPO)
    assert out.returncode == 0, out.stderr

    ours = MoETransformer(args)
    # Every entry of the model, the expert bias too: zero, as Qwen3-MoE routes without one.
    imported = read_model_weights(tmp_path / "dcp")
    ours.load_state_dict(imported)
    assert all(not imported[f"layers.{i}.feed_forward.expert_bias"].any() for i in range(1, 4))
    ours.eval()
    tokens = torch.randint(0, 259, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), reference(tokens).logits, rtol=1e-4, atol=1e-4)

    out = run_command([*convert, "to-hf", str(tmp_path / "dcp"), str(tmp_path / "back"), "--model", "moe", "--flavor", "debugmoe_qwen3"], cwd=REPO)
    assert out.returncode == 0, out.stderr
    back = transformers.Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
    for (name, p), (_, q) in zip(reference.state_dict().items(), back.state_dict().items()):
        assert torch.equal(p, q), name

    # A run on 2 expert-parallel ranks exports its last step in Hugging Face format.
    run = ["--model.name", "moe", "--model.flavor", "debugmoe_qwen3", "--training.steps", "2", "--checkpoint.enable",
           "--checkpoint.last_save_model_only", "true", "--checkpoint.last_save_in_hf", "--parallelism.expert_parallel_degree", "2"]
    launch(2, tiny_args(corpus_jsonl, tmp_path / "ep2", *run))
    exported = tmp_path / "ep2" / "checkpoint" / "step-2"
    trained = transformers.Qwen3MoeForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    from titanlite.models.hf import load_hf

    ours.load_state_dict(load_hf(exported))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), trained(tokens).logits, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(trained(tokens).logits, reference(tokens).logits)  # it is the trained model

    # Training starts from the imported checkpoint as from the Hugging Face folder itself.
    first = ["--model.name", "moe", "--model.flavor", "debugmoe_qwen3", "--training.steps", "1"]
    launch(1, tiny_args(corpus_jsonl, tmp_path / "from_dcp", *first, "--checkpoint.initial_load_path", str(tmp_path / "dcp")))
    launch(1, tiny_args(corpus_jsonl, tmp_path / "from_hf", *first, "--checkpoint.initial_load_in_hf",
                        "--checkpoint.initial_load_path", str(tmp_path / "hf")))
    assert losses(tmp_path / "from_dcp") == losses(tmp_path / "from_hf")

    # Weights trained with an expert bias cannot go out as Qwen3-MoE: refused before training, on every rank.
    biased = [*first, "--model.moe_load_balance_coeff", "0.01", "--checkpoint.enable", "--checkpoint.last_save_model_only", "false"]
    launch(1, tiny_args(corpus_jsonl, tmp_path / "biased", *biased))
    export = [*first, "--checkpoint.enable", "--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only", "true",
              "--checkpoint.initial_load_path", str(tmp_path / "biased" / "checkpoint" / "step-1")]
    out = launch(1, tiny_args(corpus_jsonl, tmp_path / "export", *export), expect=2)
    assert "the loaded model's expert bias is not zero" in out.stderr, out.stderr[-2000:]
