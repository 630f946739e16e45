"""Launching, watching and reaping local rank processes: none outlives its launcher or timeout."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from scenarios.harness import RunOptions
from scenarios.ranks.crosscheck import register_crosscheck
from scenarios.ranks.group import HOSTED_ENV, RankSetupError, init_rank
from scenarios.ranks.merge import merge_outcomes
from scenarios.ranks.runner import (
    check_names,
    check_world_size,
    collect_outcomes,
    run_rank_scenarios,
)
from scenarios.registry import ScenarioResult, across_ranks

__all__ = ["child_main", "run_local_ranks"]

_SPEC_ENV = "DBO_SIM_RANK_SPEC"
# The launcher's pid, in the children of `run_local_ranks`: a child whose parent is no longer
# that process was orphaned and exits (`_exit_with_launcher`).
_LAUNCHER_ENV = "DBO_SIM_LAUNCHER_PID"
_ORPHANED_EXIT = 4
_SETUP_FAILED_EXIT = 3
# How often a child looks for its launcher, and the launcher for stopped children.
_WATCH_POLL_S = 0.1
# After a rank ends abnormally, how long its peers have to report before they are killed.
_PEER_GRACE_S = 2.0
# A child imports this module by name rather than running it as __main__, so that its
# scenarios register once.
_CHILD_ENTRY = "from scenarios.ranks.processes import child_main; raise SystemExit(child_main())"
_REPO_ROOT = Path(__file__).resolve().parents[2]


def _check_launch(names: Sequence[str], ranks: int) -> None:
    """Refuse (ValueError) names that run in one process and rank counts the experts do not
    divide, before any process starts."""
    unknown = check_names(names)
    if unknown:
        raise ValueError(
            f"scenario(s) {unknown} run in one process; across ranks: {sorted(across_ranks())}"
        )
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    bad_world = check_world_size(ranks)
    if bad_world:
        raise ValueError(f"ranks={ranks}: {bad_world}")


def run_local_ranks(
    names: Sequence[str], opts: RunOptions, ranks: int, *, deadline_s: float | None = None
) -> list[ScenarioResult]:
    """Start `ranks` processes on this machine, run `names` on each, merge, and return one
    `ScenarioResult` per name. Every process is ended by the deadline; none is left behind.

    The rank processes die with this one, however it ends (SIGKILL included: see
    `_spawn_rank`). A rank stopped (SIGSTOP, a debugger) for longer than `opts.timeout_s` is
    killed: by then every wait of its peers has expired, so nothing it could still do would
    count. Its peers' steps end by their own bounded waits (`timeout_s`) or, once it is
    killed, at once (or are ended `_PEER_GRACE_S` later), so a frozen rank ends the run within
    `timeout_s` + `_PEER_GRACE_S` plus the launcher's polls of the freeze, not at the deadline
    (see `_wait_for_ranks`)."""
    _check_launch(names, ranks)
    timeout = timedelta(seconds=opts.timeout_s)
    raw = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    store = dist.PrefixStore("dbo-sim", raw)
    deadline_s = deadline_s if deadline_s is not None else 60.0 + opts.timeout_s * (len(names) + 1)
    env = _children_env(names, opts, ranks, raw.port)
    with tempfile.TemporaryDirectory(prefix="dbo-ranks-") as logdir:
        logs = [Path(logdir) / f"rank{r}.log" for r in range(ranks)]
        missing = _run_children(env, logs, opts.timeout_s, deadline_s)
        table = collect_outcomes(store, names, ranks)
    return [merge_outcomes(name, table[name], opts, missing=missing) for name in names]


def _children_env(names: Sequence[str], opts: RunOptions, ranks: int, port: int) -> dict[str, str]:
    """The environment every rank process starts with (RANK and LOCAL_RANK are added per rank)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    if Path("/sys/class/net/lo").exists():
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's data connections on loopback too
    spec = {
        "names": list(names),
        "opts": {
            "num_ubatches": opts.num_ubatches,
            "device": opts.device,
            "profile": opts.profile,
            "timeout_s": opts.timeout_s,
        },
    }
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(ranks),
        **{HOSTED_ENV: "1", _SPEC_ENV: json.dumps(spec)},
    )
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    return env


def _run_children(
    env: dict[str, str], logs: Sequence[Path], timeout_s: float, deadline_s: float
) -> str:
    """Start one process per log, wait for them all, kill any left; what went wrong, per rank
    (empty when every rank exited 0)."""
    procs: list[subprocess.Popen] = []
    ended: dict[int, str] = {}
    try:
        for rank, path in enumerate(logs):
            with open(path, "wb") as log:
                procs.append(
                    _spawn_rank(
                        [sys.executable, "-c", _CHILD_ENTRY],
                        {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                        log,
                    )
                )
        ended = _wait_for_ranks(procs, timeout_s, deadline_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return "; ".join(
        f"rank {r} {ended.get(r, f'exited with {p.returncode}')}: {_tail(logs[r])}"
        for r, p in enumerate(procs)
        if p.returncode != 0
    )


def _spawn_rank(argv: list[str], env: dict[str, str], log: Any) -> subprocess.Popen:
    """Start one rank process, tied to this one: on Linux the kernel SIGKILLs it when this
    process (the thread calling here, which waits for it) dies, whatever killed it; everywhere
    its `child_main` also watches for the launcher to go (`_exit_with_launcher`)."""
    return subprocess.Popen(
        argv,
        env={**env, _LAUNCHER_ENV: str(os.getpid())},
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=_parent_death_hook(os.getpid()),  # noqa: PLW1509 - see _parent_death_hook
    )


_PR_SET_PDEATHSIG = 1


def _parent_death_hook(launcher_pid: int) -> Callable[[], None] | None:
    """A `preexec_fn` (run in the child between fork and exec) asking Linux to SIGKILL the
    child when its parent dies; None where prctl is unavailable. libc is looked up here, in
    the parent: the child runs only the call, on already-built arguments."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    option, sig = ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_ulong(int(signal.SIGKILL))

    def tie_to_launcher() -> None:
        prctl(option, sig)
        if os.getppid() != launcher_pid:  # the launcher died before the call: no signal comes
            os._exit(_ORPHANED_EXIT)

    return tie_to_launcher


def _exit_with_launcher(launcher_pid: int, poll_s: float = _WATCH_POLL_S) -> threading.Thread:
    """In a rank process: end it (exit code `_ORPHANED_EXIT`) as soon as its parent is no
    longer `launcher_pid`. The portable half of `_spawn_rank`'s tie (prctl is Linux-only): a
    rank whose launcher was killed would otherwise run on, holding its peers and the port."""

    def watch() -> None:
        while os.getppid() == launcher_pid:
            time.sleep(poll_s)
        os._exit(_ORPHANED_EXIT)

    if os.getppid() != launcher_pid:
        os._exit(_ORPHANED_EXIT)
    watcher = threading.Thread(target=watch, name="dbo-launcher-watch", daemon=True)
    watcher.start()
    return watcher


def _is_stopped(pid: int) -> bool:
    """True while process `pid` is stopped (SIGSTOP, a debugger), as Linux's /proc shows it;
    False where /proc is missing: the deadline alone bounds a stopped rank there."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:
        return False
    # "pid (comm) state ...": comm may hold spaces and parentheses, the state follows the last.
    return text[text.rfind(b")") + 2 : text.rfind(b")") + 3] in (b"T", b"t")


def _wait_for_ranks(
    procs: Sequence[subprocess.Popen], timeout_s: float, deadline_s: float
) -> dict[int, str]:
    """Wait for every rank to exit; returns why each rank it killed was killed, by rank.

    It kills a rank stopped (SIGSTOP, a debugger) for longer than `timeout_s`: by then every
    wait of its peers has expired. Once a rank has ended abnormally (killed, a nonzero exit),
    the others get `_PEER_GRACE_S` to report and exit, then are killed: their group is broken,
    so all they can still do is report (one in a gloo collective errors at once; one waiting on
    the store would wait out its own timeout). At the deadline every rank left is killed.

    Stopped time counts only while this launcher runs: a launcher stopped along with its ranks
    (Ctrl-Z on the whole job) finds them all stopped on resuming, and must not kill them for it.
    """
    killed: dict[int, str] = {}
    stopped_since: dict[int, float] = {}
    broken: tuple[float, str] | None = None  # when a rank first ended abnormally, and which
    end = time.monotonic() + deadline_s
    last = time.monotonic()
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if now - last > 1.0:  # this process was not running: the ranks' clocks start again
            stopped_since.clear()
            broken = (now, broken[1]) if broken else None
        last = now
        for rank, p in enumerate(procs):
            code = p.poll()
            if code is not None:
                stopped_since.pop(rank, None)
                if code != 0 and broken is None:
                    broken = (now, f"rank {rank} ended abnormally (exit {code})")
                continue
            stopped = _is_stopped(p.pid)
            if not stopped:
                stopped_since.pop(rank, None)
            reason = None
            if now >= end:
                reason = f"was still running at the {deadline_s:g} s deadline: killed"
            elif stopped and now - stopped_since.setdefault(rank, now) > timeout_s:
                reason = (
                    f"was stopped (SIGSTOP or a debugger) for longer than the {timeout_s:g} s "
                    f"timeout: killed"
                )
            elif broken is not None and now - broken[0] > _PEER_GRACE_S:
                reason = f"was still running {_PEER_GRACE_S:g} s after {broken[1]}: killed"
            if reason is not None:
                killed[rank] = reason
                p.kill()
        time.sleep(_WATCH_POLL_S)
    return killed


def _tail(path: Path, limit: int = 1500) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("frame #")]
    return "\n".join(lines)[-limit:] or "(no output)"


def child_main() -> int:
    """Entry of a process started by `run_local_ranks`."""
    if _LAUNCHER_ENV in os.environ:
        _exit_with_launcher(int(os.environ[_LAUNCHER_ENV]))
    register_crosscheck()  # rank-only scenarios, registered where they run

    spec = json.loads(os.environ[_SPEC_ENV])
    opts = RunOptions(**spec["opts"])
    try:
        env = init_rank(opts)
    except RankSetupError as error:
        print(f"dbo-sim: {error}", file=sys.stderr, flush=True)
        os._exit(_SETUP_FAILED_EXIT)
    run_rank_scenarios(env, spec["names"], opts)
    sys.stdout.flush()
    sys.stderr.flush()
    # No teardown: after a failed scenario a collective may be left half-done in gloo's
    # threads, and destroying the group would wait for it. The outcomes are in the store.
    os._exit(0)
