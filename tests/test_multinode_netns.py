"""Two real "hosts" (network namespaces joined by a veth pair, nothing else reachable) train one
job through `./run_train.sh` with torchrun's c10d rendezvous; then node 1 dies mid-run, a replacement
node joins, and torchrun's restart resumes the job from its checkpoint. Needs root and iproute2 (`ip netns`).

What crossing hosts needs, all through the environment (run_train.sh passes it on to torchrun):
- GLOO_SOCKET_IFNAME: gloo otherwise binds to the address the hostname resolves to (127.0.0.1 here),
  which the other host cannot reach.
- PET_LOCAL_ADDR (torchrun's --local_addr): the rank-0 agent advertises it to every worker as
  MASTER_ADDR; by default it is the FQDN, which resolves to loopback in both namespaces. It also
  sorts the nodes: 10.x.y.1 < 10.x.y.2 makes node 0 group rank 0, so global rank 0 lives there.
- PET_RDZV_CONF=is_host=1|0 (torchrun's --rdzv_conf): c10d guesses whether to host the rendezvous
  store by resolving the hostname, which does not match the endpoint IP; nobody would host it.
"""

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO, tiny_args

pytestmark = pytest.mark.slow

TIMEOUT = 180  # seconds for any one job; each takes ~10 s here


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def kill_everything_in(ns: str) -> None:
    """SIGKILL every process in the namespace: torchrun starts its workers in their own sessions, so
    killing an agent's process group would leave its trainers running."""
    pids = ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


class Hosts:
    def __init__(self):
        tag = f"{os.getpid() % 10000}{secrets.token_hex(2)}"
        subnet = 1 + int(tag[-4:], 16) % 250  # any private /24: it exists only inside these namespaces
        self.ns = [f"tl{tag}n0", f"tl{tag}n1"]
        self.ifname = ["tlveth0", "tlveth1"]  # created straight inside each namespace: no clash
        self.addr = [f"10.231.{subnet}.1", f"10.231.{subnet}.2"]

    def create(self) -> None:
        ip("netns", "add", self.ns[1])  # the fixture has added ns[0]
        ip("link", "add", self.ifname[0], "netns", self.ns[0], "type", "veth",
           "peer", "name", self.ifname[1], "netns", self.ns[1])
        for ns, ifname, addr in zip(self.ns, self.ifname, self.addr):
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
            ip("-n", ns, "link", "set", ifname, "up")
            ip("-n", ns, "link", "set", "lo", "up")  # torchrun --standalone and local ranks use it
            # Isolation: the veth's /24 is the only route (no default route, no NAT, no bridge).
            assert ip("-n", ns, "route", "show", "default").stdout.strip() == ""

    def destroy(self) -> None:
        for ns in self.ns:
            kill_everything_in(ns)
        for ns in self.ns:
            ip("netns", "del", ns, check=False)  # deleting a namespace deletes its end of the veth

    def kill_all(self) -> None:
        for ns in self.ns:
            kill_everything_in(ns)

    def start(self, node: int, args: list[str], log: Path, **env: str) -> subprocess.Popen:
        """run_train.sh on one host. `ip netns exec`, `env` and run_train.sh all exec, so the pid is
        torchrun's agent; the output goes to a file (no pipe to fill up, readable after a kill)."""
        env = {"NGPU": "1", "GLOO_SOCKET_IFNAME": self.ifname[node], **env}
        cmd = ["ip", "netns", "exec", self.ns[node], "env", *(f"{k}={v}" for k, v in env.items()), "./run_train.sh", *args]
        with open(log, "w") as out:
            return subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"})

    def start_node(self, node: int, args: list[str], log: Path, port: int, job: str, **env: str) -> subprocess.Popen:
        return self.start(node, args, log, NNODES="2", NODE_RANK=str(node), RDZV_ENDPOINT=f"{self.addr[0]}:{port}",
                          RDZV_ID=job, PET_LOCAL_ADDR=self.addr[node], PET_RDZV_CONF=f"is_host={int(node == 0)}", **env)


@pytest.fixture(scope="module")
def hosts(request):
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (`ip netns`) to create two network namespaces")
    h = Hosts()
    request.addfinalizer(h.destroy)  # registered first: a half-built pair is torn down too
    try:
        ip("netns", "add", h.ns[0])
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create a network namespace: {e.stderr.strip()}")
    h.create()  # from here on a failure is an error, not a skip
    return h


def wait_all(hosts: Hosts, procs: list[subprocess.Popen], logs: list[Path], timeout: float = TIMEOUT) -> list[str]:
    """Wait for every node and return their logs. The first node to fail kills all processes of both
    hosts at once (the other would wait for its peer until its own timeouts); a timeout fails the test."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and all(p.returncode in (None, 0) for p in procs):
        if time.monotonic() > deadline:
            hosts.kill_all()
            pytest.fail(f"timed out after {timeout:.0f}s:\n" + "\n".join(log.read_text()[-3000:] for log in logs))
        time.sleep(0.1)
    if any(p.returncode not in (None, 0) for p in procs):
        hosts.kill_all()
        for p in procs:
            p.wait(timeout=30)
    return [log.read_text() for log in logs]


def losses(folder: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def job_args(corpus_jsonl: Path, folder: Path, *extra: str) -> list[str]:
    # One config for all three runs (parity, fault, reference), so one reference run serves both tests.
    return tiny_args(corpus_jsonl, folder, "--checkpoint.enable", "--checkpoint.interval", "4",
                     "--training.steps", "12", *extra)[2:]


@pytest.fixture(scope="module")
def reference(hosts, corpus_jsonl, tmp_path_factory) -> dict[int, float]:
    """An uninterrupted 2-rank single-node run, inside host 0 so that cleanup finds all of its processes."""
    folder = tmp_path_factory.mktemp("reference")
    log = folder / "run.log"
    try:
        proc = hosts.start(0, job_args(corpus_jsonl, folder), log, NGPU="2")
        (out,) = wait_all(hosts, [proc], [log])
    finally:
        hosts.kill_all()
    assert proc.returncode == 0, out[-3000:]
    return losses(folder)


def test_two_hosts_train_like_one_two_rank_run(hosts, reference, corpus_jsonl, tmp_path):
    folder = tmp_path / "multi"  # one dump folder for both nodes, as on a shared filesystem
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    try:
        procs = [hosts.start_node(n, job_args(corpus_jsonl, folder), logs[n], port=29400, job="parity") for n in (0, 1)]
        outputs = wait_all(hosts, procs, logs)
    finally:
        hosts.kill_all()
    assert [p.returncode for p in procs] == [0, 0], [o[-3000:] for o in outputs]
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert sum("loss" in r for r in rows) == 12  # a single writer (global rank 0), no duplicated steps
    assert losses(folder) == reference


def test_a_dead_host_replaced_resumes_the_job_from_its_checkpoint(hosts, reference, corpus_jsonl, tmp_path):
    folder = tmp_path / "faulty"
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    args = job_args(corpus_jsonl, folder)
    try:
        procs = [hosts.start_node(n, args, logs[n], port=29401, job="fault", MAX_RESTARTS="2") for n in (0, 1)]
        deadline = time.monotonic() + TIMEOUT
        while not (folder / "checkpoint" / "step-4" / ".metadata").exists():
            assert time.monotonic() < deadline, "no checkpoint at step 4:\n" + logs[0].read_text()[-3000:]
            assert all(p.poll() is None for p in procs), [log.read_text()[-3000:] for log in logs]
            time.sleep(0.05)
        workers = [subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
                   for p in procs]
        assert [len(w) for w in workers] == [1, 1], workers
        # Node 1 dies whole (agent and trainer), and a replacement node starts the same command.
        # Node 0's trainer fails on its lost peer (gloo: connection reset), its agent restarts, and
        # both agents meet in a new rendezvous round; rank 0 hosts a fresh store for it
        # (run_train.sh's TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1).
        kill_everything_in(hosts.ns[1])
        procs[1].wait(timeout=30)
        logs.append(tmp_path / "node1_replacement.log")
        procs[1] = hosts.start_node(1, args, logs[2], port=29401, job="fault", MAX_RESTARTS="2")
        outputs = wait_all(hosts, procs, logs, timeout=max(1.0, deadline - time.monotonic()))
    finally:
        hosts.kill_all()
    assert [p.returncode for p in procs] == [0, 0], [o[-3000:] for o in outputs]
    assert all("loaded checkpoint" in o for o in (outputs[0], outputs[2])), [o[-3000:] for o in outputs]
    assert losses(folder)[12] == reference[12]
