"""Record every read of device memory on the host while a training loop runs, booked to the step.

Most reads reach torch's dispatcher, and a TorchDispatchMode sees each op there, whoever calls it
(titanlite, torch's optimizer, DTensor, FSDP): `_local_scalar_dense` (item, float, int, bool),
`equal` and `allclose` hand a value to Python; ops whose output shape depends on the data (nonzero,
unique, bincount, masked_select, boolean-mask indexing, repeat_interleave without output_size)
must read it to size their output. A few reads never reach the dispatcher: `tolist` and `numpy`
read memory directly, and on CPU `.cpu()` and `.to("cpu")` return the tensor itself. Those are
caught at the Python methods instead.

Host transfers on CPU: device and host are one, so a device->host copy cannot be told from the
tensors. The recorder flags `.cpu()`, `.to()` to the CPU and `copy_` when titanlite's own code
calls them: titanlite never moves step data to the host except to log, so each such call is a
transfer, or one of the few moves a test allows by name and exact count (the batch to the device,
which on a GPU is host->device). Torch's calls are left alone: FSDP and the optimizer copy_
device->device all the time, and their host reads still show at the dispatcher.

Reads while titanlite's data loader runs (titanlite/data/ on the stack) do not count: the loader
works on host tensors by design, and next_microbatches moves its batches to the device.

Compiled regions compile and run as compiled (`ignore_compile_internals`): a dispatch mode would
otherwise send torch.compile back to eager and test another program. Ops that run outside the
graphs still come here; a read captured inside a graph would not (Dynamo breaks the graph at
item() and data-dependent shapes unless told to capture them; titanlite does not tell it).
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from typing import Callable

import torch
import torch._compile
import torch._dynamo.eval_frame
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops that hand a value to Python but that torch does not tag as data_dependent_output.
VALUE_READS = {aten.equal.default, aten.allclose.default}
BOOLEAN_INDEXED = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
TITANLITE = f"{os.sep}titanlite{os.sep}"
TORCH = f"{os.sep}torch{os.sep}"
# The plumbing between an op and the code that called it.
PLUMBING = {__file__, torch.utils._python_dispatch.__file__, torch._ops.__file__, torch._compile.__file__, torch._dynamo.eval_frame.__file__}
LOADER = f"{TITANLITE}data{os.sep}"


def reads_device_memory(func, args, kwargs) -> bool:
    """Torch's own tags (data_dependent_output: _local_scalar_dense; dynamic_output_shape: nonzero,
    unique, bincount, masked_select, ...), the value reads the tags miss, and the ops tagged as sized
    by the data only when their arguments leave the size open: indexing with a boolean mask (its true
    count), repeat_interleave without output_size (the repeats' sum), one_hot without num_classes."""
    packet = func.overloadpacket
    if packet in BOOLEAN_INDEXED:
        masked = any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
        return masked and (packet is aten.index or not fills_a_mask(*args[:3], args[3] if len(args) > 3 else kwargs.get("accumulate", False)))
    if packet is aten.repeat_interleave:
        return func is not aten.repeat_interleave.self_int and kwargs.get("output_size") is None
    if packet is aten.one_hot:
        return (args[1] if len(args) > 1 else kwargs.get("num_classes", -1)) < 0
    return (
        func in VALUE_READS
        or torch.Tag.data_dependent_output in func.tags
        or torch.Tag.dynamic_output_shape in func.tags
        or packet is aten.unique_dim_consecutive
    )


def fills_a_mask(self, indices, value, accumulate) -> bool:
    """`x[mask] = 0.0`: torch runs index_put_ as masked_fill_, no read, when one boolean mask is the only
    index and the value one element on the host, without accumulating (canDispatchToMaskedFill).
    On CPU a 0-dim device value cannot be told from a Python scalar: both count as the scalar."""
    return not accumulate and value.numel() == 1 and sum(i is not None for i in indices) == 1


def package_path(filename: str) -> str:
    """titanlite/train.py, torch/optim/adam.py: the path from the package folder on."""
    cut = max(filename.rfind(TITANLITE), filename.rfind(TORCH))
    return filename[cut + 1:] if cut >= 0 else filename


def innermost(frame, where: Callable[[str], bool]):
    while frame is not None and not where(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def describe(frame) -> str:
    return f"{package_path(frame.f_code.co_filename)}:{frame.f_lineno} ({frame.f_code.co_qualname})"


class HostReads(TorchDispatchMode):
    """`with HostReads(lambda: trainer.step) as reads: train(trainer)`; then `reads.by_step[step]`
    lists that step's reads, each as (where, what): `where` is (file, function) of the innermost
    titanlite or torch frame that read (what an allowance names), `what` names the op and the lines."""

    def __init__(self, current_step: Callable[[], int]):
        super().__init__()
        self.current_step = current_step
        self.by_step: dict[int, list[tuple[tuple[str, str], str]]] = defaultdict(list)
        self.originals: dict[str, Callable] = {}

    # Compiled graphs with activation checkpointing run higher-order ops (run_and_save_rng_state) at
    # runtime; they pass through whole, like the rest of the compiled code.
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.OpOverload) and reads_device_memory(func, args, kwargs):
            self.book(str(func), sys._getframe(1))
        return func(*args, **kwargs)

    def book(self, what: str, frame) -> None:
        """Book `what` to the current step, at the innermost titanlite or torch frame from `frame`
        outwards and, where that one is torch's, the innermost titanlite frame too (the line to fix)."""
        while frame.f_code.co_filename in PLUMBING:
            frame = frame.f_back
        if innermost(frame, lambda path: LOADER in path):
            return
        reader = innermost(frame, lambda path: TITANLITE in path or TORCH in path) or frame
        caller = innermost(reader, lambda path: TITANLITE in path)
        where = (package_path(reader.f_code.co_filename), reader.f_code.co_qualname)
        text = f"{what} at {describe(reader)}" + (f" from {describe(caller)}" if caller not in (None, reader) else "")
        self.by_step[self.current_step()].append((where, text))

    def __enter__(self):
        self.patch("tolist", lambda name, caller, args, kwargs: True)
        self.patch("numpy", lambda name, caller, args, kwargs: True)
        self.patch("cpu", titanlites_transfer)
        self.patch("to", titanlites_transfer)
        self.patch("copy_", titanlites_transfer)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self.originals.items():
            setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)

    def patch(self, name: str, reads: Callable) -> None:
        """Wrap torch.Tensor.`name` so a call that `reads(name, caller, args, kwargs)` is booked."""
        method = self.originals[name] = getattr(torch.Tensor, name)

        def wrapped(tensor, *args, **kwargs):
            caller = sys._getframe(1)
            if reads(name, caller, args, kwargs):
                self.book(f"Tensor.{name}", caller)
            return method(tensor, *args, **kwargs)

        setattr(torch.Tensor, name, wrapped)


def titanlites_transfer(name: str, caller, args, kwargs) -> bool:
    """A move to the host from titanlite's code: `.cpu()`, `copy_` (every tensor is a host tensor
    here), `.to()` with the CPU as its destination (not a dtype-only `.to`)."""
    if TITANLITE not in caller.f_code.co_filename:
        return False
    if name == "to":
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        return device is not None and device.type == "cpu"
    return True
