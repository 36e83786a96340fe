"""A long run's guards against faults injected through the config (real gloo ranks, the real CLI):
a poisoned batch and a flipped gradient bit are found as spikes, named by rank and skipped; a slowed
rank is named a straggler; a hung rank leaves every rank's stack on disk, is named in one line, and
the restart torchrun makes resumes; bad settings are one line."""

from __future__ import annotations

import json
import math
import re
import time

import pytest

from helpers import launch, tiny_args


def rows(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_a_spike_is_named_by_rank_and_its_update_skipped(corpus_jsonl, tmp_path):
    """FSDP 2, rank 1's batch at step 7 makes logits 100x: found against 6 steps of history, rank 1
    named, the update skipped, and the run ends with finite losses."""
    args = tiny_args(corpus_jsonl, tmp_path, "--training.steps", "10", "--health.spike_window", "6",
                     "--fault_injection.kind", "spike_batch", "--fault_injection.step", "7", "--fault_injection.rank", "1")
    out = launch(2, args)
    spikes = re.findall(r"step (\d+): spike: [^\n]*?rank (\d) \([^)]*\) holds the largest part (of the [a-z' ]+); update skipped", out.stdout)
    assert set(spikes) == {("7", "1", "of the loss")}, out.stdout[-3000:]  # (each rank prints it)
    assert "a spike at step 7: optimizer step skipped (1 skipped so far)" in out.stdout
    logged = rows(tmp_path)
    assert [r["health_spike_rank"] for r in logged if "health_spike" in r] == [1.0]
    losses = [r["loss"] for r in logged if "loss" in r]
    assert len(losses) == 10 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    from titanlite.goodput import read

    end = read(tmp_path)[-1]  # goodput counts the skipped step apart from the 9 kept
    assert (end["event"], end["steps"], end["skipped_steps"]) == ("end", 9, 1) and end["skipped_s"] > 0


def test_a_rolled_back_spike_ends_as_a_run_that_skipped_its_batches_from_the_start(corpus_jsonl, tmp_path):
    """FSDP 2, a checkpoint every 3 steps: rank 1's batch 9 spikes; the run rolls back past the 4
    batches that led into it (6-9) to step 3's checkpoint (step 6's, trained on batch 6, set aside), and
    from there logs, step for step, what a run told from the start to skip batches 6-9 logs, bitwise."""
    common = ["--training.steps", "12", "--health.spike_window", "6", "--health.spike_policy", "rollback",
              "--health.rollback_batches", "4", "--checkpoint.enable", "--checkpoint.interval", "3"]
    rolled, told = tmp_path / "rolled", tmp_path / "told"
    out = launch(2, tiny_args(corpus_jsonl, rolled, *common, "--fault_injection.kind", "spike_batch",
                              "--fault_injection.step", "9", "--fault_injection.rank", "1"))
    assert ("step 9: rolled back to checkpoint step-3; batches 6-9 skipped from now on (to repeat this run from the "
            "start: --health.skip_batches 6-9)") in out.stdout, out.stdout[-3000:]
    assert (rolled / "checkpoint" / "step-6.rolled_back").is_dir()
    out = launch(2, tiny_args(corpus_jsonl, told, *common, "--health.skip_batches", "6-9"))
    logged = [r for r in rows(rolled) if "loss" in r]
    assert [r["step"] for r in logged] == list(range(1, 10)) + list(range(4, 13))
    final = {r["step"]: r for r in logged}  # the rows after the rollback replace those before it
    keys = ("loss", "grad_norm", "lr", "tokens_seen")
    expected = [[r[k] for k in keys] for r in rows(told) if "loss" in r]
    assert [[final[s][k] for k in keys] for s in range(1, 13)] == expected
    assert logged[5]["loss"] != final[6]["loss"]  # step 6 trained on batch 6 before, on batch 10 after
    assert all(math.isfinite(r["loss"]) for r in logged)
    from titanlite.goodput import read, report

    summary = report(read(rolled))  # steps 4-8 lost, step 9 skipped, each of the 12 final steps kept once
    assert (summary["attempts"], summary["kept_steps"], summary["lost_steps"]) == (2, 12, 5), summary
    # A spike that rollbacks do not cure stops the run: here no rollback is allowed at all.
    stopped = tmp_path / "stopped"
    out = launch(2, tiny_args(corpus_jsonl, stopped, *common, "--health.max_rollbacks", "0",
                              "--fault_injection.kind", "spike_batch", "--fault_injection.step", "9",
                              "--fault_injection.rank", "1"), expect=1)
    assert "titanlite: step 9: a spike after 0 rollbacks (health.max_rollbacks)" in out.stderr, out.stderr[-3000:]


def test_skipped_batches_are_drawn_and_dropped_and_counted():
    from types import SimpleNamespace

    from titanlite.config import parse_args
    from titanlite.rollback import Batches, ranges

    batches = Batches(parse_args(["--health.skip_batches", "2-3,6"]))
    data = iter(range(1, 100))
    trainer = SimpleNamespace(next_microbatches=lambda it: next(it))
    assert [batches.next(trainer, data) for _ in range(4)] == [1, 4, 5, 7]
    assert batches.drawn == 7 and [batches.drawn_by(s) for s in range(5)] == [0, 1, 4, 5, 7]
    assert ranges({6, 7, 8, 9, 120, 122, 123}) == "6-9,120,122-123"


def guard_decisions() -> tuple[list[bool], list[str]]:
    """SpikeGuard on one gloo rank over a made-up run: a steady loss, then a jump that stays."""
    from types import SimpleNamespace

    import torch

    from titanlite.config import parse_args
    from titanlite.health import SpikeGuard

    events = []
    guard = SpikeGuard(parse_args(["--health.spike_window", "6"]), SimpleNamespace(log_event=lambda s, row, line: events.append(line)), ["h"])
    trainer = SimpleNamespace(reduce_loss=lambda loss: loss, parameters=lambda: [], ft=None, step=0)
    decisions = []
    run = [(5.0, 1.0), (4.9, 1.1), (5.1, 0.9), (5.0, 1.0), (4.95, 1.05), (5.05, 0.95), (50.0, 1.0), (50.0, 1.0), (50.0, 1.0), (50.1, 1.0)]
    for step, (loss, norm) in enumerate(run, 1):
        trainer.step = step
        decisions.append(guard.skips(trainer, torch.tensor(loss), torch.tensor(norm)))
    return decisions, events


def test_a_jump_that_stays_is_a_new_level_not_a_run_of_spikes():
    """Steps 7 and 8 are skipped; the third in a row is taken for where the run is now: kept, and the
    values join the history, so the guard does not skip every step after a lasting shift."""
    from distributed import run_distributed

    decisions, events = run_distributed(guard_decisions, 1)[0]
    assert decisions == [False] * 6 + [True, True, False, False], (decisions, events)
    assert "taken for a new level" in events[2] and len(events) == 3, events


def test_a_resumed_run_checks_against_the_saved_history(corpus_jsonl, tmp_path):
    """A spike at step 8 against a window of 10 (checks from 5 steps of history): the straight run skips
    it, and so does a run resumed at step 6, whose 2 steps alone would not be enough to check."""
    def run(folder, steps, *extra):
        args = tiny_args(corpus_jsonl, folder, "--training.steps", str(steps), "--health.spike_window", "10",
                         "--checkpoint.enable", "--checkpoint.interval", "6", "--lr_scheduler.decay_ratio", "0",
                         "--training.data_split", "sequences", "--fault_injection.kind", "spike_batch",
                         "--fault_injection.step", "8", *extra)
        return launch(1, args)

    straight = run(tmp_path / "straight", 10)
    run(tmp_path / "resumed", 6)
    resumed = run(tmp_path / "resumed", 10)
    assert "loaded checkpoint" in resumed.stdout
    for out in (straight, resumed):
        assert "a spike at step 8: optimizer step skipped" in out.stdout, out.stdout[-2000:]
    losses = lambda folder: [r["loss"] for r in rows(folder) if "loss" in r]
    assert losses(tmp_path / "straight") == losses(tmp_path / "resumed")


def test_a_flipped_bit_that_makes_the_grad_norm_infinite_is_named_and_skipped(corpus_jsonl, tmp_path):
    """Bit 30 (the exponent's top) of rank 1's largest gradient element: the grad norm overflows. The
    step is named by rank and, with training.skip_nonfinite_steps, skipped."""
    args = tiny_args(corpus_jsonl, tmp_path, "--training.steps", "8", "--training.skip_nonfinite_steps",
                     "--fault_injection.kind", "bitflip_grad", "--fault_injection.step", "5", "--fault_injection.rank", "1")
    out = launch(2, args)
    assert set(re.findall(r"step (\d+): not finite: grad_norm is inf; rank (\d) \(", out.stdout)) == {("5", "1")}, out.stdout[-3000:]
    assert "grad norm is inf at step 5: optimizer step skipped" in out.stdout
    assert all(math.isfinite(r["loss"]) for r in rows(tmp_path) if "loss" in r)


def test_a_flipped_gradient_bit_is_classed_by_the_replay_as_a_transient_fault(corpus_jsonl, tmp_path):
    """FSDP 2, health.replay: bit 30 of rank 1's largest gradient element at step 5 makes the grad norm
    infinite. The step's replay on the same data differs on rank 1 alone: a transient fault, named; the
    replay's result is kept, so every logged loss and grad norm is bitwise that of a run without the flip."""
    common = ["--training.steps", "8", "--health.replay"]
    flipped, clean = tmp_path / "flipped", tmp_path / "clean"
    out = launch(2, tiny_args(corpus_jsonl, flipped, *common, "--fault_injection.kind", "bitflip_grad",
                              "--fault_injection.step", "5", "--fault_injection.rank", "1"))
    assert re.search(r"step 5: replay on the same data differs from the first result on rank 1 \([^)]*\): a transient "
                     r"fault; the first result is dropped, the replay's kept", out.stdout), out.stdout[-3000:]
    assert "optimizer step skipped" not in out.stdout
    launch(2, tiny_args(corpus_jsonl, clean, *common))
    keys = ("step", "loss", "grad_norm")
    logged = lambda folder: [[r[k] for k in keys] for r in rows(folder) if "loss" in r]
    assert len(logged(flipped)) == 8 and logged(flipped) == logged(clean)
    assert [r["health_transient_rank"] for r in rows(flipped) if "health_transient_rank" in r] == [1.0]
    from titanlite.goodput import read

    end = read(flipped)[-1]  # the replay's time counts apart from the 8 kept steps
    assert (end["steps"], end["skipped_steps"]) == (8, 0) and end["skipped_s"] > 0


def test_a_poisoned_batch_that_makes_the_loss_nan_is_put_down_to_the_data_and_skipped(corpus_jsonl, tmp_path):
    """FSDP 2, health.replay: rank 0's batch of step 6 makes the logits NaN. The replay gives NaN again,
    and so does rank 1 recomputing that batch: the data. The step is skipped, and its NaN loss, which
    moved no weight, does not stop the run."""
    args = tiny_args(corpus_jsonl, tmp_path, "--training.steps", "8", "--health.replay", "--fault_injection.kind",
                     "nan_batch", "--fault_injection.step", "6", "--fault_injection.rank", "0")
    out = launch(2, args)
    assert "step 6: replay reproduces the result, and every data-parallel rank's batch recomputed" in out.stdout, out.stdout[-3000:]
    assert "a non-finite result of the data at step 6: optimizer step skipped (1 skipped so far)" in out.stdout
    losses = [r["loss"] for r in rows(tmp_path) if "loss" in r]
    assert len(losses) == 8 and math.isnan(losses[5]) and all(math.isfinite(x) for x in losses[:5] + losses[6:])


def test_a_spiked_batch_is_put_down_to_the_data_by_the_replay(corpus_jsonl, tmp_path):
    """FSDP 2, health.replay: rank 1's batch at step 7 makes logits 100x wherever it is computed. The
    replay reproduces the spike, and each rank's batch recomputed (forward only) on the other gives the
    bits it gives at home: the data. The update is skipped and the run goes on."""
    args = tiny_args(corpus_jsonl, tmp_path, "--training.steps", "8", "--health.spike_window", "6", "--health.replay",
                     "--fault_injection.kind", "spike_batch", "--fault_injection.step", "7", "--fault_injection.rank", "1")
    out = launch(2, args)
    assert ("step 7: replay reproduces the result, and every data-parallel rank's batch recomputed on the next gives "
            "the same bits there: the data") in out.stdout, out.stdout[-3000:]
    assert "a spike at step 7: optimizer step skipped (1 skipped so far)" in out.stdout
    assert [r["health_replay_data"] for r in rows(tmp_path) if "health_replay_data" in r] == [1.0]


def test_a_spike_kept_after_the_replay_trains_on_as_a_run_without_the_replay(corpus_jsonl, tmp_path):
    """FSDP 2, spike_policy = warn: the spiked batch's update is kept. With health.replay (a replay, a
    forward-only recompute on the other rank) every logged loss and grad norm is bitwise that of the
    same run without it: the replay only classifies."""
    common = ["--training.steps", "9", "--health.spike_window", "6", "--health.spike_policy", "warn",
              "--fault_injection.kind", "spike_batch", "--fault_injection.step", "7", "--fault_injection.rank", "1"]
    replayed, plain = tmp_path / "replayed", tmp_path / "plain"
    out = launch(2, tiny_args(corpus_jsonl, replayed, *common, "--health.replay"))
    assert "step 7: replay reproduces the result" in out.stdout, out.stdout[-3000:]
    launch(2, tiny_args(corpus_jsonl, plain, *common))
    logged = lambda folder: [[r[k] for k in ("step", "loss", "grad_norm")] for r in rows(folder) if "loss" in r]
    assert len(logged(plain)) == 9 and logged(replayed) == logged(plain)


@pytest.mark.parametrize("world, named", [
    (2, "rank 1 \\([^)]*\\) \\(whose result spiked"),  # 2 ranks: rank 1's mismatches are rank 0's too
    (3, "rank 1 \\([^)]*\\); training stopped"),  # 3: only rank 1 is in two mismatches
], ids=["2_ranks", "3_ranks"])
def test_a_fault_that_repeats_on_one_rank_is_named_persistent_and_stops_the_run(world, named, corpus_jsonl, tmp_path):
    """FSDP, health.replay: rank 1's logits are 100x at step 7 whatever batch it computes. The replay
    reproduces the spike; recomputed on the next rank, the batches rank 1 computed give other bits:
    a persistent fault of rank 1, named in one line, exit 1."""
    args = tiny_args(corpus_jsonl, tmp_path, "--training.steps", "8", "--health.spike_window", "6", "--health.replay",
                     "--fault_injection.kind", "spike_rank", "--fault_injection.step", "7", "--fault_injection.rank", "1")
    out = launch(world, args, expect=1)
    assert re.search(r"titanlite: step 7: the replay reproduces the result, but recomputed on the next data-parallel rank "
                     r"the batches rank 1 \([^)]*\) computed give other bits: a persistent fault of " + named, out.stderr), out.stderr[-3000:]


def test_a_flipped_weight_in_one_replica_is_found_and_healed(corpus_jsonl, tmp_path):
    """HSDP 2 x 2: bit 30 of a weight on rank 3 (replica 1) after step 3's update; the check of step 4
    names rank 3 and sends it replica 0's weights; the check of step 6 finds the replicas equal, and the
    run ends with finite losses."""
    args = tiny_args(corpus_jsonl, tmp_path, "--training.steps", "6", "--health.replica_check_interval", "2",
                     "--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
                     "--fault_injection.kind", "bitflip_param", "--fault_injection.step", "3", "--fault_injection.rank", "3")
    out = launch(4, args)
    healed = set(re.findall(r"step (\d+): rank (\d) \([^)]*\) held weights that differ from its replicas'.*healed from rank (\d)", out.stdout))
    assert healed == {("4", "3", "1")}, out.stdout[-3000:]
    assert [r["health_replica_healed_rank"] for r in rows(tmp_path) if "health_replica_healed_rank" in r] == [3.0]
    assert all(math.isfinite(r["loss"]) for r in rows(tmp_path) if "loss" in r)


def test_a_slowed_rank_is_named_a_straggler(corpus_jsonl, tmp_path):
    """Rank 1 held 1 s at the start of steps 3-9, every step checked: named at its third late check."""
    args = tiny_args(corpus_jsonl, tmp_path, "--training.steps", "9", "--health.straggler_interval", "1",
                     "--fault_injection.kind", "slow", "--fault_injection.rank", "1", "--fault_injection.step", "3",
                     "--fault_injection.steps", "7", "--fault_injection.seconds", "1")
    out = launch(2, args)
    named = re.findall(r"step (\d+): straggler: rank (\d) \(", out.stdout)
    assert set(named) == {("5", "1")}, out.stdout[-3000:]
    assert [r["health_straggler_rank"] for r in rows(tmp_path) if "health_straggler_rank" in r] == [1.0]


def test_a_hung_rank_is_named_its_stacks_written_and_the_restart_resumes(corpus_jsonl, tmp_path):
    """Rank 1 hangs at step 4 (timeout 10 s): both ranks' stacks on disk, one line naming rank 1, exit
    within the timeout + 30 s; torchrun's restart (the drill strikes the first attempt only) resumes
    from step 2's checkpoint and finishes."""
    args = tiny_args(corpus_jsonl, tmp_path, "--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "2",
                     "--comm.train_timeout_seconds", "10", "--fault_injection.kind", "hang", "--fault_injection.rank", "1",
                     "--fault_injection.step", "4")
    start = time.monotonic()
    out = launch(2, args, restarts=1)
    line = re.search(r"titanlite: step 4 ran past comm.train_timeout_seconds=10: rank 1 \([^)]*\) did not reach what the others did", out.stderr + out.stdout)
    assert line, (out.stdout[-2000:], out.stderr[-3000:])
    stacks = sorted(p.name for p in (tmp_path / "hang").iterdir())
    assert stacks == ["rank0.txt", "rank1.txt"]
    assert "before_step" in (tmp_path / "hang" / "rank1.txt").read_text()  # the hung rank's own frame
    assert "loaded checkpoint" in out.stdout and "done: 6 steps" in out.stdout
    assert time.monotonic() - start < 10 + 30 + 90  # the hang's exit, and two attempts' start-up and steps
    # Goodput: step 3 was trained twice; the hang's 10 s and the restart were down; each of the final
    # model's 6 steps counts once.
    from titanlite.goodput import read, report

    summary = report(read(tmp_path))
    assert [r["step"] for r in read(tmp_path) if r["event"] == "start"] == [0, 2]
    assert (summary["attempts"], summary["kept_steps"], summary["lost_steps"], summary["ended"]) == (2, 6, 1, True)
    assert summary["parts"]["down_s"] > 10 and 0 < summary["goodput"] < 1
    assert all(v >= 0 for v in summary["parts"].values()), summary  # `other` too: nothing counted twice
    assert f"goodput {100 * summary['goodput']:.1f}% of {summary['wall_s']:.1f}s over 2 attempt(s), 1 step(s) lost" in out.stdout


@pytest.mark.parametrize("flag, value, words", [
    ("--health.spike_window", "0", "health.spike_window=0 must be >= 2"),
    ("--health.spike_sigmas", "-1", "health.spike_sigmas=-1.0 must be > 0"),
    ("--health.spike_policy", "rollback", "health.spike_policy='rollback' with checkpoint.enable=false"),
    ("--health.skip_batches", "9-8", "health.skip_batches entry '9-8' is not a batch"),
    ("--health.rollback_batches", "0", "health.rollback_batches=0 must be >= 1"),
    ("--fault_injection.bit", "32", "fault_injection.bit=32 must be a bit of a float32"),
    ("--health.replay", "--health.spike_policy=off", "health.replay=true with health.spike_policy='off'"),
])
def test_bad_health_settings_are_one_line(flag, value, words):
    from titanlite.config import parse_args
    from titanlite.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(words)):
        parse_args([flag, value])


def test_an_injection_rank_outside_the_world_is_one_line(corpus_jsonl, tmp_path):
    from titanlite import preflight
    from titanlite.config import parse_args
    from titanlite.errors import ConfigError

    config = parse_args(tiny_args(corpus_jsonl, tmp_path, "--fault_injection.kind", "slow", "--fault_injection.rank", "2"))
    with pytest.raises(ConfigError, match=re.escape("fault_injection.rank=2 is outside the world of 2 ranks (0..1)")):
        preflight.check(config, 2)
