"""`plan`'s steps run across the machine's cores: each task records (or loads) one rank's step
and replays it for every EP group that needs it.

One job: run `StepTask`s in worker processes and hand back what the answer needs of each
replay (`GroupStep`), in task order. A task is one recording (`StepSpec`), so the skews that
share it cost one recording; a worker stores it and each replay's figures on disk
(`scenarios.tools.plan_cache`) for the next run, and the recording for the parent, which
replays the answer's point once more for its traces.

Workers are forked (the parent has torch and the model loaded already; a spawned worker would
pay that import again; the parent's objects are frozen out of the collector's reach first, so
a worker's collections do not copy the pages they sit on), at most `MAX_WORKERS` and never
more than the tasks, the costliest recordings first. One core, one
task or `workers=1`: the tasks run in this process. Ctrl-C: workers ignore SIGINT, the parent
terminates them and re-raises, so nothing is left running; while it forks them, the parent
holds SIGINT back and takes it once the pool is up.
"""

from __future__ import annotations

import gc
import multiprocessing
import multiprocessing.pool
import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass, fields

import numpy as np

from dbo.sim.cluster import ClusterResult, simulate_cluster
from dbo.sim.routing import Placement, Routing
from scenarios.lib.cluster_step import StepSpec
from scenarios.tools.plan_cache import load_replay, recording, store_replay

__all__ = ["MAX_WORKERS", "GroupStep", "StepTask", "local_cores", "replay", "run_tasks"]

MAX_WORKERS = 8  # the default's cap: recordings are CPU-bound, big hosts need not all cores


@dataclass(frozen=True)
class StepTask:
    """One recording and the EP groups (routing and placement) to replay it for."""

    spec: StepSpec
    groups: tuple[tuple[Routing, Placement], ...]

    @property
    def what(self) -> str:
        s = self.spec
        n = f"{s.num_ubatches} ubatches" if s.num_ubatches else "serial"
        return f"{s.phase} EP {s.config.ep_size} {s.tokens} tokens {n}"


@dataclass(frozen=True)
class GroupStep:
    """What the answer keeps of one group replay: the slowest rank and what held it."""

    step_us: float
    slowest_rank: int
    peer_wait_us: float
    exposed_comm_us: float

    @staticmethod
    def of(result: ClusterResult) -> GroupStep:
        slow = int(np.argmax(result.step_us))
        return GroupStep(
            float(result.step_us[slow]),
            slow,
            float(result.peer_wait_us[slow]),
            float(result.exposed_comm_of(slow)[0]),
        )


def local_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def replay(spec: StepSpec, routing: Routing, placement: Placement) -> ClusterResult:
    """`spec`'s step on every rank of its group, from the (cached) recording."""
    return simulate_cluster(recording(spec), routing, placement)


def run_task(task: StepTask) -> list[GroupStep]:
    return [_group_step(task.spec, r, p) for r, p in task.groups]


def _group_step(spec: StepSpec, routing: Routing, placement: Placement) -> GroupStep:
    """The replay's figures from the disk (a warm run replays nothing), else replayed."""
    kept = load_replay(spec, routing, placement)
    if kept is not None and len(kept) == len(fields(GroupStep)):
        return GroupStep(*kept)
    step = GroupStep.of(replay(spec, routing, placement))
    store_replay(spec, routing, placement, astuple(step))
    return step


def _run_numbered(item: tuple[int, StepTask]) -> tuple[int, list[GroupStep]]:
    return item[0], run_task(item[1])


def _longest_first(tasks: Sequence[StepTask]) -> list[int]:
    """Task indices, the costliest recording first (more ubatches, then more tokens), so that
    the last tasks to start are short and no core idles while one long task ends a round."""
    return sorted(
        range(len(tasks)),
        key=lambda i: (-(tasks[i].spec.num_ubatches or 1), -tasks[i].spec.tokens),
    )


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _fork_pool(count: int) -> multiprocessing.pool.Pool:
    """`count` forked workers, with Ctrl-C held meanwhile: one that arrives while the parent
    forks would be raised inside an at-fork handler, which Python reports and drops, and the
    run would go on. The caller unblocks it once the pool is in its hands."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return multiprocessing.get_context("fork").Pool(count, initializer=_ignore_sigint)
    except BaseException:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        raise


def run_tasks(
    tasks: Sequence[StepTask],
    workers: int | None = None,
    on_done: Callable[[str], None] | None = None,
) -> list[list[GroupStep]]:
    """Every task's group steps, in task order; `workers` processes (default: local cores,
    at most MAX_WORKERS); `on_done(what)` after each task, as tasks end."""
    count = min(workers or min(local_cores(), MAX_WORKERS), len(tasks))
    if count <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        out = []
        for task in tasks:
            out.append(run_task(task))
            if on_done is not None:
                on_done(task.what)
        return out
    gc.freeze()
    pool = _fork_pool(count)
    steps: dict[int, list[GroupStep]] = {}
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a held Ctrl-C lands here
        numbered = [(i, tasks[i]) for i in _longest_first(tasks)]
        for i, got in pool.imap_unordered(_run_numbered, numbered):
            steps[i] = got
            if on_done is not None:
                on_done(tasks[i].what)
        pool.close()
    except BaseException:  # Ctrl-C or a failed task: no worker outlives the call
        pool.terminate()
        raise
    finally:
        pool.join()
        gc.unfreeze()
    return [steps[i] for i in range(len(tasks))]
