"""Op interception: a per-thread TorchDispatchMode that runs each aten op eagerly and hands
each kernel to the simulated device (`SimDevice.issue`, which prices and places it), and a
TorchFunctionMode that turns host reads into host syncs.

Both are entered by `SimDevice.thread_scope` in the calling thread (torch's mode stacks are
thread-local), so each ubatch thread's ops are attributed to its ubatch and current stream.
The per-op path is kept lean for meta-tensor runs of full-size models: the classification of
an op overload (view / allocation / host read / kernel, its FLOP formula, which arguments it
writes) is computed once and cached; race bookkeeping is skipped where there is no checker.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import ExitStack
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from dbo.sim.cost import OpCall, aliased_input_bytes, flop_formula
from dbo.sim.meta_kernels import run_kernel
from dbo.sim.ranges import ENTER, EXIT, profiler_range_op
from dbo.sim.state import SimDeviceProtocol

__all__ = [
    "enter_modes",
    "measure",
    "op_info",
    "OpInfo",
    "FREE",
    "ALLOC",
    "KERNEL",
    "HOST_READ",
]

FREE = 0  # views, metadata: no kernel, no time, not placed
ALLOC = 1  # an allocation without a kernel (empty): not placed, but a fresh storage
KERNEL = 2  # a kernel: placed and costed
HOST_READ = 3  # a kernel whose result the host reads (item, equal): placed, then host sync

# Ops that only produce aliases or metadata although their schema does not say "view".
_FREE_NAMES = frozenset(
    {
        "_unsafe_view",
        "_reshape_alias",
        "lift_fresh",
        "alias",
        "detach",
        "record_stream",
        "resolve_conj",
        "resolve_neg",
        "set_",
        "resize_",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "is_same_size",
        "_has_compatible_shallow_copy_type",
        "_nested_tensor_size",
        "_nested_tensor_strides",
    }
)
_ALLOC_NAMES = frozenset({"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"})
_HOST_READ_NAMES = frozenset({"_local_scalar_dense", "equal", "is_nonzero", "allclose"})


class OpInfo:
    """What the simulator needs to know about one op overload, computed once."""

    __slots__ = ("kind", "name", "flop_fn", "writes")

    def __init__(
        self, kind: int, name: str, flop_fn: Any, writes: tuple[tuple[int, str], ...]
    ) -> None:
        self.kind = kind
        self.name = name
        self.flop_fn = flop_fn
        self.writes = writes  # (position, name) of arguments the op mutates


_INFO: dict[Any, OpInfo] = {}


def op_info(func: Any) -> OpInfo:
    info = _INFO.get(func)
    if info is None:
        info = _INFO[func] = _classify(func)
    return info


def _classify(func: Any) -> OpInfo:
    schema = func._schema
    name = schema.name
    base = name.split("::")[-1]
    returns_tensor = any("Tensor" in str(r.type) for r in schema.returns)
    writes = tuple(
        (i, a.name)
        for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )
    if base in _HOST_READ_NAMES:
        kind = HOST_READ
    elif getattr(func, "is_view", False) or base in _FREE_NAMES:
        kind = FREE
    elif not returns_tensor and not writes:
        kind = FREE  # metadata queries (sizes, strides, flags)
    elif base in _ALLOC_NAMES:
        kind = ALLOC
    else:
        # Includes ops that return nothing but write their arguments: in-place list ops
        # (`_foreach_*_`, fused optimizer steps) and `out=` lists are kernels too.
        kind = KERNEL
    return OpInfo(kind, name, flop_formula(func), writes)


def _tensors(values: Iterable[Any], into: list[torch.Tensor]) -> None:
    for v in values:
        if isinstance(v, torch.Tensor):
            into.append(v)
        elif isinstance(v, (list, tuple)):
            for w in v:
                if isinstance(w, torch.Tensor):
                    into.append(w)


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _cost_dtype(ins: list[torch.Tensor], outs: list[torch.Tensor]) -> torch.dtype:
    # The math runs in the dtype of the floating inputs (an index tensor does not count).
    for t in ins:
        if t.is_floating_point():
            return t.dtype
    return ins[0].dtype if ins else (outs[0].dtype if outs else torch.float32)


class SimDispatchMode(TorchDispatchMode):
    """Runs every op and places each kernel on the thread's current stream of `device`."""

    def __init__(self, device: SimDeviceProtocol) -> None:
        super().__init__()
        self.device = device

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in a dynamo guard whose first call imports
        # torch._dynamo, which delayed the first step (and its first fault report) of every
        # process. Nothing here runs under torch.compile, so the guard has nothing to guard.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        info = _INFO.get(func) or op_info(func)
        kind = info.kind
        out = run_kernel(func, args, kwargs)
        if kind == FREE:
            return out
        device = self.device
        tls = device.thread_state()
        if tls.suspended:
            return out
        if kind == ALLOC:
            if isinstance(out, torch.Tensor):
                device.note_allocation(out)
            return out
        device.issue(measure(func, info, args, kwargs, out))
        if kind == HOST_READ:
            device.host_read(info.name)
        return out


def measure(func: Any, info: OpInfo, args: tuple, kwargs: dict, out: Any) -> OpCall:
    """One executed kernel as the cost model sees it: its tensor inputs and outputs, the
    bytes it moves and the FLOPs its formula gives, and the dtype its math runs in."""
    ins: list[torch.Tensor] = []
    _tensors(args, ins)
    if kwargs:
        _tensors(kwargs.values(), ins)
    outs: list[torch.Tensor] = []
    _tensors(out if isinstance(out, (list, tuple)) else (out,), outs)
    nbytes = _nbytes(ins) + _nbytes(outs) - aliased_input_bytes(func, ins)
    flops = 0.0
    if info.flop_fn is not None:
        try:
            flops = float(info.flop_fn(*args, **kwargs, out_val=out))
        except Exception:  # an unusual overload the formula does not parse: memory bound
            flops = 0.0
    dtype = _cost_dtype(ins, outs)
    return OpCall(info.name, func, args, kwargs, out, ins, outs, flops, nbytes, dtype)


# `.item()` is absent: it dispatches `_local_scalar_dense`, a HOST_READ op placed above.
_HOST_FUNCS = {
    torch.Tensor.tolist: "tolist",
    torch.Tensor.cpu: "cpu",
    torch.Tensor.numpy: "numpy",
}


def _to_host(args: tuple, kwargs: dict) -> bool:
    for v in (*args[1:], kwargs.get("device")):
        if isinstance(v, torch.device) and v.type == "cpu":
            return True
        if isinstance(v, str) and v.startswith("cpu"):
            return True
    return False


class HostReadMode(TorchFunctionMode):
    """`.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `.to("cpu")`: the host reads device data,
    which on a GPU waits for the current stream. On a CPU tensor most of these never reach the
    dispatcher, hence a function mode."""

    def __init__(self, device: SimDeviceProtocol) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _carry_profiler_range(self.device, func, args)
        what = _HOST_FUNCS.get(func)
        if what is None and func is torch.Tensor.to and _to_host(args, kwargs):
            what = "to(cpu)"
        if what is not None and not self.device.thread_state().suspended:
            self.device.host_read(what)
        return func(*args, **kwargs)


def _carry_profiler_range(device: SimDeviceProtocol, func: Any, args: tuple) -> None:
    """`torch.profiler.record_function` enters and exits through these ops: carry them into
    the trace as named host ranges (`dbo.sim.ranges`)."""
    what = profiler_range_op(func)
    if what is None:
        return
    state = device.thread_state()
    if state.suspended:
        return
    if what == ENTER:
        state.ranges.open(str(args[0]) if args else "?", "record_function")
    elif what == EXIT:
        state.ranges.close()


def enter_modes(device: SimDeviceProtocol, stack: ExitStack) -> None:
    """Enter both modes in the calling thread; `stack.close()` leaves them."""
    stack.enter_context(SimDispatchMode(device))
    stack.enter_context(HostReadMode(device))
