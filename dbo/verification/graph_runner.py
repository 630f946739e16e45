"""An engine's CUDA-graph path on the simulated device: capture one graph per dispatcher key,
then serve each step by dispatching it and replaying the captured graph, checked first.

`CUDAGraphRunner(forward, dispatcher, device=, key=)` captures, for every key the dispatcher
holds, `forward` on the engine's dummy batch for that key (`capture_all(dummy_batch)`),
serial or ubatched as the key says (a ubatched key needs the runner's `split`; its pieces
should be views of the batch, which a replay's copy reaches). `run(batch)` is one step as
the engine runs it: the engine's own `key(batch, num_ubatches)` (the descriptor it builds, right or
wrong) goes to the dispatcher, and the chosen graph is replayed after the batch's tensors
are copied into the captured ones (vLLM's persistent input buffers). NONE runs eager;
PIECEWISE runs eager too on the simulated device, which does not cut a graph around
attention (what PIECEWISE leaves outside).

Before a FULL replay the runner checks that the graph describes the batch it is replayed for
(`GraphReplay.problems`): the descriptor (kind, ubatch count, size, and the DP-agreed size),
and the captured inputs: every tensor's shape, and the request layout a FULL graph freezes
(`query_start_loc`, `num_reqs` of the attention metadata). Values a FULL graph reads from its
buffers at replay (`seq_lens`, slots) may change from step to step and are not compared.
Pointers are checked by the graph itself (`SimGraph.check_pointers`, the workspace's slots).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dbo.devices import use_device
from dbo.graph_dispatch import BatchDescriptor, CudagraphDispatcher, CUDAGraphMode
from dbo.runner import merge_outputs, run_ubatches
from dbo.sim.device import SimDevice
from dbo.sim.graph import SimGraph
from dbo.split import CommonAttentionMetadata
from dbo.verification.compare import snapshot

__all__ = ["CUDAGraphRunner", "GraphEntry", "GraphReplay", "describe_batch"]

Split = Callable[[Any, int], Sequence[Any]]


def tensor_paths(value: Any, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a batch by where it sits ("['attn'].seq_lens")."""
    if isinstance(value, torch.Tensor):
        return {path or "batch": value}
    if isinstance(value, Mapping):
        items = [(f"{path}[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, (tuple, list)):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [(f"{path}.{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value)]
    else:
        return {}
    found: dict[str, torch.Tensor] = {}
    for where, v in items:
        found.update(tensor_paths(v, where))
    return found


def _metadata(batch: Any) -> dict[str, CommonAttentionMetadata]:
    """The attention metadata a batch carries, by where it sits (itself, or one level down)."""
    if isinstance(batch, CommonAttentionMetadata):
        return {"batch": batch}
    if isinstance(batch, Mapping):
        items = [(f"[{k!r}]", v) for k, v in batch.items()]
    elif isinstance(batch, (tuple, list)):
        items = [(f"[{i}]", v) for i, v in enumerate(batch)]
    else:
        return {}
    return {where: v for where, v in items if isinstance(v, CommonAttentionMetadata)}


def describe_batch(
    batch: Any, *, uniform_decode_query_len: int = 1, num_ubatches: int = 1
) -> BatchDescriptor:
    """The descriptor a batch really has, from its attention metadata: tokens, requests, and
    whether it is a uniform decode (every request `uniform_decode_query_len` tokens, none
    still in its prompt where `is_prefilling` says). Without metadata: dim 0, mixed."""
    metas = list(_metadata(batch).values())
    if not metas:
        rows = {t.shape[0] for t in tensor_paths(batch).values() if t.dim()}
        return BatchDescriptor(max(rows, default=0), None, False, num_ubatches)
    m = metas[0]
    qsl = [int(v) for v in m.query_start_loc_cpu.tolist()]
    lens = [b - a for a, b in itertools.pairwise(qsl) if b > a]
    prefilling = m.is_prefilling is not None and bool(m.is_prefilling.any())
    uniform = bool(lens) and not prefilling and all(n == uniform_decode_query_len for n in lens)
    num_reqs = len(lens) if uniform else None
    return BatchDescriptor(int(m.num_actual_tokens), num_reqs, uniform, num_ubatches)


@dataclass
class GraphEntry:
    """One captured graph: its mode and key, the batch it was captured on (whose tensors the
    graph reads: the static inputs), and its output tensors (each ubatch's, for a ubatched
    key)."""

    mode: CUDAGraphMode
    descriptor: BatchDescriptor
    graph: SimGraph
    inputs: Any
    output: Any


@dataclass
class GraphReplay:
    """One step served through the graphs: what the engine keyed, what the dispatcher chose,
    what the batch really is, and every way the chosen graph does not describe it."""

    step: str
    mode: CUDAGraphMode
    key: BatchDescriptor
    batch: BatchDescriptor
    problems: list[str] = field(default_factory=list)
    output: Any = None
    mismatch: str | None = None  # how the output differs from the eager serial step's
    max_abs_diff: float | None = None

    @property
    def ok(self) -> bool:
        return not self.problems and self.mismatch is None

    def describe(self) -> str:
        head = f"{self.step}: {self.mode.name} graph [{self.key.describe()}]"
        head += f" for a batch of [{self.batch.describe()}]"
        lines = [head, *(f"  {p}" for p in self.problems)]
        if self.mismatch is not None:
            lines.append(f"  output differs from the eager step's: {self.mismatch}")
        return "\n".join(lines)


class CUDAGraphRunner:
    """Captures a step's graphs per dispatcher key and serves steps through them (see the
    module docstring). `key(batch, num_ubatches) -> BatchDescriptor`: how the engine
    describes a step before dispatch (default: `describe_batch`, what it really is).
    `split`/`merge`: how a ubatched key's step is cut and joined. `num_tokens_across_dp`:
    this step's DP-agreed counts, which every replayed graph's size must match."""

    def __init__(
        self,
        forward: Callable[[Any], Any],
        dispatcher: CudagraphDispatcher,
        *,
        device: SimDevice,
        key: Callable[[Any, int], BatchDescriptor] | None = None,
        split: Split | None = None,
        merge: Callable[[list[Any]], Any] = merge_outputs,
        timeout: float = 60.0,
        num_tokens_across_dp: Sequence[int] | None = None,
    ) -> None:
        if not callable(forward):
            raise TypeError(f"forward must be callable, got {type(forward).__name__}")
        if not isinstance(dispatcher, CudagraphDispatcher):
            raise TypeError(f"dispatcher must be a CudagraphDispatcher, got {dispatcher!r:.80}")
        if not isinstance(device, SimDevice):
            raise TypeError("CUDAGraphRunner replays on the simulated device: pass a SimDevice")
        self.forward, self.dispatcher, self.device = forward, dispatcher, device
        q = dispatcher.uniform_decode_query_len
        self.key = key or (
            lambda batch, n: describe_batch(batch, uniform_decode_query_len=q, num_ubatches=n)
        )
        self.split, self.merge, self.timeout = split, merge, timeout
        self.num_tokens_across_dp = num_tokens_across_dp
        self.entries: dict[tuple[CUDAGraphMode, BatchDescriptor], GraphEntry] = {}

    # ----------------------------------------------------------------------------- capture

    def capture_all(self, dummy_batch: Callable[[BatchDescriptor], Any]) -> None:
        """Capture one graph per dispatcher key on `dummy_batch(key)`, the engine's dummy run
        for that key (padded to its token count)."""
        for mode, key in self.dispatcher.keys():
            self.capture(mode, key, dummy_batch(key))

    def capture(self, mode: CUDAGraphMode, key: BatchDescriptor, batch: Any) -> GraphEntry:
        graph = self.device.graph()
        output = self._step(batch, key.num_ubatches, graph, merge=False)
        entry = GraphEntry(mode, key, graph, batch, output)
        self.entries[(mode, key)] = entry
        return entry

    def _step(
        self, batch: Any, num_ubatches: int, graph: SimGraph | None = None, merge: bool = True
    ) -> Any:
        """One step, serial or ubatched, captured into `graph` if given. Unmerged (the
        ubatches' own outputs) for a capture: a replay rewrites those, not a merge made after
        the graph ended."""
        if num_ubatches == 1:
            with use_device(self.device), self.device.thread_scope(None):
                if graph is None:
                    return self.forward(batch)
                with graph:
                    return self.forward(batch)
        if self.split is None:
            raise ValueError(
                f"a key of {num_ubatches} ubatches needs split=fn(batch, num_ubatches) on the "
                f"runner"
            )
        pieces = self.split(batch, num_ubatches)
        outputs = run_ubatches(
            self.forward, pieces, device=self.device, timeout=self.timeout, graph=graph
        )
        return self.merge(outputs) if merge else outputs

    # ------------------------------------------------------------------------------ replay

    def run(
        self,
        batch: Any,
        *,
        num_ubatches: int = 1,
        num_tokens_across_dp: Sequence[int] | None = None,
        step: str = "step",
    ) -> GraphReplay:
        """Serve one step as the engine would: key, dispatch, check, replay (or run eager).
        `num_tokens_across_dp` (default: the runner's): the DP-agreed counts the chosen
        graph's size is checked against; the engine's own key decides the size."""
        engine_key = self.key(batch, num_ubatches)
        if not isinstance(engine_key, BatchDescriptor):
            raise TypeError(
                f"key(batch, num_ubatches) must return a BatchDescriptor, got {engine_key!r:.80}"
            )
        if num_tokens_across_dp is None:
            num_tokens_across_dp = self.num_tokens_across_dp
        mode, key = self.dispatcher.dispatch(engine_key)
        q = self.dispatcher.uniform_decode_query_len
        truth = describe_batch(batch, uniform_decode_query_len=q, num_ubatches=num_ubatches)
        replay = GraphReplay(step, mode, key, truth)
        replay.problems += self._descriptor_problems(mode, key, truth, num_tokens_across_dp)
        entry = self.entries.get((mode, key))
        if mode == CUDAGraphMode.FULL and entry is None:
            replay.problems.append(f"no FULL graph was captured for [{key.describe()}]")
        if mode != CUDAGraphMode.FULL or entry is None:
            replay.output = snapshot(self._step(batch, num_ubatches))
            return replay
        replay.problems += _input_problems(entry.inputs, batch)
        if any(p.startswith("shapes") for p in replay.problems):
            return replay  # the batch cannot be copied into the captured buffers
        _copy_into(entry.inputs, batch)
        with use_device(self.device), self.device.thread_scope(None):
            entry.graph.replay()
        output = entry.output if key.num_ubatches == 1 else self.merge(entry.output)
        replay.output = snapshot(output)
        return replay

    def _descriptor_problems(
        self,
        mode: CUDAGraphMode,
        key: BatchDescriptor,
        truth: BatchDescriptor,
        num_tokens_across_dp: Sequence[int] | None,
    ) -> list[str]:
        found = []
        if num_tokens_across_dp is not None:
            agreed = max(num_tokens_across_dp)
            want = self.dispatcher.padded_num_tokens(agreed) or agreed
            if key.num_tokens != want:
                found.append(
                    f"DP size: the step runs a graph of {key.num_tokens} tokens, but the ranks "
                    f"agreed on {agreed} tokens (a graph of {want}); a rank that replays "
                    f"another size than its peers runs collectives of another size"
                )
        if mode != CUDAGraphMode.FULL:
            return found
        if key.uniform and not truth.uniform:
            found.append(
                "graph kind: a FULL graph captured for a uniform decode batch is replayed for "
                "a mixed batch (its query lengths differ, or a request is still in its prompt)"
            )
        if key.num_ubatches != truth.num_ubatches:
            found.append(
                f"ubatches: a graph captured for {key.num_ubatches} ubatch(es) is replayed for "
                f"a step of {truth.num_ubatches}"
            )
        if key.num_tokens < truth.num_tokens:
            found.append(
                f"size: a graph of {key.num_tokens} tokens is replayed for {truth.num_tokens}"
            )
        return found


def _input_problems(captured: Any, batch: Any) -> list[str]:
    """Shapes of every tensor, and the request layout of the attention metadata."""
    found, shapes = [], []
    have, got = tensor_paths(captured), tensor_paths(batch)
    for where in sorted(set(have) | set(got)):
        a, b = have.get(where), got.get(where)
        if a is None or b is None or a.shape != b.shape:
            shape_a = None if a is None else tuple(a.shape)
            shape_b = None if b is None else tuple(b.shape)
            shapes.append(f"{where}: captured {shape_a}, replayed with {shape_b}")
    if shapes:  # one line: a batch of another size differs in every tensor
        more = f"; and {len(shapes) - 2} more" if len(shapes) > 2 else ""
        found.append(f"shapes of the captured inputs differ: {'; '.join(shapes[:2])}{more}")
    ours, theirs = _metadata(captured), _metadata(batch)
    for where, m in ours.items():
        other = theirs.get(where)
        if other is None:
            continue
        a, b = m.query_start_loc_cpu.tolist(), other.query_start_loc_cpu.tolist()
        if a != b:
            found.append(
                f"captured input {where}.query_start_loc_cpu: the graph was captured for the "
                f"request layout {a} and is replayed for {b}"
            )
    return found


def _copy_into(captured: Any, batch: Any) -> None:
    """The batch's values into the captured tensors (a FULL graph's persistent buffers)."""
    got = tensor_paths(batch)
    for where, t in tensor_paths(captured).items():
        if t is not got[where]:
            t.copy_(got[where])
