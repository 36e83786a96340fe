"""Run a function on N gloo processes on CPU: the base of every distributed test.

Each rank is a spawned process with its own process group on a free port. A rank's return value
comes back to the test; a rank's exception fails the test with that rank's traceback. Ranks end
with barrier + destroy_process_group + os._exit(0), which avoids gloo's flaky abort at interpreter
exit (docs/architecture.md, "gloo on CPU"). Starting the ranks (python, torch, titanlite imports) costs
seconds on 2 cores, so tests of one module that need the same world size share a launch (run_calls).
"""

from __future__ import annotations

import os
import socket
import sys
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn, args, results) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    share_mesh_groups()
    try:
        results.put((rank, True, fn(*args)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_distributed(fn, world_size: int, *args, timeout: float = 600.0) -> list:
    """fn(*args) on every rank; returns the ranks' return values in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[bool, object]] = {}
    import time

    deadline = time.monotonic() + timeout
    while len(outcomes) < world_size and time.monotonic() < deadline:
        if not results.empty():
            rank, ok, value = results.get()
            outcomes[rank] = (ok, value)
            if not ok:
                break  # the other ranks may be stuck in a collective waiting for this one
        elif any(p.exitcode not in (None, 0) for p in procs):
            break
        else:
            time.sleep(0.05)
    for p in procs:
        p.join(timeout=5 if len(outcomes) == world_size else 0.1)
        if p.is_alive():
            p.kill()
    failures = [f"rank {r}:\n{v}" for r, (ok, v) in sorted(outcomes.items()) if not ok]
    if failures:
        raise AssertionError("distributed test failed\n" + "\n".join(failures))
    if len(outcomes) < world_size:
        codes = {r: p.exitcode for r, p in enumerate(procs)}
        raise AssertionError(f"distributed test: only ranks {sorted(outcomes)} reported (timeout or crash); exit codes {codes}")
    return [outcomes[r][1] for r in range(world_size)]


# Every group device meshes made in this process, by (ranks, timeout, backend, options): share_mesh_groups.
_mesh_groups: dict[tuple, object] = {}


def share_mesh_groups() -> None:
    """Device meshes of this process reuse one process group per set of ranks. The calls of a launch
    each build their meshes, as jobs would, and new groups each time cost ~20 gloo threads apiece.
    DTensor also caches sharding decisions by mesh, and a mesh equals any other of its shape and
    names: with the groups kept, an earlier call's mesh still works for the next call, so the cache
    stays valid (destroying the groups meant clearing it: the four-rank parity launch took 603 s
    that way and 380 s this way on an AVX2 2-core machine)."""
    import torch.distributed.device_mesh as device_mesh

    create = device_mesh.new_group

    def new_group(ranks=None, timeout=None, backend=None, pg_options=None, **kwargs):
        key = (tuple(ranks or ()), timeout, backend, id(pg_options) if pg_options else None)
        if key not in _mesh_groups:
            _mesh_groups[key] = create(ranks=ranks, timeout=timeout, backend=backend, pg_options=pg_options, **kwargs)
        return _mesh_groups[key]

    device_mesh.new_group = new_group


def release_groups() -> None:
    """Destroy the process groups a call made outside device meshes (a checkpoint's, say), as a job's
    exit would: each holds gloo threads and sockets, and a launch of 90 parity cases that kept them
    ran its later cases about 2x slower."""
    import gc

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    kept = {id(group) for group in _mesh_groups.values()}
    for group in list(_world.pg_map):
        if group is not dist.group.WORLD and id(group) not in kept:
            dist.destroy_process_group(group)
    gc.collect()  # the last references sit in the call's reference cycles (modules, meshes, hooks)


def _calls(calls: list[tuple]) -> list:
    results = []
    for number, (fn, *args) in enumerate(calls, 1):
        try:
            results.append(fn(*args))
        except Exception as e:
            raise RuntimeError(f"{fn.__name__}{tuple(args)} failed (call {number} of {len(calls)} in this launch)") from e
        finally:
            release_groups()
    return results


def run_calls(world_size: int, calls: list[tuple], timeout: float = 600.0) -> list[list]:
    """Each (fn, *args) of `calls` on every rank, in order, in one launch; returns each call's values
    in rank order. A call's exception fails the whole launch, naming that call."""
    per_rank = run_distributed(_calls, world_size, calls, timeout=timeout)
    return [[values[i] for values in per_rank] for i in range(len(calls))]
