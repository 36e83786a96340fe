"""Fault-tolerant replica groups on torchft, for real: a Lighthouse, replica groups that are torchrun
jobs of 2 gloo ranks each (FSDP 2 inside), and a group killed with SIGKILL and started again. Bad
fault_tolerance settings stop before launch with one line."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import REPO, launch, run_command, tiny_args
from titanlite.config import parse_args
from titanlite.errors import ConfigError
from titanlite.launch import trainer_command

torchft = pytest.importorskip("torchft")

FT = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2", "--debug.seed", "7"]


@pytest.mark.parametrize("args, words", [
    (FT + ["--fault_tolerance.replica_id", "2"], ["fault_tolerance.replica_id=2", "0 .. group_size - 1 = 1"]),
    (FT + ["--fault_tolerance.min_replica_size", "3"], ["fault_tolerance.min_replica_size=3", "group_size=2"]),
    (["--fault_tolerance.enable", "--debug.seed", "7"], ["fault_tolerance.group_size=0", ">= 1"]),
    (FT + ["--parallelism.data_parallel_replicate_degree", "2"], ["data_parallel_replicate_degree=2", "set it to 1"]),
    (["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"], ["needs debug.seed", "every replica group"]),
])
def test_bad_fault_tolerance_settings_name_key_value_and_fix(args, words):
    with pytest.raises(ConfigError) as err:
        parse_args(args)
    assert all(w in str(err.value) for w in words), str(err.value)


def preflight(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "titanlite.preflight", *args], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, **env}, timeout=120)


def test_an_unreachable_lighthouse_or_none_stops_before_launch(corpus_jsonl, tmp_path):
    args = tiny_args(corpus_jsonl, tmp_path, *FT, "--fault_tolerance.process_group_timeout_ms", "300")
    out = preflight(args, {"TORCHFT_LIGHTHOUSE": "http://127.0.0.1:9"})  # the discard port: nothing listens
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "TORCHFT_LIGHTHOUSE=http://127.0.0.1:9: no Lighthouse answered" in out.stderr
    assert "process_group_timeout_ms=300" in out.stderr
    env = {k: v for k, v in os.environ.items() if k != "TORCHFT_LIGHTHOUSE"}
    out = subprocess.run([sys.executable, "-m", "titanlite.preflight", *args], capture_output=True, text=True, cwd=REPO, env=env)
    assert out.returncode == 2 and "needs the Lighthouse's address in TORCHFT_LIGHTHOUSE" in out.stderr, out.stderr


def test_fault_tolerance_without_torchft_says_how_to_install(monkeypatch):
    import importlib.util

    from titanlite import preflight as checks

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    with pytest.raises(ConfigError, match=r"fault_tolerance.enable=true needs torchft: pip install -e '.\[ft\]'"):
        checks.check_lighthouse(1000)


class Lighthouse:
    """torchft's Lighthouse in this process, on a free port."""

    def __init__(self, min_replicas: int = 1, join_timeout_ms: int = 1000):
        from torchft.coordination import LighthouseServer

        self.server = LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                                       heartbeat_timeout_ms=2000)
        self.address = self.server.address()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.shutdown()


def start_group(replica_id: int, folder: Path, lighthouse: str, args) -> subprocess.Popen:
    """One replica group: torchrun of 2 ranks in a session of its own (killed as a whole)."""
    folder.mkdir(parents=True, exist_ok=True)
    cmd = trainer_command(2, [*args(folder), *FT, "--fault_tolerance.replica_id", str(replica_id)])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHFT_LIGHTHOUSE": lighthouse}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(folder / "out.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def rows(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def wait(group: subprocess.Popen, folder: Path, timeout: float = 400) -> None:
    try:
        assert group.wait(timeout=timeout) == 0, (folder / "out.log").read_text()[-4000:]
    finally:
        if group.poll() is None:
            os.killpg(group.pid, signal.SIGKILL)


def final_state(folder: Path, steps: int) -> dict[str, torch.Tensor]:
    """Every tensor of the group's last checkpoint (model, optimizer, lr schedule), by name."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder / "checkpoint" / f"step-{steps}", folder / "final.pt")
    state = torch.load(folder / "final.pt", weights_only=False)
    flat = {}
    for part in ("model", "optimizer", "lr_scheduler"):
        flat.update({f"{part}.{k}": v for k, v in state[part].items() if torch.is_tensor(v)})
    return flat


def train_args(corpus_jsonl: Path, steps: int):
    """A run's args for a dump folder: the last step saved in full (model, optimizer, lr schedule)."""
    return lambda folder: tiny_args(corpus_jsonl, folder, "--training.steps", str(steps), "--checkpoint.enable",
                                    "--checkpoint.interval", "1000", "--checkpoint.last_save_model_only", "false",
                                    "--debug.seed", "7", "--training.seq_len", "128", "--training.local_batch_size", "4")


MOE = ["--model.name", "moe", "--model.flavor", "debugmoe", "--parallelism.expert_parallel_degree", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("model", [[], MOE], ids=["llama3", "moe"])
def test_two_replica_groups_hold_the_same_weights_as_one_hsdp_job(corpus_jsonl, tmp_path, model):
    """2 groups x FSDP 2 under a Lighthouse, 6 steps: every weight, buffer (a MoE's expert bias, moved
    by the expert counts of both groups) and optimizer state equal bitwise between the groups, and
    the weights within 2e-6 of HSDP 2 x 2 in one job of 4 ranks (the same batches: each group reads
    the data of its replicate rank)."""
    base = train_args(corpus_jsonl, 6)
    args = lambda folder: base(folder) + model
    with Lighthouse(min_replicas=2) as lighthouse:
        groups = [start_group(i, tmp_path / f"group{i}", lighthouse.address, args) for i in range(2)]
        for i, group in enumerate(groups):
            wait(group, tmp_path / f"group{i}")
    launch(4, [*args(tmp_path / "hsdp"), "--parallelism.data_parallel_replicate_degree", "2"], timeout=400)
    first, second, reference = (final_state(tmp_path / name, 6) for name in ("group0", "group1", "hsdp"))
    assert first.keys() == second.keys() == reference.keys() and len(first) > 20
    assert all(torch.equal(first[k], second[k]) for k in first), [k for k in first if not torch.equal(first[k], second[k])][:5]
    worst = max(((first[k].float() - reference[k].float()).abs().max() / reference[k].float().abs().max().clamp(min=1e-12)).item()
                for k in first if k.startswith("model."))
    assert worst < 2e-6, worst
    if model:  # the expert bias moved, and as HSDP's did
        bias = [k for k in first if k.endswith("expert_bias")]
        assert bias and all(first[k].abs().max() > 0 and torch.equal(first[k], reference[k]) for k in bias)
    rows = logged(tmp_path / "group0")
    assert all(r["ft_replicas"] == 2 for r in rows)
    # No failure: nothing redone, and (the wait for the other group to start aside) little stalled.
    assert rows[-1]["ft_steps_redone"] == 0 and rows[-1]["ft_goodput"] > 0.9, rows[-1]


def logged(folder: Path) -> list[dict]:
    return [r for r in rows(folder) if "loss" in r]


@pytest.mark.slow
def test_a_killed_replica_group_heals_from_the_survivor_and_rejoins(corpus_jsonl, tmp_path):
    """2 groups x FSDP 2, 50 steps. The victim group's torchrun and ranks get SIGKILL at step 12 and
    start again (38 steps of ~0.5 s for the survivor alone leave the restart room on a loaded 2-core
    machine): the survivor never stops (each of its 50 steps logged once, finite, the steps it
    trained alone logged with 1 group); the victim takes the survivor's state over HTTP, not from
    disk, in a step both redo, and trains on with it; at the end both hold bitwise identical weights
    and optimizer states.
    (The Lighthouse takes a quorum of 1: a group that starts first trains alone until the other joins
    and heals from it; the test kills the one that healed at the start, if one did.)"""
    steps, kill_at = 50, 12
    args = train_args(corpus_jsonl, steps)
    folders = [tmp_path / "group0", tmp_path / "group1"]
    with Lighthouse(min_replicas=1) as lighthouse:
        groups = [start_group(i, folders[i], lighthouse.address, args) for i in range(2)]
        deadline = time.monotonic() + 300
        while not all(logged(f) for f in folders):
            assert time.monotonic() < deadline and all(g.poll() is None for g in groups), [f.name for f in folders if not logged(f)]
            time.sleep(0.05)
        victim = 0 if logged(folders[0])[0]["step"] > 1 else 1
        survivor = 1 - victim
        while max(r["step"] for r in logged(folders[victim])) < kill_at:
            assert time.monotonic() < deadline and groups[victim].poll() is None, (folders[victim] / "out.log").read_text()[-3000:]
            time.sleep(0.05)
        os.killpg(groups[victim].pid, signal.SIGKILL)
        groups[victim].wait()
        killed_at = max(r["step"] for r in logged(folders[victim]))
        back_folder = tmp_path / "victim_again"
        back = start_group(victim, back_folder, lighthouse.address, args)
        wait(groups[survivor], folders[survivor])
        wait(back, back_folder)
    survivor_rows = logged(folders[survivor])
    assert [r["step"] for r in survivor_rows] == list(range(1, steps + 1))
    assert all(abs(r["loss"]) < 100 for r in survivor_rows)  # finite
    alone = [r["step"] for r in survivor_rows if r["ft_replicas"] == 1 and r["step"] > killed_at]
    assert alone, (survivor_rows, killed_at)
    # The step the kill cut short was redone (its all-reduce failed); the wait for the Lighthouse to drop
    # the dead group (its 2 s heartbeat timeout) shows as time stalled.
    # Redone: the step the victim healed in (its gradient counts for nothing: every group does it again
    # with the same batch); the step the kill broke, unless the kill fell between two quorums; and the
    # step the other group joined in at the start, if one did.
    assert 1 <= survivor_rows[-1]["ft_steps_redone"] <= 3 and survivor_rows[-1]["ft_stalled_seconds"] > 1.0, survivor_rows[-1]
    assert 0.0 < survivor_rows[-1]["ft_goodput"] < 1.0, survivor_rows[-1]
    assert "healed in it): redone with the same batch" in (folders[survivor] / "out.log").read_text()
    # The run's goodput report carries torchft's figures, and counts each redone step apart from the kept.
    from titanlite.goodput import read, report

    summary = report(read(folders[survivor]))
    last = survivor_rows[-1]  # the report's figures are the run's end's: stalled time can only have grown
    assert summary["ft_steps_redone"] == last["ft_steps_redone"] and summary["ft_stalled_seconds"] >= last["ft_stalled_seconds"], summary
    assert (summary["kept_steps"], read(folders[survivor])[-1]["skipped_steps"]) == (steps, summary["ft_steps_redone"]), summary
    assert "torchft: " in (folders[survivor] / "out.log").read_text()
    back_rows = logged(back_folder)
    healed = back_rows[0]["step"]  # the step it healed in, redone: the first it logs
    assert killed_at < healed < steps and [r["step"] for r in back_rows] == list(range(healed, steps + 1))
    assert all(r["ft_participating"] == 1 and r["ft_replicas"] == 2 for r in back_rows)
    first, second = final_state(folders[survivor], steps), final_state(back_folder, steps)
    assert first.keys() == second.keys() and len(first) > 20
    assert all(torch.equal(first[k], second[k]) for k in first), [k for k in first if not torch.equal(first[k], second[k])][:5]


@pytest.mark.slow
def test_run_train_sh_starts_a_lighthouse_for_its_group_and_stops_it(corpus_jsonl, tmp_path):
    """FT_LIGHTHOUSE=start: run_train.sh runs torchft's Lighthouse for the job (here one group of one
    rank, 3 steps), the group trains through it, and the Lighthouse ends with the group."""
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "FT_LIGHTHOUSE": "start", "FT_LIGHTHOUSE_PORT": str(port), "NGPU": "1"}
    env.pop("TORCHFT_LIGHTHOUSE", None)
    args = tiny_args(corpus_jsonl, tmp_path, "--training.steps", "3", "--fault_tolerance.enable",
                     "--fault_tolerance.group_size", "1", "--debug.seed", "7")
    out = run_command(["bash", "run_train.sh", *args], timeout=300, cwd=REPO, env=env)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert [r["ft_replicas"] for r in logged(tmp_path)] == [1.0, 1.0, 1.0]
    with pytest.raises(OSError):  # nothing listens there any more
        socket.create_connection(("localhost", port), timeout=1).close()


FAKE_SLURM = {
    # One "node" per entry of SLURM_JOB_NODELIST, all of them this machine.
    "scontrol": 'tr "," "\\n" <<< "$SLURM_JOB_NODELIST" | sed "s/.*/localhost/"\n',
    # --ntasks=N copies of the command, SLURM_PROCID 0..N-1, a TERM passed on to them (as srun does);
    # group 1's first attempt fails (FAIL_ONCE).
    "srun": r"""tasks=1
while [ $# -gt 0 ]; do case "$1" in --ntasks=*) tasks=${1#*=}; shift ;; -w) shift 2 ;; --*) shift ;; *) break ;; esac; done
case "$*" in *-group1\ *) [ -e "$FAIL_ONCE" ] || { touch "$FAIL_ONCE"; exit 1; } ;; esac
trap 'kill $(jobs -p) 2>/dev/null' TERM
for ((i = 0; i < tasks; i++)); do SLURM_PROCID=$i "$@" & done
wait
""",
}


@pytest.mark.slow
def test_slurm_script_runs_replica_groups_around_one_lighthouse_and_restarts_a_failed_one(corpus_jsonl, tmp_path):
    """scripts/ft_trainer.slurm under a stand-in scontrol and srun (the nodes are this machine): 2 nodes,
    2 replica groups of one node, a Lighthouse that wants both in every step; group 1's first start fails
    and the script starts it again. Both train every step together, each in its own dump folder."""
    import socket

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in FAKE_SLURM.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n0,n1",
           "SLURM_JOB_ID": "7", "FT_LIGHTHOUSE_PORT": str(port), "FT_MIN_REPLICAS": "2", "NGPU": "1",
           "DUMP_ROOT": str(tmp_path / "ft"), "FAIL_ONCE": str(tmp_path / "failed_once"), "OMP_NUM_THREADS": "1"}
    env.pop("TORCHFT_LIGHTHOUSE", None)
    out = run_command(["bash", "scripts/ft_trainer.slurm", *tiny_args(corpus_jsonl, tmp_path / "ignored", "--training.steps", "4")],
                      timeout=300, cwd=REPO, env=env)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "replica group 1 failed (attempt 1); starting it again" in out.stderr
    for g in range(2):
        assert [(r["step"], r["ft_replicas"]) for r in logged(tmp_path / "ft" / f"group{g}")] == [(s, 2.0) for s in range(1, 5)]
    with pytest.raises(OSError):  # the Lighthouse ended with the job
        socket.create_connection(("localhost", port), timeout=1).close()


def checkpointed(corpus_jsonl: Path, steps: int):
    """train_args with a checkpoint every 5 steps."""
    base = train_args(corpus_jsonl, steps)
    return lambda folder: base(folder) + ["--checkpoint.interval", "5"]


def restart_every_group(tmp_path: Path, args, steps: int, kill_after: int, resumed_at: int, check_saved) -> list[str]:
    """An unbroken run of 2 groups; then the same run with both groups killed once each logged step
    `kill_after`, `check_saved(folders)` on what they saved, and both started again. Each group's steps
    after `resumed_at` log the unbroken run's losses bitwise and end in its final states. Returns the
    restarted groups' logs."""
    with Lighthouse(min_replicas=2) as lighthouse:
        unbroken = [start_group(i, tmp_path / f"unbroken{i}", lighthouse.address, args) for i in range(2)]
        for i, group in enumerate(unbroken):
            wait(group, tmp_path / f"unbroken{i}")
    folders = [tmp_path / f"group{i}" for i in range(2)]
    with Lighthouse(min_replicas=2) as lighthouse:
        groups = [start_group(i, folders[i], lighthouse.address, args) for i in range(2)]
        deadline = time.monotonic() + 300
        while not all(r and r[-1]["step"] >= kill_after for r in map(logged, folders)):
            assert time.monotonic() < deadline and all(g.poll() is None for g in groups)
            time.sleep(0.05)
        for group in groups:
            os.killpg(group.pid, signal.SIGKILL)
            group.wait()
        check_saved(folders)
        again = [start_group(i, folders[i], lighthouse.address, args) for i in range(2)]
        for i, group in enumerate(again):
            wait(group, folders[i])
    for i in range(2):
        reference = {r["step"]: r["loss"] for r in logged(tmp_path / f"unbroken{i}")}
        rows = logged(folders[i])[resumed_at - steps:]
        assert [r["step"] for r in rows] == list(range(resumed_at + 1, steps + 1)), i
        assert [r["loss"] for r in rows] == [reference[s] for s in range(resumed_at + 1, steps + 1)], i
        first, second = final_state(tmp_path / f"unbroken{i}", steps), final_state(folders[i], steps)
        assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first), i
    return [(f / "out.log").read_text() for f in folders]


@pytest.mark.slow
def test_a_full_restart_of_every_group_resumes_exactly(corpus_jsonl, tmp_path):
    """2 groups x FSDP 2, a checkpoint every 5 steps: one group writes the model, optimizer and step,
    the other only its data position. Both are killed after step 7 and started again: the first resumes
    step 5, the second its data position at step 5 and heals from the first in a step both redo. Steps
    6-10 of each group log the losses of an unbroken run, bitwise, and the final states equal its own."""

    def model_once(folders):
        assert [sorted(p.name for p in (f / "checkpoint").iterdir()) for f in folders] == [["step-5"], ["step-5"]]
        sizes = sorted(sum(p.stat().st_size for p in (f / "checkpoint" / "step-5").iterdir()) for f in folders)
        assert sizes[0] * 20 < sizes[1], sizes  # the other group's save is its data position

    logs = restart_every_group(tmp_path, checkpointed(corpus_jsonl, 10), 10, 7, 5, model_once)
    assert sum("loaded checkpoint" in log and "at step 5" in log for log in logs) == 1, logs
    assert sum("loaded this replica group's data position of step 5" in log for log in logs) == 1, logs
