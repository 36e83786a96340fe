"""LR schedule values and grad-norm clipping."""

import math

import pytest
import torch

from titanlite.config import parse_args
from titanlite.optim.build import build_optimizer
from titanlite.optim.clip import clip_grad_norm_
from titanlite.optim.schedule import build_lr_scheduler, lr_factor


def test_warmup_then_linear_decay_to_min():
    f = [lr_factor(s, 10, 2, None, "linear", 0.0) for s in range(10)]
    assert f[:2] == [0.5, 1.0]
    assert f[2] == pytest.approx(1 - 1 / 8)
    assert f[-1] == 0.0
    assert all(a >= b for a, b in zip(f[1:], f[2:]))


@pytest.mark.parametrize("kind, halfway", [("linear", 0.5), ("sqrt", 1 - math.sqrt(0.5)), ("cosine", 0.5)])
def test_decay_curves_and_min_lr(kind, halfway):
    # 100 steps, no warmup, all decay: step 49 is progress 0.5.
    assert lr_factor(49, 100, 0, None, kind, 0.0) == pytest.approx(halfway)
    assert lr_factor(49, 100, 0, None, kind, 0.1) == pytest.approx(0.1 + 0.9 * halfway)
    assert lr_factor(99, 100, 0, None, kind, 0.1) == pytest.approx(0.1)


def test_warmup_stable_decay():
    # 100 steps: warmup 10, decay the last 20% (steps 80-99), stable in between.
    f = [lr_factor(s, 100, 10, 0.2, "linear", 0.0) for s in range(100)]
    assert f[9] == 1.0 and f[10] == 1.0 and f[79] == 1.0
    assert f[80] == pytest.approx(1 - 1 / 20)
    assert f[99] == 0.0


def test_warmup_longer_than_training_never_decays():
    assert [lr_factor(s, 5, 10, None, "linear", 0.0) for s in range(5)] == [0.1, 0.2, 0.3, 0.4, 0.5]


def test_scheduler_drives_optimizer_lr():
    config = parse_args(["--optimizer.lr", "0.1", "--training.steps", "4", "--lr_scheduler.warmup_steps", "2"])
    p = torch.nn.Parameter(torch.zeros(3))
    opt = build_optimizer([("p", p)], config)
    sched = build_lr_scheduler(opt, config)
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        p.grad = torch.ones(3)
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.05, 0.1, 0.05, 0.0])


def test_clip_grad_norm_clips_in_place_and_reports_total():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))
    a.grad, b.grad = torch.full((3,), 3.0), torch.full((4,), 2.0)
    total = clip_grad_norm_([a, b], max_norm=1.0)
    assert total.item() == pytest.approx(math.sqrt(27 + 16))
    assert torch.cat([a.grad, b.grad]).norm().item() == pytest.approx(1.0, rel=1e-5)
    unclipped = clip_grad_norm_([a, b], max_norm=0.0)  # <= 0: report only
    assert unclipped.item() == pytest.approx(1.0, rel=1e-5)


def _partial_gradients_summed() -> list:
    """Gradients still pending a sum over a 2-rank mesh (Partial), of two dtypes and shapes: after
    reduce_partial_grads each holds the sum of the ranks' pieces, checked against dist.all_reduce."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    from titanlite.optim.clip import reduce_partial_grads

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank = dist.get_rank()
    params, expected = [], []
    for shape, dtype in (((3,), torch.float32), ((2, 5), torch.float32), ((4,), torch.float64)):
        piece = torch.arange(math.prod(shape), dtype=dtype).reshape(shape) * (rank + 1) + rank
        p = torch.nn.Parameter(DTensor.from_local(torch.zeros(shape, dtype=dtype), mesh, [Partial()], run_check=False))
        p.grad = DTensor.from_local(piece.clone(), mesh, [Partial()], run_check=False)
        total = piece.clone()
        dist.all_reduce(total)
        params.append(p)
        expected.append(total)
    reduce_partial_grads(params)
    return [not p.grad.placements[0].is_partial() and torch.equal(p.grad.to_local(), want) for p, want in zip(params, expected)]


@pytest.mark.slow
def test_partial_gradients_are_summed_once_over_their_mesh():
    from distributed import run_distributed

    assert run_distributed(_partial_gradients_summed, 2) == [[True, True, True]] * 2
