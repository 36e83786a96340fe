"""What keeps training from going wrong quietly or hanging: non-finite gradients stop or skip a step,
tensor-parallel norm gradients are summed once, validation ranks agree on their batches, and the
async checkpoint's group keeps its own timeout. Real Trainers on gloo ranks."""

from __future__ import annotations

import json

import pytest
import torch

from distributed import run_distributed
from helpers import tiny_args

pytestmark = pytest.mark.slow


def _batch(trainer, rows: int = 2):
    tokens = torch.randint(0, trainer.tokenizer.vocab_size, (rows, trainer.config.training.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    return [(tokens[:, :-1], tokens[:, 1:])]


def _nonfinite_grad(dataset: str, folder: str, overrides: list[str]) -> list:
    from titanlite.config import parse_args
    from titanlite.train import Trainer, TrainingDiverged

    trainer = Trainer(parse_args(tiny_args(dataset, folder, *overrides)), torch.device("cpu"))
    outcomes = []
    for _ in range(2):
        loss = trainer.compute_gradients(_batch(trainer))
        params = trainer.parameters()
        params[3].grad.view(-1)[0] = float("nan")  # a finite loss, one bad gradient entry
        before = [p.detach().clone() for p in params]
        try:
            trainer.apply_gradients()
            outcome = "stepped"
        except TrainingDiverged as e:
            outcome = str(e)
        outcomes.append({
            "loss_finite": loss == loss,
            "outcome": outcome,
            "weights_unchanged": all(torch.equal(a, p.detach()) for a, p in zip(before, params)),
            "adam_steps": len(trainer.optimizers[0].state),
            "lr_schedule_step": trainer.lr_schedulers[0].last_epoch,
            "grads_cleared": all(p.grad is None for p in params),
            "skipped": trainer.skipped_steps,
        })
    return outcomes


def test_a_nonfinite_grad_norm_stops_the_run(corpus_jsonl, tmp_path):
    (outcomes,) = run_distributed(_nonfinite_grad, 1, str(corpus_jsonl), str(tmp_path), [])
    first = outcomes[0]
    assert first["loss_finite"] and "grad norm is nan at step 0; training stopped" in first["outcome"], first
    assert "skip_nonfinite_steps" in first["outcome"] and first["weights_unchanged"] and first["adam_steps"] == 0


def test_skip_nonfinite_steps_skips_and_counts_up_to_its_limit(corpus_jsonl, tmp_path):
    skip = ["--training.skip_nonfinite_steps", "--training.max_skipped_steps", "1"]
    (outcomes,) = run_distributed(_nonfinite_grad, 1, str(corpus_jsonl), str(tmp_path), skip)
    first, second = outcomes
    # Skipped: no weight moved, AdamW holds no state, the lr schedule did not advance, grads are cleared.
    assert first == {"loss_finite": True, "outcome": "stepped", "weights_unchanged": True, "adam_steps": 0,
                     "lr_schedule_step": 0, "grads_cleared": True, "skipped": 1}, first
    assert "2 steps skipped, more than training.max_skipped_steps=1" in second["outcome"], second


def _tp_norm_grad_reductions(dataset: str, folder: str) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode

    from titanlite.config import parse_args
    from titanlite.train import Trainer

    trainer = Trainer(parse_args(tiny_args(dataset, folder, "--parallelism.tensor_parallel_degree", "2")), torch.device("cpu"))
    trainer.compute_gradients(_batch(trainer))
    with CommDebugMode() as comm:
        trainer.apply_gradients()
    return {str(op): n for op, n in comm.get_comm_counts().items()}


def test_tensor_parallel_norm_gradients_are_summed_once(corpus_jsonl, tmp_path):
    """TP 2 without FSDP: the 13 sequence-parallel norm weights' gradients arrive as pending sums.
    Clipping and the optimizer step must not each all-reduce them (that was 27 all-reduces): one
    all-reduce sums all of them, one more the grad norm."""
    counts = run_distributed(_tp_norm_grad_reductions, 2, str(corpus_jsonl), str(tmp_path))
    assert counts[0] == {"c10d_functional.all_reduce": 2}, counts


def _validate(dataset: str, folder: str, validation: str, overrides: list[str]) -> float:
    from titanlite.config import parse_args
    from titanlite.train import Trainer

    config = parse_args(tiny_args(dataset, folder, "--validation.dataset", validation, "--validation.steps", "10", *overrides))
    return Trainer(config, torch.device("cpu")).validate()


def _documents(path, byte_lengths: list[int]) -> str:
    path.write_text("".join(json.dumps({"text": "x" * n}) + "\n" for n in byte_lengths))
    return str(path)


def test_validation_ranks_agree_on_their_number_of_batches(corpus_jsonl, tmp_path):
    """FSDP 2 with each rank reading its own documents: rank 0 holds 6 batches of 2 windows (33 byte
    tokens each), rank 1 holds 2. Both stop after 2, or rank 0's all-gathers would wait forever."""
    validation = _documents(tmp_path / "val.jsonl", [200, 130, 200])  # rank 0: docs 0 and 2, rank 1: doc 1
    losses = run_distributed(_validate, 2, str(corpus_jsonl), str(tmp_path / "run"), validation, [], timeout=120)
    assert losses[0] == losses[1] and losses[0] == losses[0], losses


def test_validation_drops_a_partial_batch_under_pipeline_microbatches(corpus_jsonl, tmp_path):
    """PP 2 with 4 microbatches of 1: 6 windows make one full batch of 4 and a partial one of 2,
    which no microbatch split fits; the partial batch is dropped."""
    validation = _documents(tmp_path / "val.jsonl", [196])  # 198 tokens with BOS/EOS: 6 windows of 33
    pp = ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4", "--validation.local_batch_size", "4"]
    losses = run_distributed(_validate, 2, str(corpus_jsonl), str(tmp_path / "run"), validation, pp, timeout=120)
    assert losses[0] == losses[1] and losses[0] == losses[0], losses


def _timeouts(dataset: str, folder: str) -> dict:
    from titanlite.config import parse_args
    from titanlite.train import Trainer

    config = parse_args(tiny_args(dataset, folder, "--checkpoint.enable", "--checkpoint.async_mode", "async",
                                  "--comm.train_timeout_seconds", "7", "--comm.checkpoint_timeout_seconds", "1234"))
    trainer = Trainer(config, torch.device("cpu"))
    trainer.shorten_collective_timeout()  # what the loop does after the first step
    cpu = torch.device("cpu")
    default = torch.distributed.distributed_c10d._get_default_group()
    return {
        "training": default._get_backend(cpu).options._timeout.total_seconds(),
        "async_checkpoint": trainer.checkpointer.checkpoint_group._get_backend(cpu).options._timeout.total_seconds(),
    }


def test_async_checkpoint_group_keeps_its_own_timeout(corpus_jsonl, tmp_path):
    (timeouts,) = run_distributed(_timeouts, 1, str(corpus_jsonl), str(tmp_path))
    assert timeouts == {"training": 7.0, "async_checkpoint": 1234.0}, timeouts
