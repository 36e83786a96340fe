"""What keeps training from going wrong quietly or hanging: non-finite gradients stop or skip a step,
tensor-parallel norm gradients are summed once, validation ranks agree on their batches, and the
async checkpoint's group keeps its own timeout. Real Trainers on gloo ranks."""

from __future__ import annotations

import json

import pytest
import torch

from distributed import run_calls
from helpers import tiny_args

pytestmark = pytest.mark.slow
SKIP = ["--training.skip_nonfinite_steps", "--training.max_skipped_steps", "1"]


@pytest.fixture(scope="module")
def one_rank(corpus_jsonl, tmp_path_factory) -> dict:
    """The values of this module's 1-rank runs, from one launch (each run a Trainer of its own)."""
    folder, data = tmp_path_factory.mktemp("one_rank"), str(corpus_jsonl)
    calls = {
        "nonfinite": (_nonfinite_grad, data, str(folder / "nonfinite"), []),
        "nonfinite_skipped": (_nonfinite_grad, data, str(folder / "skipped"), SKIP),
        "diverge_at_step_3": (_diverge_at_step_3, data, str(folder / "diverge")),
        # Last: it shortens the default group's timeout for the rest of the process.
        "timeouts": (_timeouts, data, str(folder / "timeouts")),
    }
    return {name: values[0] for name, values in zip(calls, run_calls(1, list(calls.values())))}


@pytest.fixture(scope="module")
def two_ranks(corpus_jsonl, tmp_path_factory) -> dict:
    """Every rank's values of this module's 2-rank runs, from one launch."""
    folder, data = tmp_path_factory.mktemp("two_ranks"), str(corpus_jsonl)
    pp = ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4", "--validation.local_batch_size", "4"]
    calls = {
        "tp_norm": (_tp_norm_grad_reductions, data, str(folder / "tp")),
        # FSDP 2, each rank reading its own documents: rank 0 docs 0 and 2, rank 1 doc 1.
        "validation_uneven": (_validate, data, str(folder / "uneven"), _documents(folder / "uneven.jsonl", [200, 130, 200]), []),
        # 198 tokens with BOS/EOS: 6 windows of 33.
        "validation_pp": (_validate, data, str(folder / "pp"), _documents(folder / "pp.jsonl", [196]), pp),
    }
    return dict(zip(calls, run_calls(2, list(calls.values()), timeout=180)))


def _batch(trainer, rows: int = 2):
    tokens = torch.randint(0, trainer.tokenizer.vocab_size, (rows, trainer.config.training.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    return [(tokens[:, :-1], tokens[:, 1:])]


def _nonfinite_grad(dataset: str, folder: str, overrides: list[str]) -> list:
    from titanlite.config import parse_args
    from titanlite.errors import TrainingDiverged
    from titanlite.trainer import Trainer

    trainer = Trainer(parse_args(tiny_args(dataset, folder, *overrides)), torch.device("cpu"))
    outcomes = []
    for step in range(2):
        trainer.step = step
        loss = trainer.global_loss(trainer.compute_gradients(_batch(trainer)))
        params = trainer.parameters()
        params[3].grad.view(-1)[0] = float("nan")  # a finite loss, one bad gradient entry
        before = [p.detach().clone() for p in params]
        outcome = checked = "finite"
        try:
            trainer.apply_gradients()
            outcome = "stepped"
            trainer.check_finite()  # what a log or checkpoint step asks
        except TrainingDiverged as e:
            checked = str(e) if outcome == "stepped" else checked
            outcome = outcome if outcome == "stepped" else str(e)
        outcomes.append({
            "loss_finite": loss == loss,
            "outcome": outcome,
            "checked": checked,
            "weights_unchanged": all(torch.equal(a, p.detach()) for a, p in zip(before, params)),
            "adam_steps": len(trainer.optimizers[0].state),
            "lr_schedule_step": trainer.lr_schedulers[0].last_epoch,
            "grads_cleared": all(p.grad is None for p in params),
            "skipped": trainer.skipped_steps,
        })
    return outcomes


def test_a_nonfinite_grad_norm_stops_the_run_at_the_next_check(one_rank):
    """Without skipping, the step is not held up by a wait for the norm: the device keeps the first bad
    step's number, and the next log or checkpoint step stops the run naming it."""
    first, second = one_rank["nonfinite"]
    assert first["loss_finite"] and first["outcome"] == "stepped", first
    assert "grad norm is not finite at step 0; training stopped at step 0" in first["checked"], first
    assert "skip_nonfinite_steps" in first["checked"]
    assert "not finite at step 0; training stopped at step 1" in second["checked"], second  # the first bad step


def test_skip_nonfinite_steps_skips_and_counts_up_to_its_limit(one_rank):
    first, second = one_rank["nonfinite_skipped"]
    # Skipped: no weight moved, AdamW holds no state, the lr schedule did not advance, grads are cleared.
    assert first == {"loss_finite": True, "outcome": "stepped", "checked": "finite", "weights_unchanged": True,
                     "adam_steps": 0, "lr_schedule_step": 0, "grads_cleared": True, "skipped": 1}, first
    assert "2 steps skipped, more than training.max_skipped_steps=1" in second["outcome"], second


def _diverge_at_step_3(dataset: str, folder: str) -> dict:
    from titanlite.config import parse_args
    from titanlite.train import train
    from titanlite.errors import TrainingDiverged
    from titanlite.trainer import Trainer

    args = tiny_args(dataset, folder, "--checkpoint.enable", "--checkpoint.interval", "1", "--metrics.log_freq", "10",
                     "--training.steps", "6")
    trainer = Trainer(parse_args(args), torch.device("cpu"))
    real = trainer.compute_gradients

    def compute_gradients(microbatches):
        loss = real(microbatches)
        if trainer.step == 3:
            trainer.parameters()[3].grad.view(-1)[0] = float("nan")
        return loss

    trainer.compute_gradients = compute_gradients
    try:
        train(trainer)
        error = None
    except TrainingDiverged as e:
        error = str(e)
    trainer.checkpointer.wait()
    return {"error": error, "saved": sorted(p.name for p in trainer.checkpointer.folder.iterdir() if p.name.startswith("step-"))}


def test_a_nonfinite_step_is_never_saved(one_rank):
    """Checkpoint steps check the device's flag first: the run stops at step 3, whose update touched
    the weights, and the last checkpoint is step 2's."""
    outcome = one_rank["diverge_at_step_3"]
    assert outcome["error"] and "not finite at step 3; training stopped at step 3" in outcome["error"], outcome
    assert outcome["saved"] == ["step-1", "step-2"], outcome


def _tp_norm_grad_reductions(dataset: str, folder: str) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode

    from titanlite.config import parse_args
    from titanlite.trainer import Trainer

    trainer = Trainer(parse_args(tiny_args(dataset, folder, "--parallelism.tensor_parallel_degree", "2")), torch.device("cpu"))
    trainer.compute_gradients(_batch(trainer))
    with CommDebugMode() as comm:
        trainer.apply_gradients()
    return {str(op): n for op, n in comm.get_comm_counts().items()}


def test_tensor_parallel_norm_gradients_are_summed_once(two_ranks):
    """TP 2 without FSDP: the 13 sequence-parallel norm weights' gradients arrive as pending sums.
    Clipping and the optimizer step must not each all-reduce them (that was 27 all-reduces): one
    all-reduce sums all of them, one more the grad norm."""
    counts = two_ranks["tp_norm"]
    assert counts[0] == {"c10d_functional.all_reduce": 2}, counts


def _validate(dataset: str, folder: str, validation: str, overrides: list[str]) -> float:
    from titanlite.config import parse_args
    from titanlite.trainer import Trainer

    config = parse_args(tiny_args(dataset, folder, "--validation.dataset", validation, "--validation.steps", "10", *overrides))
    return Trainer(config, torch.device("cpu")).validate()[""]


def _documents(path, byte_lengths: list[int]) -> str:
    path.write_text("".join(json.dumps({"text": "x" * n}) + "\n" for n in byte_lengths))
    return str(path)


def test_validation_ranks_agree_on_their_number_of_batches(two_ranks):
    """FSDP 2 with each rank reading its own documents: rank 0 holds 6 batches of 2 windows (33 byte
    tokens each), rank 1 holds 2. Both stop after 2, or rank 0's all-gathers would wait forever."""
    losses = two_ranks["validation_uneven"]
    assert losses[0] == losses[1] and losses[0] == losses[0], losses


def test_validation_drops_a_partial_batch_under_pipeline_microbatches(two_ranks):
    """PP 2 with 4 microbatches of 1: 6 windows make one full batch of 4 and a partial one of 2,
    which no microbatch split fits; the partial batch is dropped."""
    losses = two_ranks["validation_pp"]
    assert losses[0] == losses[1] and losses[0] == losses[0], losses


def _timeouts(dataset: str, folder: str) -> dict:
    from titanlite.config import parse_args
    from titanlite.train import shorten_collective_timeout
    from titanlite.trainer import Trainer

    config = parse_args(tiny_args(dataset, folder, "--checkpoint.enable", "--checkpoint.async_mode", "async",
                                  "--comm.train_timeout_seconds", "7", "--comm.checkpoint_timeout_seconds", "1234"))
    trainer = Trainer(config, torch.device("cpu"))
    shorten_collective_timeout(trainer)  # what the loop does after the first step
    cpu = torch.device("cpu")
    default = torch.distributed.distributed_c10d._get_default_group()
    return {
        "training": default._get_backend(cpu).options._timeout.total_seconds(),
        "async_checkpoint": trainer.checkpointer.checkpoint_group._get_backend(cpu).options._timeout.total_seconds(),
    }


def test_async_checkpoint_group_keeps_its_own_timeout(one_rank):
    from titanlite.health import GRACE

    timeouts = one_rank["timeouts"]
    # Training's collectives wait GRACE beyond comm.train_timeout_seconds: the hang watchdog reports first.
    assert timeouts == {"training": 7.0 + GRACE, "async_checkpoint": 1234.0}, timeouts
