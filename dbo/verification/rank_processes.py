"""Forked rank processes for `dbo.verify_ranks`: started, watched, dumped on a hang, and reaped.

The ranks are forked from the caller (Linux): each inherits the user's forward and batches as
they are (closures included), and starts in a fraction of a second where a fresh interpreter
would import torch again. Each joins a gloo process group through a TCPStore hosted here.

Nothing outlives the call. A rank asks Linux to SIGKILL it when this process dies (prctl's
parent-death signal). Past the timeout, or once a rank has died while its peers still run,
every rank still running is asked, on a pipe its dump thread reads, to write its Python stacks
and PyTorch's flight-recorder entries to a file; then every rank is killed and reaped.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dbo.collective_calls import user_site
from dbo.fingerprint import current_tracker

__all__ = ["RankContext", "RanksRun", "run_ranks"]

# After one rank died, how long its peers get to finish (theirs are the report's lines).
_PEER_GRACE_S = 2.0
# How long the launcher waits for the dumps of hung ranks before killing them.
_DUMP_WAIT_S = 2.0
_POLL_S = 0.02
_PR_SET_PDEATHSIG = 1
_FLIGHT_RECORDER_ENTRIES = 256


@dataclass(frozen=True)
class RankContext:
    """What one rank's body is given: its rank, the world size and its files' folder."""

    rank: int
    world_size: int
    workdir: Path

    def path(self, what: str) -> Path:
        return self.workdir / f"rank{self.rank}.{what}"


@dataclass
class RanksRun:
    """How the rank processes ended: exit codes (None: killed), why any was killed, pids."""

    exit_codes: list[int | None]
    pids: list[int]
    hung: bool = False
    why_ended: str = ""
    dumps: dict[int, dict[str, Any]] = field(default_factory=dict)


def run_ranks(
    body: Callable[[RankContext], int | None], world_size: int, timeout: float, workdir: Path
) -> RanksRun:
    """Fork `world_size` ranks that each join a gloo group and run `body(context)` (its
    return value: the rank's exit code); wait at most `timeout` seconds, then dump and kill
    whatever still runs."""
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout)
    )
    context = multiprocessing.get_context("fork")
    procs, pipes = [], []
    for rank in range(world_size):
        read_fd, write_fd = os.pipe()
        ctx = RankContext(rank, world_size, workdir)
        proc = context.Process(
            target=_child,
            args=(body, ctx, store.port, timeout, read_fd, os.getpid()),
            name=f"dbo-rank-{rank}",
            daemon=True,
        )
        proc.start()
        os.close(read_fd)
        procs.append(proc)
        pipes.append(write_fd)
    try:
        run = _wait(procs, pipes, timeout, workdir)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        for fd in pipes:
            os.close(fd)
    run.exit_codes = [
        p.exitcode if p.exitcode is not None and p.exitcode >= 0 else None for p in procs
    ]
    return run


def _wait(procs: list, pipes: list[int], timeout: float, workdir: Path) -> RanksRun:
    end = time.monotonic() + timeout
    died_at: float | None = None
    pids = [p.pid for p in procs]
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode != 0]
        if dead and died_at is None:
            died_at = now
        why = ""
        if now >= end:
            why = f"the group did not finish within the {timeout:g} s timeout"
        elif died_at is not None and now - died_at > _PEER_GRACE_S:
            why = (
                f"rank {dead[0]} ended (exit {procs[dead[0]].exitcode}) and its peers did not "
                f"end within {_PEER_GRACE_S:g} s"
            )
        if why:
            hung = [r for r, p in enumerate(procs) if p.is_alive()]
            return RanksRun([], pids, True, why, _dump(hung, pipes, workdir))
        time.sleep(_POLL_S)
    return RanksRun([], pids)


def _dump(ranks: list[int], pipes: list[int], workdir: Path) -> dict[int, dict[str, Any]]:
    """Ask each hung rank for its stacks and flight recorder; what came back by rank."""
    for rank in ranks:
        try:
            os.write(pipes[rank], b"d")
        except OSError:
            pass
    end = time.monotonic() + _DUMP_WAIT_S
    dumps: dict[int, dict[str, Any]] = {}
    while time.monotonic() < end and len(dumps) < len(ranks):
        for rank in ranks:
            path = workdir / f"rank{rank}.dump.json"
            if rank not in dumps and path.exists():
                dumps[rank] = json.loads(path.read_text())
        time.sleep(_POLL_S)
    return dumps


# ------------------------------------------------------------------------------ in the rank


def _child(
    body: Callable[[RankContext], int | None],
    ctx: RankContext,
    port: int,
    timeout: float,
    dump_fd: int,
    launcher: int,
) -> None:
    """A rank process: tie to the launcher, redirect output, join the group, run `body`."""
    code = 1
    try:
        _tie_to_launcher(launcher)
        out = os.open(ctx.path("out"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        torch.set_num_threads(1)
        _start_dump_thread(ctx, dump_fd)
        # gloo's own timeout is a backstop past the launcher's: a rank blocked in a collective
        # must still be blocked when the launcher's deadline asks it where it stands.
        _join_group(ctx, port, 2 * timeout + 10.0)
        code = body(ctx) or 0
    except BaseException:  # noqa: BLE001 - a rank reports by its result file and exit code
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # No teardown: a collective may be left half-done in gloo's threads, and destroying
        # the group would wait for it.
        os._exit(code)


def _tie_to_launcher(launcher: int) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(int(signal.SIGKILL)))
    if os.getppid() != launcher:  # the launcher died before the call: no signal comes
        os._exit(4)


def _join_group(ctx: RankContext, port: int, timeout: float) -> None:
    # PyTorch's own fingerprint of every collective (op, shapes, dtypes), and its flight
    # recorder (which records gloo in this torch): both read when the group is created.
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    os.environ["TORCH_FR_BUFFER_SIZE"] = str(_FLIGHT_RECORDER_ENTRIES)
    dist.set_debug_level_from_env()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout))
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("dbo-verify-ranks", store),
        rank=ctx.rank,
        world_size=ctx.world_size,
        timeout=timedelta(seconds=timeout),
    )


def _start_dump_thread(ctx: RankContext, dump_fd: int) -> None:
    """A daemon thread that, when the launcher writes to `dump_fd`, writes where every thread
    of this rank stands and what the flight recorder holds. It runs while the main thread is
    blocked in a collective (gloo releases the GIL while it waits)."""

    def wait_and_dump() -> None:
        try:
            if not os.read(dump_fd, 1):
                return  # the launcher closed the pipe: the run ended normally
        except OSError:
            return
        dump = {"threads": _thread_sites(), "flight_recorder": _flight_recorder()}
        tracker = current_tracker()
        dump["pending_async"] = tracker.pending() if tracker is not None else []
        tmp = ctx.path("dump.json.tmp")
        tmp.write_text(json.dumps(dump, default=str))
        tmp.replace(ctx.path("dump.json"))

    threading.Thread(target=wait_and_dump, name="dbo-rank-dump", daemon=True).start()


def _thread_sites() -> dict[str, str]:
    """Each thread's innermost frame in the user's code, for the threads that are in it (the
    main thread of a rank usually waits in `dbo.verify` for its step's thread)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    sites = {}
    for ident, frame in sys._current_frames().items():
        name = names.get(ident, str(ident))
        site = user_site(frame, stop=_child.__code__)  # above it: the launcher's frames
        if name != "dbo-rank-dump" and site != "unknown":
            sites[name] = site
    return sites


def _flight_recorder() -> list[dict[str, Any]]:
    try:
        raw = torch._C._distributed_c10d._dump_fr_trace_json(True, False)
    except (AttributeError, RuntimeError):
        return []
    entries = json.loads(raw).get("entries", [])
    keep = ("collective_seq_id", "profiling_name", "input_sizes", "state", "retired")
    return [{k: e.get(k) for k in keep} for e in entries[-16:]]
