"""LocalSGD, DiLoCo and streaming DiLoCo on torchft, for real: a Lighthouse, two replica groups, each a
real Trainer, and each sync checked against a direct computation of its update from the weights the
groups held just before it."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import REPO, tiny_args
from test_fault_tolerance import FT, Lighthouse, final_state, logged, restart_every_group, start_group, train_args, wait

torchft = pytest.importorskip("torchft")

OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # TorchTitan's outer Nesterov SGD


def group_worker(replica_id: int, folder: str, steps: int, extra: list[str]) -> None:
    """One replica group of one rank: the real Trainer and its torchft Manager, fed batches of its own
    (seeded by group and step). Saves every step's weights just before torchft's sync (an optimizer
    step hook put first, before torchft's) and after it."""
    from titanlite.config import parse_args
    from titanlite.train import init_distributed
    from titanlite.trainer import Trainer

    def weights(trainer) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in trainer.model_parts[0].named_parameters()}

    config = parse_args(tiny_args(Path(folder) / "corpus.jsonl", Path(folder) / f"group{replica_id}", *FT,
                                  "--fault_tolerance.replica_id", str(replica_id), *extra))
    trainer = Trainer(config, init_distributed(config))
    record, before = {"initial": weights(trainer), "steps": []}, {}
    optimizer = trainer.optimizers[0]
    handle = optimizer.register_step_post_hook(lambda *_: before.update(weights=weights(trainer)))
    optimizer._optimizer_step_post_hooks.move_to_end(handle.id, last=False)  # before torchft's, which syncs
    for step in range(1, steps + 1):
        trainer.step = step
        g = torch.Generator().manual_seed(1000 * replica_id + step)
        tokens = torch.randint(0, 200, (2, 33), generator=g)
        trainer.train_step([(tokens[:, :-1], tokens[:, 1:])])
        record["steps"].append({"before": before["weights"], "after": weights(trainer)})
    torch.save(record, Path(folder) / f"group{replica_id}.pt")
    trainer.ft.shutdown()


def run_groups(tmp_path: Path, corpus_jsonl: Path, steps: int, extra: list[str]) -> list[dict]:
    (tmp_path / "corpus.jsonl").write_bytes(corpus_jsonl.read_bytes())
    code = "import sys; from test_fault_tolerance_semi_sync import group_worker as w; w(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4:])"
    with Lighthouse(min_replicas=2) as lighthouse:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHFT_LIGHTHOUSE": lighthouse.address,
               "PYTHONPATH": f"{REPO / 'tests'}{os.pathsep}{REPO}"}
        groups = [subprocess.Popen([sys.executable, "-c", code, str(i), str(tmp_path), str(steps), *extra], env=env,
                                   stdout=open(tmp_path / f"out{i}.log", "w"), stderr=subprocess.STDOUT) for i in range(2)]
        for i, group in enumerate(groups):
            try:
                assert group.wait(timeout=300) == 0, (tmp_path / f"out{i}.log").read_text()[-3000:]
            finally:
                group.kill()
    return [torch.load(tmp_path / f"group{i}.pt") for i in range(2)]


def close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    return bool(torch.isfinite(actual).all()) and torch.allclose(actual, expected, rtol=1e-5, atol=1e-6)


def torchtitan_fragments(names: list[str], n: int) -> list[set[str]]:
    """The debug model's 6 blocks in 2 fragments as TorchTitan splits them (the embedding and the
    output each weigh one block): the embedding and blocks 0-2, then blocks 3-5, the norm and the output."""
    assert n == 2
    first = ("tok_embeddings.", "layers.0.", "layers.1.", "layers.2.")
    return [{k for k in names if k.startswith(first)}, {k for k in names if not k.startswith(first)}]


@pytest.mark.slow
@pytest.mark.parametrize("method, fragments, alpha", [("diloco", 1, 0.0), ("diloco", 2, 0.25), ("local_sgd", 1, 0.0)],
                         ids=["diloco", "streaming_diloco", "local_sgd"])
def test_each_sync_is_the_direct_update_of_the_groups_weights(corpus_jsonl, tmp_path, method, fragments, alpha):
    """2 groups x 1 rank, sync every 4 steps, 12 steps (streaming: a fragment every 2 steps, each fragment
    3 times). At every sync, from the weights each group held just before it:
    - DiLoCo: the pseudo-gradient g = mean over groups of (last synced weights - local weights), the
      outer Nesterov SGD's momentum m = 0.9 m + g (m = g at first), synced = last - 0.7 (g + 0.9 m),
      and each group keeps synced + alpha (its local - synced); the fragment not synced keeps its local weights;
    - LocalSGD: the mean of the groups' weights.
    Between syncs nothing is averaged: the groups' weights differ."""
    sync_steps, steps = 4, 12
    extra = ["--fault_tolerance.semi_sync_method", method, "--fault_tolerance.sync_steps", str(sync_steps),
             "--fault_tolerance.num_fragments", str(fragments), "--fault_tolerance.fragment_update_alpha", str(alpha)]
    groups = run_groups(tmp_path, corpus_jsonl, steps, extra)
    names = list(groups[0]["initial"])
    assert all(torch.equal(groups[0]["initial"][k], groups[1]["initial"][k]) for k in names)  # one seed
    parts = torchtitan_fragments(names, fragments) if fragments > 1 else [set(names)]
    synced = [{k: groups[0]["initial"][k].clone() for k in part} for part in parts]
    momentum: list[dict] = [{} for _ in parts]  # per fragment, by name
    interval, syncs = sync_steps // fragments, 0
    for step in range(1, steps + 1):
        local = [g["steps"][step - 1]["before"] for g in groups]
        after = [g["steps"][step - 1]["after"] for g in groups]
        if step % interval:
            assert all(torch.equal(after[r][k], local[r][k]) for r in range(2) for k in names)
            assert any(not torch.equal(local[0][k], local[1][k]) for k in names)
            continue
        f, syncs = syncs % fragments, syncs + 1
        for k in names:
            if k not in parts[f]:
                assert all(torch.equal(after[r][k], local[r][k]) for r in range(2)), (step, k)
                continue
            if method == "local_sgd":
                expected = [(local[0][k] + local[1][k]) / 2] * 2
            else:
                g = ((synced[f][k] - local[0][k]) + (synced[f][k] - local[1][k])) / 2
                m = momentum[f][k] = OUTER_MOMENTUM * momentum[f][k] + g if k in momentum[f] else g.clone()
                synced[f][k] = synced[f][k] - OUTER_LR * (g + OUTER_MOMENTUM * m)
                expected = [synced[f][k] + alpha * (local[r][k] - synced[f][k]) for r in range(2)]
            for r in range(2):
                assert close(after[r][k], expected[r]), (step, k, r, (after[r][k] - expected[r]).abs().max().item())
    assert syncs == steps // interval


def test_semi_sync_settings_are_checked_before_launch():
    """TorchTitan's semi-sync keys, each bad value in one line naming it."""
    from titanlite.config import parse_args
    from titanlite.errors import ConfigError

    method = [*FT, "--fault_tolerance.semi_sync_method"]
    for args, words in [
        ([*method, "diloco", "--fault_tolerance.sync_steps", "0"], ["fault_tolerance.sync_steps=0", ">= 1"]),
        ([*method, "diloco", "--fault_tolerance.num_fragments", "7"], ["num_fragments=7", "6 blocks"]),
        ([*method, "diloco", "--fault_tolerance.num_fragments", "2", "--fault_tolerance.sync_steps", "5"],
         ["sync_steps=5", "multiple of num_fragments=2"]),
        ([*method, "diloco", "--fault_tolerance.fragment_sync_delay", "5"], ["fragment_sync_delay=5", "sync_steps / num_fragments - 1 = 4"]),
        ([*method, "diloco", "--fault_tolerance.fragment_update_alpha", "1.5"], ["fragment_update_alpha=1.5"]),
        ([*method, "local_sgd", "--fault_tolerance.num_fragments", "2"], ["num_fragments=2", "DiLoCo's"]),
        ([*method, "diloco", "--parallelism.pipeline_parallel_degree", "2"], ["pipeline_parallel_degree=2", "set pipeline_parallel_degree=1"]),
        ([*method, "adam"], ["semi_sync_method", "adam"]),
        ([*method, "diloco", "--checkpoint.enable", "--checkpoint.interval", "12"], ["checkpoint.interval=12", "multiple of fault_tolerance.sync_steps=5"]),
        ([*method, "local_sgd", "--training.skip_nonfinite_steps"], ["skip_nonfinite_steps=true", "set it to false"]),
        ([*method, "local_sgd", "--checkpoint.enable", "--checkpoint.interval", "10", "--checkpoint.enable_first_step_checkpoint"],
         ["enable_first_step_checkpoint=true", "set it to false"]),
    ]:
        with pytest.raises(ConfigError) as err:
            parse_args(args)
        assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), (args, str(err.value))


def test_named_fragments_must_hold_every_parameter_once():
    """module_fqns_per_model_fragment: an unknown module, a block left out and a block twice are each refused in one line."""
    from titanlite.errors import ConfigError
    from titanlite.fault_tolerance import fragments
    from titanlite.models import FAMILIES, model_args

    family = FAMILIES["llama3"]
    model = family.plan.build(model_args("llama3", "debugmodel", 64, 32))
    head = ["tok_embeddings", "layers.0", "layers.1", "layers.2"]
    tail = ["layers.3", "layers.4", "layers.5", "norm", "output"]
    parts = fragments(model, family.plan, [head, tail], 2)
    assert [sum(p.numel() for p in part.parameters()) for part in parts] == [
        sum(p.numel() for n, p in model.named_parameters() if n.split(".")[0] == "tok_embeddings" or n.startswith(("layers.0.", "layers.1.", "layers.2."))),
        sum(p.numel() for n, p in model.named_parameters() if n.startswith(("layers.3.", "layers.4.", "layers.5.", "norm.", "output."))),
    ]
    for names, words in [([head, [*tail, "lm_head"]], ["'lm_head'", "not a module"]),
                         ([head, tail[1:]], ["in none", "exactly one"]),
                         ([head, [*tail, "layers.0"]], ["in several", "exactly one"])]:
        with pytest.raises(ConfigError) as err:
            fragments(model, family.plan, names, 2)
        assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize("sync_steps, fragments, steps", [(5, 1, 60), (8, 2, 64)], ids=["diloco", "streaming_diloco"])
def test_a_group_killed_between_syncs_heals_at_a_sync_and_the_survivor_loses_nothing(corpus_jsonl, tmp_path, sync_steps, fragments, steps):
    """2 groups x FSDP 2 under DiLoCo (sync every 5 steps) and streaming DiLoCo (2 fragments, one every 4
    steps), about 60 steps; the victim's torchrun and ranks get SIGKILL between two syncs (once it logged
    the step after the first sync) and start again. The survivor logs each of its 30 steps once, finite, fails no
    sync and syncs alone while the victim is away; the victim trains from the start until its first sync,
    where it takes the survivor's state (weights, optimizer states, DiLoCo's last synced weights and
    outer momentum, step) and carries on in step with it. At the last step both hold the same weights:
    all of them (DiLoCo), or exactly the fragment synced last (streaming: the other is each group's own)."""
    kill_after = sync_steps // fragments + 1  # the step after the first sync: well before the next one
    semi = ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", str(sync_steps),
            "--fault_tolerance.num_fragments", str(fragments)]
    base = train_args(corpus_jsonl, steps)
    args = lambda folder: base(folder) + semi
    folders = [tmp_path / "group0", tmp_path / "group1"]
    # A join timeout above a sync's period: a group at its sync waits for a live one that is not there yet.
    with Lighthouse(min_replicas=1, join_timeout_ms=4000) as lighthouse:
        groups = [start_group(i, folders[i], lighthouse.address, args) for i in range(2)]
        deadline = time.monotonic() + 300
        victim = 0
        while not (rows := logged(folders[victim])) or rows[-1]["step"] < kill_after:
            assert time.monotonic() < deadline and all(g.poll() is None for g in groups)
            time.sleep(0.02)
        os.killpg(groups[victim].pid, signal.SIGKILL)
        groups[victim].wait()
        back_folder = tmp_path / "victim_again"
        back = start_group(victim, back_folder, lighthouse.address, args)
        wait(groups[1], folders[1])
        wait(back, back_folder)
    survivor_rows = logged(folders[1])
    assert [r["step"] for r in survivor_rows] == list(range(1, steps + 1))
    assert all(abs(r["loss"]) < 100 for r in survivor_rows)  # finite
    assert survivor_rows[-1]["ft_syncs_failed"] == 0 and survivor_rows[-1]["ft_syncs"] == steps // (sync_steps // fragments)
    assert any(r["ft_replicas"] == 1 for r in survivor_rows if r["step"] > kill_after), survivor_rows
    back_rows = logged(back_folder)
    jump = next(i for i in range(1, len(back_rows)) if back_rows[i]["step"] != back_rows[i - 1]["step"] + 1)
    assert back_rows[jump]["step"] > back_rows[jump - 1]["step"] + 1  # healed: the survivor's step
    assert back_rows[jump]["step"] < steps - sync_steps  # early enough to train apart again before the end
    assert [r["step"] for r in back_rows[jump:]] == list(range(back_rows[jump]["step"], steps + 1))
    assert f"this run: {len(back_rows)} steps" in (back_folder / "out.log").read_text()  # not the survivor's
    # Its wait at the sync where it healed (a quorum with a new member) is time stalled; syncs redo nothing.
    assert back_rows[-1]["ft_stalled_seconds"] > 0 and back_rows[-1]["ft_steps_redone"] == 0, back_rows[-1]
    first, second = final_state(folders[1], steps), final_state(back_folder, steps)
    weights = {k for k in first if k.startswith("model.")}
    same = {k for k in weights if torch.equal(first[k], second[k])}
    names = [k.removeprefix("model.") for k in weights]
    parts = [{f"model.{k}" for k in part} for part in torchtitan_fragments(names, fragments)] if fragments > 1 else [weights]
    assert same in parts, sorted(weights - same)[:5]


@pytest.mark.slow
def test_a_full_restart_under_streaming_diloco_resumes_exactly(corpus_jsonl, tmp_path):
    """2 groups x FSDP 2 under streaming DiLoCo (2 fragments, one synced every 2 steps), a checkpoint
    every 4 steps in every group (their weights and optimizers differ between syncs) with DiLoCo's last
    synced weights and outer momentum and torchft's step. Both groups are killed after step 6 and
    started again: each resumes step 4, and steps 5-12 log the losses of an unbroken run, bitwise, and
    end in its final states."""
    base = train_args(corpus_jsonl, 12)
    args = lambda folder: base(folder) + ["--checkpoint.interval", "4", "--fault_tolerance.semi_sync_method", "diloco",
                                          "--fault_tolerance.sync_steps", "4", "--fault_tolerance.num_fragments", "2"]

    def whole_with_diloco(folders):
        for folder in folders:
            assert sorted(p.name for p in (folder / "checkpoint").iterdir()) == ["step-4"]
            assert b"diloco.1.momentum." in (folder / "checkpoint" / "step-4" / ".metadata").read_bytes()

    logs = restart_every_group(tmp_path, args, 12, 6, 4, whole_with_diloco)
    assert all("loaded checkpoint" in log and "at step 4" in log for log in logs), logs
