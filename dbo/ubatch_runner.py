"""Model runner V2's `UBatchRunner` (vLLM 0.33, `vllm/v1/worker/gpu/ubatch_utils.py`) on
dbo-sim's runtime: `prepare` splits a batch into its ubatches' slices and forward contexts,
`run` runs the model on them overlapped and merges their outputs, `begin_capturable_run` /
`abort_pending_run` split a run around a CUDA graph capture.

Its failure semantics are dbo-sim's, not vLLM's: the threads are `run_ubatches`', so a ubatch
that raises releases its peers and the run ends with one `UBatchError` ("Microbatch i of N
failed: ...", a RuntimeError as vLLM's; vLLM's own V2 runner says its siblings stay parked
and the step hangs), a step past its timeout ends with `UBatchTimeoutError`, and nothing hangs.

Differences from vLLM's, all from dbo-sim's launcher: the ubatch threads come from
`run_ubatches`' pool, which parks them before a graph capture is entered (pass `graph=`), so
`begin_capturable_run` starts no thread and `abort_pending_run` has none to join; the
constructor takes the parallel config and the device instead of vLLM's model state, and
`prepare` takes the batch's `CommonAttentionMetadata` instead of block tables and slot
mappings, splitting it with `dbo.split.split_attn_metadata` (a ubatch wholly in the padding
gets the record with no request rows).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from dbo.devices import resolve_device
from dbo.runner import DEFAULT_TIMEOUT_S, run_ubatches
from dbo.sm_control import create_sm_control_context
from dbo.split import (
    UBatchSlice,
    UBatchSlices,
    create_ubatch_slices,
    get_num_ubatches,
    merge_ubatch_outputs,
    slice_model_inputs,
    split_attn_metadata,
)
from dbo.streams import Device, Stream
from dbo.ubatching import set_forward_context

__all__ = ["UBatchForwardContext", "UBatchRunner", "UBatchState"]


@dataclass(frozen=True)
class UBatchForwardContext:
    """What one ubatch's thread finds in `current_forward_context()`: its slice, its attention
    metadata (None when `prepare` was given none) and its token count."""

    ubatch_slice: UBatchSlice
    attn_metadata: Any

    @property
    def num_tokens(self) -> int:
        return self.ubatch_slice.num_tokens


class UBatchState(NamedTuple):
    """Per-ubatch inputs of one step (vLLM V2's record): slices and forward contexts."""

    slices: UBatchSlices
    forward_contexts: list[Any]


class UBatchRunner:
    """Runs the model on N ubatches that overlap each other (N: the config's, >= 2)."""

    def __init__(
        self,
        parallel_config: Any,
        device: Device | str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        comm_sms: int | None = None,
    ) -> None:
        self.num_ubatches = get_num_ubatches(parallel_config)
        if self.num_ubatches < 2:
            raise ValueError("UBatchRunner needs ubatching on (use_ubatching and num_ubatches)")
        self.parallel_config = parallel_config
        self.device = resolve_device(device)
        self.timeout = timeout
        self.comm_stream = self.device.Stream("comm")
        self.capture_stream = self.device.Stream("capture")  # threads and capture share it
        self.sm_control = create_sm_control_context(
            parallel_config, device=self.device, comm_sms=comm_sms
        )
        # The begun run: its callback and what it holds (the SM reservation, the cleared
        # forward context) until it finishes or is aborted.
        self._pending: tuple[Callable[[], Any], ExitStack] | None = None

    def prepare(self, input_batch: Any, common_attn_metadata: Any = None) -> UBatchState:
        """Split the batch into the ubatches the step runs on (`create_ubatch_slices`), each
        with its forward context, carrying its share of `common_attn_metadata` if given."""
        slices = create_ubatch_slices(input_batch, self.num_ubatches)
        if common_attn_metadata is None:
            metadata: list[Any] = [None] * len(slices)
        else:
            metadata = split_attn_metadata(slices, common_attn_metadata, allow_empty=True)
        contexts = [UBatchForwardContext(s, m) for s, m in zip(slices, metadata)]
        return UBatchState(slices=slices, forward_contexts=list(contexts))

    def run(self, model: Any, model_inputs: Mapping[str, Any], ubatch_state: UBatchState) -> Any:
        """`model(**inputs)` on every ubatch, overlapped; the merged output."""
        return self.begin_capturable_run(model, model_inputs, ubatch_state)()

    def begin_capturable_run(
        self,
        model: Any,
        model_inputs: Mapping[str, Any],
        ubatch_state: UBatchState,
        for_capture: bool = False,
        *,
        graph: Any = None,
    ) -> Callable[[], Any]:
        """Check the run and reserve the SMs; the callback runs it and returns the merged
        output. Call the callback once, or `abort_pending_run()` instead. `for_capture`: run
        on the capture stream; `graph`: a `device.graph()` capture the run is recorded in."""
        self._check_no_pending(ubatch_state)
        compute_stream = self.capture_stream if for_capture else self.device.current_stream()
        launch = self._launcher(model, model_inputs, ubatch_state, compute_stream, graph)
        stack = ExitStack()
        stack.enter_context(set_forward_context(None))  # the threads own the forward context
        stack.enter_context(self.sm_control)  # SMs reserved until the run is over

        def finish() -> Any:
            if self._pending is None or self._pending[0] is not finish:
                raise RuntimeError("this run already finished or was aborted")
            try:
                outputs = launch()
            finally:
                self._pending = None
                stack.close()
            return merge_ubatch_outputs(outputs)

        self._pending = (finish, stack)
        return finish

    def _check_no_pending(self, ubatch_state: UBatchState) -> None:
        self._check_state(ubatch_state)
        if self._pending is not None:
            raise RuntimeError(
                "a run is still pending: call its callback or abort_pending_run() first"
            )

    def _launcher(
        self,
        model: Any,
        model_inputs: Mapping[str, Any],
        ubatch_state: UBatchState,
        compute_stream: Stream,
        graph: Any,
    ) -> Callable[[], list[Any]]:
        """The step the callback launches: `model(**inputs)` on each ubatch's slice of the
        inputs, in its thread. The inputs are sliced now, so a bad input fails before any SM
        is reserved."""
        inputs = [slice_model_inputs(model_inputs, s.token_slice) for s in ubatch_state.slices]
        offsets = [s.token_slice.start for s in ubatch_state.slices]

        def forward(ubatch_inputs: dict[str, Any]) -> Any:
            with torch.inference_mode():
                return model(**ubatch_inputs)

        return functools.partial(
            run_ubatches,
            forward,
            inputs,
            device=self.device,
            timeout=self.timeout,
            forward_contexts=ubatch_state.forward_contexts,
            compute_stream=compute_stream,
            comm_stream=self.comm_stream,
            graph=graph,
            token_offsets=offsets,
        )

    def abort_pending_run(self) -> None:
        """Give up a run begun but not finished (a failed capture): the SMs and the forward
        context are given back. No thread was started, so none is left parked."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[1].close()

    def _check_state(self, ubatch_state: UBatchState) -> None:
        slices, contexts = ubatch_state.slices, ubatch_state.forward_contexts
        if len(slices) != len(contexts):
            raise ValueError(
                f"ubatch_state has {len(slices)} slices but {len(contexts)} forward contexts"
            )
        if len(slices) != self.num_ubatches:
            raise ValueError(
                f"ubatch_state has {len(slices)} ubatches; this runner runs {self.num_ubatches}"
            )
