"""One forward step of a model, serial or ubatched, eager or captured into a device graph.

Every runner times the same thing: the harness, the rank runner, the bench, the fidelity
table and the GPU check. A serial step is the model's plain forward (every dbo_* helper a
no-op) on the device's current stream; a ubatched step splits the batch over
`dbo.run_ubatches`. `prepare` is the engine's life cycle around a step: a fresh workspace,
an eager warm-up of every step to be measured (the slots grow to their largest need), then
the lock, after which a measured step must allocate nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

import dbo
from dbo.split import UBatchSlice, split_batch
from dbo.streams import Device
from scenarios.model import MoEModel
from workspace import init_workspace_manager, lock_workspace, reset_workspace_manager

__all__ = ["Step", "serial_step", "ubatched_step", "prepare"]


@dataclass(frozen=True)
class Step:
    """A callable step: `step()` runs it eagerly, `step.capture(graph)` records it into a
    device graph (`graph.replay()` then runs it). `slices` None is the serial step."""

    model: MoEModel
    x: torch.Tensor
    device: Device
    mode: str
    slices: tuple[UBatchSlice, ...] | None = None
    # The ubatched step: how long a ubatch may wait (run_ubatches' timeout). The serial step:
    # how long the whole forward may run (None: unbounded), checked between layers.
    timeout_s: float | None = dbo.DEFAULT_TIMEOUT_S
    # Serial only: enter the device's thread scope, where the simulator attributes ops. The
    # bench's no-simulator baseline leaves it out, so nothing is intercepted.
    thread_scope: bool = True

    @property
    def num_ubatches(self) -> int:
        """The workspace slots this step uses (1 for the serial step)."""
        return 1 if self.slices is None else len(self.slices)

    def __call__(self, graph: Any = None) -> Any:
        """Run the step once: the serial forward's output, or the list of the ubatches'
        outputs (captured into `graph` when one is given)."""
        if self.slices is None:
            return self._serial()
        return dbo.run_ubatches(
            self._forward_ubatch,
            self.slices,
            device=self.device,
            timeout=self.timeout_s,
            graph=graph,
        )

    def output(self) -> torch.Tensor:
        """Run the step once and return the whole batch's output (the ubatches' joined)."""
        out = self()
        return out if self.slices is None else torch.cat(out)

    def capture(self, graph: Any, *, side_stream: bool | None = None) -> torch.Tensor:
        """Record one step into `graph` and return the whole batch's output tensor, which
        every `graph.replay()` refills. The ubatched step captures through `run_ubatches`.
        The serial step captures on a side stream joined to the current one when
        `side_stream` (default: on CUDA, which cannot capture the default stream), else on
        the current stream. The GPU check forces the side stream so that the simulated
        device runs the CUDA sequence."""
        if self.slices is not None:
            return torch.cat(self(graph))
        if side_stream is None:
            side_stream = self.device.kind == "cuda"
        if not side_stream:
            with graph:
                return self._serial()
        current = self.device.current_stream()
        stream = self.device.Stream("capture")
        stream.wait_stream(current)
        graph.capture_stream = stream
        with graph, dbo.stream_context(stream):
            output = self._serial()
        current.wait_stream(stream)
        return output

    def _serial(self) -> torch.Tensor:
        scope = self.device.thread_scope(None) if self.thread_scope else nullcontext()
        with dbo.use_device(self.device), scope:
            return self.model.forward(self.x, None, mode=self.mode, timeout_s=self.timeout_s)

    def _forward_ubatch(self, s: UBatchSlice) -> torch.Tensor:
        return self.model.forward(self.x[s.token_slice], s, mode=self.mode)


def serial_step(
    model: MoEModel,
    x: torch.Tensor,
    device: Device,
    *,
    mode: str,
    thread_scope: bool = True,
    timeout_s: float | None = None,
) -> Step:
    """The model's plain forward of the whole batch, as one thread; with `timeout_s`, a
    forward still running after that many seconds raises TimeoutError between layers."""
    return Step(model, x, device, mode, timeout_s=timeout_s, thread_scope=thread_scope)


def ubatched_step(
    model: MoEModel,
    x: torch.Tensor,
    device: Device,
    *,
    mode: str,
    num_ubatches: int | None = None,
    slices: Sequence[UBatchSlice] | None = None,
    timeout_s: float = dbo.DEFAULT_TIMEOUT_S,
) -> Step:
    """The batch split over ubatch threads: into `num_ubatches` by `dbo.split`, or along the
    given `slices` (a rank's cuts, agreed across ranks)."""
    if (num_ubatches is None) == (slices is None):
        raise ValueError("ubatched_step takes exactly one of num_ubatches and slices")
    if slices is None:
        batch = model.batch
        slices = split_batch(batch.query_start_loc, batch.num_tokens, num_ubatches)
    return Step(model, x, device, mode, tuple(slices), timeout_s)


def prepare(
    torch_device: torch.device | str,
    slots: int,
    warmups: Sequence[Callable[[], Any]],
    *,
    rounds: int = 1,
) -> None:
    """A fresh workspace of `slots` slots, `rounds` eager runs of every warm-up, then the
    lock. Steps that share the workspace (a serial step uses slot 0) warm up together, so
    they can then run in any order."""
    reset_workspace_manager()
    init_workspace_manager(torch_device, slots)
    for _ in range(rounds):
        for warmup in warmups:
            warmup()
    lock_workspace()
