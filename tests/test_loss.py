"""The training loss (titanlite/loss.py) against torch's cross entropy (also with labels on every
vocabulary slice's boundary under loss parallel), and the CPU runs' reuse of freed host memory
(train.reuse_freed_host_memory)."""

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from titanlite.loss import IGNORED, cross_entropy_sum


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_summed_cross_entropy_equals_torchs_in_value_and_gradient(dtype, tolerance):
    gen = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(2, 48, 500, generator=gen)).to(dtype).requires_grad_()
    labels = torch.randint(0, 500, (2, 48), generator=gen)
    ours = cross_entropy_sum(logits, labels)
    assert type(ours.grad_fn).__name__ == "SummedCrossEntropyBackward"  # the fused path ran
    (grad,) = torch.autograd.grad(ours / 7, logits)  # backward scales by the incoming gradient
    theirs = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
    (expected,) = torch.autograd.grad(theirs / 7, logits)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    assert grad.dtype == dtype
    assert (grad.float() - expected.float()).abs().max() <= tolerance * expected.float().abs().max()
    with torch.no_grad():  # evaluation: torch's, nothing kept for a backward
        assert cross_entropy_sum(logits, labels).item() == pytest.approx(theirs.item(), rel=1e-6)


def test_a_freed_large_tensor_comes_back_without_page_faults():
    """glibc maps a 64 MiB block afresh each time (16,384 pages faulted in and zeroed by the kernel);
    after reuse_freed_host_memory it comes from the heap, already resident (the median of 5 tries). In
    a process of its own: the setting is process-wide."""
    script = textwrap.dedent("""
        import resource, torch
        from titanlite.train import reuse_freed_host_memory

        def faults_of_a_64mib_tensor():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            torch.ones(16, 2**20)  # allocated, written and freed
            return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

        faults_of_a_64mib_tensor()
        plain = faults_of_a_64mib_tensor()
        reuse_freed_host_memory()
        faults_of_a_64mib_tensor(), faults_of_a_64mib_tensor()  # the heap grows (now and then twice)
        print(plain, *(faults_of_a_64mib_tensor() for _ in range(5)))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    plain, *reused = map(int, out.split())
    assert plain > 10_000 and sorted(reused)[2] < 100, (plain, reused)


def _vocab_parallel_against_whole(vocab: int) -> tuple[float, float]:
    """(loss difference, largest gradient difference) of the loss on vocabulary-split logits against
    torch's on the whole logits."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    gen = torch.Generator().manual_seed(0)
    whole = (4 * torch.randn(2, 24, vocab, generator=gen)).requires_grad_()
    labels = torch.randint(0, vocab, (2, 24), generator=gen)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    split = distribute_tensor(whole.detach(), mesh, [Shard(-1)]).requires_grad_()
    ours = cross_entropy_sum(split, labels)
    assert type(ours.grad_fn).__name__ == "SummedCrossEntropyBackward"
    (ours / 3).backward()
    theirs = F.cross_entropy(whole.flatten(0, 1), labels.flatten(), reduction="sum")
    (theirs / 3).backward()
    grad = split.grad.full_tensor()
    return abs(ours.item() - theirs.item()) / theirs.item(), ((grad - whole.grad).abs().max() / whole.grad.abs().max()).item()


@pytest.mark.slow
def test_vocab_parallel_cross_entropy_equals_torchs_on_the_whole_logits():
    """On 2 ranks, with slices of 251 and 250 entries (the parity suite's TP cases hold even ones)."""
    from distributed import run_distributed

    for loss_difference, grad_difference in run_distributed(_vocab_parallel_against_whole, 2, 501):
        assert loss_difference < 1e-6 and grad_difference < 1e-6


def _vocab_parallel_at_slice_boundaries(vocabs: tuple[int, ...]) -> list[tuple[int, float, float]]:
    """(vocab, loss difference, largest gradient difference) against torch's loss on the whole logits,
    with labels on the first and last id of every rank's vocabulary slice (0 and vocab - 1 among
    them): where an off-by-one in a slice's start or end gives a label to the wrong rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    rank, ranks = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (ranks,))
    results = []
    for vocab in vocabs:
        gen = torch.Generator().manual_seed(vocab)
        whole = (4 * torch.randn(2, 16, vocab, generator=gen)).requires_grad_()
        slices = torch.arange(vocab).chunk(ranks)  # the test's own split of the ids, torch.chunk's sizes
        boundaries = sorted({int(ids[0]) for ids in slices} | {int(ids[-1]) for ids in slices})
        assert boundaries[0] == 0 and boundaries[-1] == vocab - 1
        labels = torch.randint(0, vocab, (32,), generator=gen)
        labels[: len(boundaries)] = torch.tensor(boundaries)
        labels = labels[torch.randperm(32, generator=gen)].view(2, 16)  # boundaries in both rows
        split = distribute_tensor(whole.detach(), mesh, [Shard(-1)]).requires_grad_()
        # The slice this rank holds is the one the test assumed.
        assert torch.equal(split.to_local(), whole.detach()[..., slices[rank]])
        ours = cross_entropy_sum(split, labels)
        assert type(ours.grad_fn).__name__ == "SummedCrossEntropyBackward"
        (ours / 3).backward()
        theirs = F.cross_entropy(whole.flatten(0, 1), labels.flatten(), reduction="sum")
        (theirs / 3).backward()
        grad_difference = (split.grad.full_tensor() - whole.grad).abs().max() / whole.grad.abs().max()
        results.append((vocab, abs(ours.item() - theirs.item()) / theirs.item(), grad_difference.item()))
    return results


@pytest.mark.slow
def test_vocab_parallel_cross_entropy_is_exact_at_every_slice_boundary():
    """3 ranks: even slices (99 = 3 x 33), uneven ones (100 = 34 + 34 + 32) and a last slice of one id
    (7 = 3 + 3 + 1); every label on a slice's first or last id, or random."""
    from distributed import run_distributed

    for per_rank in run_distributed(_vocab_parallel_at_slice_boundaries, 3, (99, 100, 7)):
        for vocab, loss_difference, grad_difference in per_rank:
            assert loss_difference <= 1e-6 and grad_difference <= 1e-6, (vocab, loss_difference, grad_difference)


@pytest.mark.parametrize("chunks", [1, 3, 8])
def test_chunked_output_and_loss_equal_torchs_on_the_whole_logits(chunks):
    """OutputProjection given labels: the summed cross entropy of its logits, computed a piece of the
    tokens at a time, IGNORED labels left out; loss and the gradients of the hidden state and the
    weight within 1e-6 of F.linear + F.cross_entropy on the whole logits (here scaled by a loss
    gradient of 0.5)."""
    from titanlite.models.common.linear import OutputProjection

    gen = torch.Generator().manual_seed(0)
    output = OutputProjection(32, 1000, bias=False)
    with torch.no_grad():
        output.weight.copy_(torch.randn(1000, 32, generator=gen) * 0.2)
    hidden = torch.randn(3, 17, 32, generator=gen, requires_grad=True)  # 51 tokens: uneven pieces
    labels = torch.randint(0, 1000, (3, 17), generator=gen)
    labels[:, -2:] = IGNORED  # multi-token prediction's labels past the window: out of the loss and its gradients
    expected = F.cross_entropy(F.linear(hidden, output.weight).flatten(0, 1), labels.flatten(), reduction="sum")
    grads = torch.autograd.grad(0.5 * expected, (hidden, output.weight))
    output.loss_chunks = chunks
    loss = output(hidden, labels)
    chunked = torch.autograd.grad(0.5 * loss, (hidden, output.weight))
    assert abs(loss.item() - expected.item()) <= 1e-6 * expected.item()
    for got, want in zip(chunked, grads):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    with torch.no_grad():  # evaluation: the loss alone
        assert output(hidden, labels).item() == pytest.approx(expected.item(), rel=1e-6)


def _chunked_vocab_parallel_against_whole(vocab: int) -> list[tuple[str, float, float, float]]:
    """(input layout, loss difference, largest hidden-gradient and weight-gradient differences) of the
    chunked loss with the output layer split over the vocabulary (the family's tp plan, sequence
    parallel or not) against F.linear + F.cross_entropy on the whole logits; labels on every slice's
    first and last id, and some IGNORED."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from titanlite.models.common.linear import OutputProjection
    from titanlite.parallel.tensor import OutputColwiseParallel

    rank, ranks = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (ranks,))
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, 16, generator=gen) * 0.3
    hidden = torch.randn(2, 12, 16, generator=gen)
    boundaries = sorted({int(end) for ids in torch.arange(vocab).chunk(ranks) for end in (ids[0], ids[-1])})
    labels = torch.randint(0, vocab, (24,), generator=gen)
    labels[: len(boundaries)] = torch.tensor(boundaries)
    labels[-3:] = IGNORED
    labels = labels[torch.randperm(24, generator=gen)].view(2, 12)
    whole_h, whole_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    expected = F.cross_entropy(F.linear(whole_h, whole_w).flatten(0, 1), labels.flatten(), reduction="sum")
    (expected / 3).backward()
    results = []
    for layout in (Shard(1), Replicate()):
        output = OutputProjection(16, vocab, bias=False)
        output.weight.data.copy_(weight)
        output.loss_chunks = 3
        parallelize_module(output, mesh, OutputColwiseParallel(input_layouts=layout, output_layouts=Shard(-1), use_local_output=False))
        x = hidden.clone().requires_grad_()
        shard = x.chunk(ranks, dim=1)[rank] if layout == Shard(1) else x
        loss = output(shard, labels)
        assert not isinstance(loss, DTensor) and loss.ndim == 0  # the loss, not the logits
        (loss / 3).backward()
        grad_h = x.grad.clone()
        if layout == Shard(1):
            dist.all_reduce(grad_h)  # each rank holds the rows of its sequence shard
        results.append((
            str(layout), abs(loss.item() - expected.item()) / expected.item(),
            ((grad_h - whole_h.grad).abs().max() / whole_h.grad.abs().max()).item(),
            ((output.weight.grad.full_tensor() - whole_w.grad).abs().max() / whole_w.grad.abs().max()).item(),
        ))
    return results


@pytest.mark.slow
def test_chunked_loss_under_loss_parallel_equals_torchs_on_the_whole_logits():
    """3 ranks, vocabularies split evenly (99) and unevenly (100 = 34 + 34 + 32): the output layer given
    labels under TP returns the loss of the whole vocabulary, and the gradients of the hidden state
    (sequence-sharded or replicated) and of each rank's rows of the weight, within 1e-6."""
    from distributed import run_distributed

    for vocab in (99, 100):
        for per_rank in run_distributed(_chunked_vocab_parallel_against_whole, 3, vocab):
            for layout, *differences in per_rank:
                assert max(differences) <= 1e-6, (vocab, layout, differences)


class LargestOutput(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_the_chunked_loss_never_builds_the_whole_logits():
    """Through a whole model, forward and backward: no tensor as large as the logits (tokens x
    vocabulary) exists: the largest are the blocks' activations and the weights' gradients. The model's
    loss and every gradient equal those of its logits' cross entropy."""
    from titanlite.models import build_model, model_args

    args = model_args("llama3", "debugmodel", 2048, 256, n_layers=2)
    model = build_model("llama3", args).to_empty(device="cpu")
    model.init_weights(0)
    tokens = torch.randint(0, 2048, (4, 256), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 2048, (4, 256), generator=torch.Generator().manual_seed(2))
    cross_entropy_sum(model(tokens), labels).backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    model.output.loss_chunks = 8
    with LargestOutput() as mode:
        loss = model(tokens, labels=labels)
        loss.backward()
    logits = 4 * 256 * 2048
    assert mode.largest < logits / 2, (mode.largest, logits)
    assert loss.item() == pytest.approx(cross_entropy_sum(model(tokens), labels).item(), rel=1e-6)
    # Against each gradient's largest entry: the pieces sum the weight's gradient in another order.
    worst = {name: ((p.grad - expected[name]).abs().max() / expected[name].abs().max()).item() for name, p in model.named_parameters()}
    assert max(worst.values()) <= 1e-6, worst


def test_the_compiled_chunked_loss_equals_the_eager_one():
    """compile.components with the loss: each piece's logits, loss and gradients in one compiled
    graph (uneven pieces: two graphs), the loss and both gradients within 1e-6 of the eager pieces'."""
    from torch._dynamo.utils import counters

    from titanlite.models.common.linear import OutputProjection

    gen = torch.Generator().manual_seed(0)
    output = OutputProjection(32, 1000, bias=False)
    with torch.no_grad():
        output.weight.copy_(torch.randn(1000, 32, generator=gen) * 0.2)
    hidden = torch.randn(3, 17, 32, generator=gen, requires_grad=True)
    labels = torch.randint(0, 1000, (3, 17), generator=gen)
    labels[:, -2:] = IGNORED
    output.loss_chunks = 3
    results = []
    for compiled in (False, True):
        output.compiled_loss = compiled
        graphs = counters["stats"]["unique_graphs"]
        loss = output(hidden, labels)
        results.append((loss, *torch.autograd.grad(0.5 * loss, (hidden, output.weight))))
        assert (counters["stats"]["unique_graphs"] > graphs) == compiled
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
