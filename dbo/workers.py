"""The ubatch worker threads: long-lived, one ubatch per step each, pooled per process.

`run_ubatches` (`dbo.runner`) takes N workers from `WORKERS` for a step and gives them back
after it; a worker still in user code when its step ends (a timeout) is abandoned and ends as
soon as that code returns, never handed another job.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from dbo.frames import register_runtime_file

register_runtime_file(__file__)  # race reports leave the runtime's frames out of user stacks

__all__ = ["WORKERS", "UBatchWorker", "WorkerPool", "idle_worker_count"]


class UBatchWorker:
    """One long-lived ubatch thread: it runs one ubatch per step, then waits for the next.

    The first step a thread runs costs much more host time than later ones (per-thread CUDA
    and cuBLAS set-up inside torch), so a fresh thread per ubatch per step made every eager DBO
    step far slower on the host than serial (the README gives the GPU figures). Reusing the
    threads pays that set-up once.
    """

    def __init__(self, index: int) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.busy = False
        self.abandoned = False  # stuck in user code past a timeout: never handed a job again
        self.thread = threading.Thread(
            target=self._loop,
            name=f"dbo-ubatch-worker-{index}",
            daemon=True,  # a thread stuck in user code must not keep the process alive
        )
        self.thread.start()

    def submit(self, on_done: Callable[[], None], job: Callable[..., None], *args: Any) -> None:
        """Run `job(*args)` on this thread, then `on_done()` once the thread is free again."""
        self.busy = True
        self._jobs.put((on_done, job, args))

    def abandon(self) -> None:
        """Let the thread end as soon as its current job (if any) returns."""
        self.abandoned = True
        # The thread may already be back in _jobs.get() (it finished between the pool's
        # `busy` check and the flag above): the sentinel ends it there too.
        self._jobs.put(None)

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            on_done, job, args = item
            try:
                job(*args)
            finally:
                self.busy = False
                on_done()
            if self.abandoned:
                return


class WorkerPool:
    """The process's idle ubatch threads (one pool per process: `WORKERS`)."""

    def __init__(self) -> None:
        self._idle: list[UBatchWorker] = []
        self._created = 0
        self._lock = threading.Lock()

    def acquire(self, num: int) -> list[UBatchWorker]:
        with self._lock:
            # Most recently used first, so a steady N-ubatch loop keeps the same N threads.
            self._idle = [w for w in self._idle if w.thread.is_alive()]
            keep = max(len(self._idle) - num, 0)
            taken, self._idle = self._idle[keep:], self._idle[:keep]
            try:
                while len(taken) < num:
                    taken.append(UBatchWorker(self._created))
                    self._created += 1
            except BaseException:  # thread creation failed: keep what we have for later
                self._idle.extend(taken)
                raise
            return taken

    def release(self, workers: list[UBatchWorker]) -> None:
        with self._lock:
            for worker in workers:
                if worker.busy or not worker.thread.is_alive():
                    worker.abandon()
                else:
                    self._idle.append(worker)

    def idle_count(self) -> int:
        """Idle threads ready for the next step (for tests and reports)."""
        with self._lock:
            return len(self._idle)


# The process-wide pool (a documented registry: every step takes its threads from it).
WORKERS = WorkerPool()


def idle_worker_count() -> int:
    """Idle ubatch threads of the process's pool, ready for the next step (for tests and
    reports: after a clean step every worker thread is back here)."""
    return WORKERS.idle_count()
