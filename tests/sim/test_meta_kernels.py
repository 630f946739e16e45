"""Meta kernels reused by input shapes, and a graph replay that has no values to recompute on
meta tensors: the same shapes as torch's own kernels, fresh tensors, real ops elsewhere."""

from __future__ import annotations

import torch

from dbo.sim.calls import rerun_op
from dbo.sim.meta_kernels import REUSED, run_kernel

aten = torch.ops.aten


def _layout(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.dtype, t.device.type)


def test_a_reused_layer_norm_has_the_shapes_of_torchs_meta_kernel() -> None:
    x = torch.empty(5, 7, 64, dtype=torch.bfloat16, device="meta")
    w = torch.empty(64, dtype=torch.bfloat16, device="meta")
    args = (x, [64], w, None, 1e-6)
    expected = aten.native_layer_norm.default(*args)
    run_kernel(aten.native_layer_norm.default, args, {})  # the first run is torch's
    reused = run_kernel(aten.native_layer_norm.default, args, {})
    assert [_layout(t) for t in reused] == [_layout(t) for t in expected]


def test_reused_outputs_are_fresh_tensors_on_every_call() -> None:
    a = torch.empty(3, 4, device="meta")
    first = run_kernel(aten.add.Tensor, (a, a), {})
    second = run_kernel(aten.add.Tensor, (a, a), {})
    assert first is not second and first is not a


def test_another_dtype_or_scalar_type_is_another_shape_key() -> None:
    a = torch.empty(3, 4, dtype=torch.bfloat16, device="meta")
    run_kernel(aten.mul.Tensor, (a, a), {})
    wider = run_kernel(aten.mul.Tensor, (a, a.float()), {})
    assert wider.dtype == torch.float32
    i = torch.empty(3, dtype=torch.int64, device="meta")
    run_kernel(aten.floor_divide.default, (i, i), {})
    assert run_kernel(aten.floor_divide.default, (i, i.float()), {}).dtype == torch.float32


def test_cpu_tensors_run_the_op_with_their_values() -> None:
    a = torch.tensor([1.0, 2.0])
    assert aten.add.Tensor in REUSED
    assert run_kernel(aten.add.Tensor, (a, a), {}).tolist() == [2.0, 4.0]
    assert run_kernel(aten.add.Tensor, (a, a), {"alpha": 3}).tolist() == [4.0, 8.0]


def test_rerun_of_a_meta_op_leaves_its_captured_output_without_running_it() -> None:
    # nonzero has no meta kernel (its shape depends on values): re-running it on meta would
    # raise, and there is nothing to recompute.
    x = torch.empty(4, device="meta")
    captured = torch.empty(2, 1, dtype=torch.int64, device="meta")
    rerun_op(aten.nonzero.default, (x,), {}, captured)
    assert tuple(captured.shape) == (2, 1)
