"""Runtime features through the CLI: profiler traces, multi-node launch (2 nodes on one machine),
automatic restart after a rank dies, the collective timeouts."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import REPO, run_command, tiny_args

pytestmark = pytest.mark.slow


def losses(folder) -> dict[int, float]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def run_train(env: dict, args: list[str], timeout: int = 300):
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **env}
    return run_command(["./run_train.sh", *args], timeout=timeout, cwd=REPO, env=env)


def test_profiler_writes_traces_per_rank(corpus_jsonl, tmp_path):
    out = run_train({"NGPU": "2"}, tiny_args(corpus_jsonl, tmp_path, "--profiling.enable_profiling", "--profiling.profile_freq", "2", "--profiling.profiler_warmup", "1",
                                             "--profiling.enable_memory_snapshot", "--training.steps", "4")[2:])
    assert out.returncode == 0, out.stderr[-3000:]
    traces = sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "profile_trace").rglob("*.json"))
    assert traces == [f"profile_trace/iteration_{s}/rank{r}_trace.json" for s in (2, 4) for r in (0, 1)]
    assert json.loads((tmp_path / traces[0]).read_text())["traceEvents"]
    top = (tmp_path / "profile_trace" / "iteration_4" / "rank0_top_kernels.txt").read_text()
    assert top.startswith("| op (self CPU time) | ms | calls | share |") and "| aten::mm |" in top  # the heaviest ops
    assert "memory snapshots need a GPU" in out.stdout


def test_two_nodes_on_one_machine_match_a_two_rank_run(corpus_jsonl, tmp_path):
    from helpers import tiny_args as args_for
    from distributed import free_port

    args = lambda folder: args_for(corpus_jsonl, folder, "--training.steps", "4")[2:]
    single = run_train({"NGPU": "2"}, args(tmp_path / "single"))
    assert single.returncode == 0, single.stderr[-3000:]
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [
        subprocess.Popen(["./run_train.sh", *args(tmp_path / "multi")], cwd=REPO, start_new_session=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "NGPU": "1", "NNODES": "2",
                              "NODE_RANK": str(rank), "RDZV_ENDPOINT": endpoint, "RDZV_ID": "titanlite-test", "LOG_RANK": "0"})
        for rank in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    assert all(node.returncode == 0 for node in nodes), [o[1][-2000:] for o in outputs]
    assert losses(tmp_path / "multi") == losses(tmp_path / "single")


def test_a_dead_rank_restarts_the_job_which_resumes_from_its_checkpoint(corpus_jsonl, tmp_path):
    args = lambda folder: tiny_args(corpus_jsonl, folder, "--checkpoint.enable", "--checkpoint.interval", "4",
                                    "--training.steps", "12")[2:]
    straight = run_train({"NGPU": "2"}, args(tmp_path / "straight"))
    assert straight.returncode == 0, straight.stderr[-3000:]

    folder = tmp_path / "faulty"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "NGPU": "2", "MAX_RESTARTS": "1"}
    job = subprocess.Popen(["./run_train.sh", *args(folder)], cwd=REPO, env=env, start_new_session=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not (folder / "checkpoint" / "step-4" / ".metadata").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    # run_train.sh execs torchrun, so the workers are the job's children.
    workers = subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2, workers
    os.kill(int(workers[-1]), signal.SIGKILL)  # one rank dies
    try:
        output, _ = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, output[-3000:]
    assert output.count("loaded checkpoint") >= 1
    assert losses(folder)[12] == losses(tmp_path / "straight")[12]
