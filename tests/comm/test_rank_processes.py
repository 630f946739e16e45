"""Rank processes and their launcher: no rank outlives the launcher, and a stopped rank cannot
hold the run past its timeout.

Real processes throughout: most are plain sleepers started the way `run_local_ranks` starts a
rank (so they cost no torch import); the last test runs the scenarios across two ranks and
freezes one of them with SIGSTOP.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import dbo
from scenarios.harness import RunOptions
from scenarios.ranks import processes as distributed

REPO = Path(dbo.__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads process states from /proc"
)

_SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _gone(pid: int, within_s: float) -> bool:
    """True once `pid` has exited (a zombie nobody reaped yet counts as exited)."""
    give_up = time.monotonic() + within_s
    while time.monotonic() < give_up:
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                text = stat.read()
        except OSError:
            return True
        if text[text.rfind(b")") + 2 : text.rfind(b")") + 3] == b"Z":
            return True
        time.sleep(0.05)
    return False


def _start_launcher(script: str) -> tuple[subprocess.Popen, list[str]]:
    """A launcher process running `script`; returns it and the first two lines it prints."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", script],
        env=_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    lines = [launcher.stdout.readline().strip() for _ in range(2)]
    return launcher, lines


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ------------------------------------------------------------------ launcher death


@pytest.mark.timeout(90)
def test_ranks_die_with_a_launcher_killed_by_sigkill_or_sigterm():
    script = (
        "import subprocess, sys, time\n"
        "from scenarios.ranks import processes as distributed\n"
        f"rank = distributed._spawn_rank({_SLEEPER!r}, {{}}, subprocess.DEVNULL)\n"
        "print(rank.pid, flush=True)\nprint('started', flush=True)\ntime.sleep(60)\n"
    )
    # Both launchers start at once: each pays a torch import.
    launchers = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            env=_env(),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        for _ in range(2)
    ]
    children = [launcher.stdout.readline().strip() for launcher in launchers]
    try:
        for launcher, sig in zip(launchers, (signal.SIGKILL, signal.SIGTERM)):
            launcher.send_signal(sig)
            launcher.wait(10)
        for child, sig in zip(children, ("SIGKILL", "SIGTERM")):
            assert _gone(int(child), within_s=10), f"a rank outlived its launcher ({sig})"
    finally:
        for pid in [launcher.pid for launcher in launchers] + children:
            if str(pid).isdigit():
                _kill(int(pid))


@pytest.mark.timeout(90)
def test_a_rank_watching_its_launcher_exits_when_the_launcher_dies_without_prctl():
    # The portable half: a child started by a plain Popen (no parent-death signal) that runs
    # the watch child_main starts.
    watcher = (
        "import os, time\nfrom scenarios.ranks.processes import _exit_with_launcher\n"
        "_exit_with_launcher(os.getppid(), 0.05)\nprint('watching', flush=True)\n"
        "time.sleep(60)\n"
    )
    launcher, (child, ready) = _start_launcher(
        "import subprocess, sys, time\n"
        f"rank = subprocess.Popen([sys.executable, '-c', {watcher!r}])\n"
        "print(rank.pid, flush=True)\ntime.sleep(60)\n"
    )
    try:
        assert ready == "watching"
        launcher.kill()
        launcher.wait(10)
        assert _gone(int(child), within_s=10), "the rank outlived its launcher"
    finally:
        _kill(launcher.pid)
        if child.isdigit():
            _kill(int(child))


# ------------------------------------------------------------------ stopped ranks


def _sleepers(n: int) -> list[subprocess.Popen]:
    return [distributed._spawn_rank(_SLEEPER, _env(), subprocess.DEVNULL) for _ in range(n)]


@pytest.mark.timeout(60)
def test_a_stopped_rank_is_killed_after_the_timeout_and_its_waiting_peers_after_a_grace():
    procs = _sleepers(2)
    try:
        os.kill(procs[0].pid, signal.SIGSTOP)
        start = time.monotonic()
        killed = distributed._wait_for_ranks(procs, timeout_s=0.5, deadline_s=60.0)
        elapsed = time.monotonic() - start
    finally:
        for p in procs:
            _kill(p.pid)
            p.wait()
    assert "stopped (SIGSTOP or a debugger) for longer than the 0.5 s timeout" in killed[0]
    assert f"{distributed._PEER_GRACE_S:g} s after rank 0 ended abnormally" in killed[1]
    assert elapsed < 30  # not the 60 s deadline


@pytest.mark.timeout(60)
def test_a_rank_stopped_for_less_than_the_timeout_is_left_to_run():
    procs = [
        distributed._spawn_rank(
            [sys.executable, "-c", "import time; time.sleep(1.0)"], _env(), subprocess.DEVNULL
        )
    ]
    os.kill(procs[0].pid, signal.SIGSTOP)
    threading.Timer(0.3, os.kill, (procs[0].pid, signal.SIGCONT)).start()
    try:
        killed = distributed._wait_for_ranks(procs, timeout_s=5.0, deadline_s=60.0)
    finally:
        _kill(procs[0].pid)
    assert killed == {} and procs[0].returncode == 0


def _children() -> dict[int, int]:
    """This process's rank children: pid -> RANK."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                text = stat.read()
            with open(f"/proc/{entry}/environ", "rb") as environ:
                env = dict(v.split(b"=", 1) for v in environ.read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if int(text[text.rfind(b")") + 2 :].split()[1]) == os.getpid() and b"RANK" in env:
            found[int(entry)] = int(env[b"RANK"])
    return found


@pytest.mark.timeout(120)
def test_a_frozen_rank_ends_the_run_soon_after_the_timeout_not_at_the_deadline():
    # Once 70 s with --timeout 10: the launcher waited for the frozen rank until its deadline.
    timeout_s = 2.0
    stopped: list[float] = []

    def freeze_rank_1() -> None:
        give_up = time.monotonic() + 60
        while time.monotonic() < give_up:
            ranks = {rank: pid for pid, rank in _children().items()}
            if 1 in ranks:
                os.kill(ranks[1], signal.SIGSTOP)
                stopped.append(time.monotonic())
                return
            time.sleep(0.05)

    freezer = threading.Thread(target=freeze_rank_1, daemon=True)
    freezer.start()
    (result,) = distributed.run_local_ranks(["moe-prefill-ht"], RunOptions(timeout_s=timeout_s), 2)
    ended = time.monotonic()
    freezer.join(5)
    assert stopped, "rank 1 never started"
    assert not result.passed
    assert "rank 1 was stopped (SIGSTOP or a debugger) for longer than the 2 s timeout" in (
        result.error
    )
    # The deadline would have been 60 + 2 x 2 s after the start.
    assert ended - stopped[0] < timeout_s + 20
