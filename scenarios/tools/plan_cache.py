"""Recordings kept on disk between `plan` runs: one rank's stream program per configuration.

One job: find, store and invalidate the pickled `StreamProgram` of a `StepSpec`, and what
`plan` keeps of each replay of it. Recording a step through torch interception costs
seconds; replaying it for a whole EP group a fraction of that, which a prefill answer's
28 steps still add up to seconds; so a second `plan` over the same points reads both
(`replays/`, keyed by the recording's key and the group's routing and placement).

The key is a hash of everything the recording depends on: the spec (model configuration,
phase, tokens, ubatches, the whole hardware profile, GPUs per node, context and prompt), the
bytes of the profile's kernel table and host figures (a re-measured or re-derived table
prices ops differently under the same name), and a code version: the source of the packages
the recording runs through (`dbo`, `workspace`, the model and steps of `scenarios`), the torch
and Python versions and `FORMAT`. Any edit to that code is a new key, so a stale recording is
never replayed; old entries are pruned beyond `MAX_ENTRIES`, least recently used first.

Where: `$DBO_SIM_CACHE` if set (`off` turns the disk cache off), else `~/.cache/dbo-sim`,
under `recordings/` and `replays/`. Entries are written to a temporary name and renamed, so a
reader never sees half a file and concurrent writers of one key leave one whole entry. A file
that does not load is a miss (and is removed). The files are pickles: the cache trusts its
own directory as the code trusts its own source tree.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import sys
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from dbo.sim.cluster_program import StreamProgram
from dbo.sim.routing import Placement, Routing
from dbo.sim.tables import table_path
from scenarios.lib.cluster_step import StepSpec, record_step

__all__ = [
    "FORMAT",
    "MAX_ENTRIES",
    "cache_dir",
    "cache_key",
    "code_version",
    "load_recording",
    "load_replay",
    "recording",
    "replay_key",
    "source_hash",
    "store_recording",
    "store_replay",
    "table_hash",
]

FORMAT = 1  # bump when the stored object's meaning changes without a source change
MAX_ENTRIES = 256  # about 0.5-1 MB each
ROOT = Path(__file__).resolve().parents[2]
# What a recording runs through: a change to any of these may change the program.
SOURCES = (
    "dbo",
    "workspace",
    "scenarios/model*.py",
    "scenarios/steps.py",
    "scenarios/lib/cluster_step.py",
    "scenarios/tools/plan_cache.py",
    "scenarios/tools/plan_pool.py",  # what a replay keeps
)


def cache_dir() -> Path | None:
    """The recordings' directory (created on first store); None when the cache is off."""
    env = os.environ.get("DBO_SIM_CACHE")
    if env is not None and env.strip().lower() == "off":
        return None
    base = Path(env).expanduser() if env else Path.home() / ".cache" / "dbo-sim"
    return base / "recordings"


def source_hash(root: Path, sources: tuple[str, ...]) -> str:
    """A hash of the Python files `sources` name under `root` (folders, files, globs)."""
    h = hashlib.sha256()
    for pattern in sources:
        found = [root / pattern] if (root / pattern).is_file() else sorted(root.glob(pattern))
        files = [f for p in found for f in (sorted(p.rglob("*.py")) if p.is_dir() else [p])]
        for f in files:
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


@functools.cache
def code_version() -> str:
    """The recording code's version: its source, the torch and Python versions, FORMAT (once
    per process: the code a process runs does not change under it)."""
    runtime = f"{FORMAT}|{torch.__version__}|{sys.version_info[:2]}"
    return hashlib.sha256(f"{runtime}|{source_hash(ROOT, SOURCES)}".encode()).hexdigest()


def table_hash(kernel_table: str | None) -> str:
    """A hash of a kernel table's bytes and its host figures' (read each time: a table
    re-measured under the same name must not match its old recordings)."""
    if kernel_table is None:
        return "roofline"
    path = Path(kernel_table)
    if path.suffix != ".csv":
        path = table_path(kernel_table)
    h = hashlib.sha256()
    for f in (path, path.with_name(f"{path.stem}-host.json")):
        if f.is_file():
            h.update(f.read_bytes())
    return h.hexdigest()


def cache_key(spec: StepSpec) -> str:
    """The file name of `spec`'s recording: its fields, its kernel table's bytes, the code."""
    text = f"{spec!r}|{table_hash(spec.profile.kernel_table)}|{code_version()}"
    return hashlib.sha256(text.encode()).hexdigest()[:40]


def load_recording(spec: StepSpec) -> StreamProgram | None:
    """The stored recording of `spec`, or None (cache off, no entry, or an unreadable one)."""
    folder = cache_dir()
    if folder is None:
        return None
    return _load(folder / f"{cache_key(spec)}.pkl", StreamProgram)


def store_recording(spec: StepSpec, program: StreamProgram) -> Path | None:
    """Write `spec`'s recording (atomically) and prune the oldest beyond MAX_ENTRIES."""
    folder = cache_dir()
    return None if folder is None else _store(folder, cache_key(spec), program)


def replay_key(spec: StepSpec, routing: Routing, placement: Placement) -> str:
    """The file name of `spec`'s replay for one EP group: the recording's key and every field
    of the routing and the placement (their arrays' bytes included)."""
    group = [getattr(x, f.name) for x in (routing, placement) for f in fields(x)]
    text = cache_key(spec).encode() + pickle.dumps(group, protocol=pickle.HIGHEST_PROTOCOL)
    return hashlib.sha256(text).hexdigest()[:40]


def load_replay(spec: StepSpec, routing: Routing, placement: Placement) -> tuple | None:
    """What `plan` kept of `spec`'s replay for that group (a tuple), or None."""
    folder = cache_dir()
    if folder is None:
        return None
    return _load(folder.parent / "replays" / f"{replay_key(spec, routing, placement)}.pkl", tuple)


def store_replay(spec: StepSpec, routing: Routing, placement: Placement, kept: tuple) -> None:
    """Keep what `plan` needs of a replay (a few numbers), beside the recordings."""
    folder = cache_dir()
    if folder is not None:
        _store(folder.parent / "replays", replay_key(spec, routing, placement), kept)


def _load(path: Path, kind: type) -> Any:
    try:
        with open(path, "rb") as f:
            value = pickle.load(f)
    except FileNotFoundError:
        return None
    except Exception:  # a truncated or foreign file: a miss, and out of the way
        path.unlink(missing_ok=True)
        return None
    if not isinstance(value, kind):
        path.unlink(missing_ok=True)
        return None
    try:
        os.utime(path)  # recently used: pruned last
    except OSError:  # pruned by another process meanwhile: the value is read already
        pass
    return value


def _store(folder: Path, key: str, value: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{key}.pkl"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".part")  # not *.pkl
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _prune(folder)
    return path


def _prune(folder: Path) -> None:
    """Drop the least recently used entries beyond MAX_ENTRIES (another process may be
    pruning too: a file gone meanwhile is not an error)."""
    aged = []
    for entry in folder.glob("*.pkl"):
        try:
            aged.append((entry.stat().st_mtime, entry))
        except OSError:
            continue
    for _, stale in sorted(aged, reverse=True)[MAX_ENTRIES:]:
        stale.unlink(missing_ok=True)


@functools.lru_cache(maxsize=64)
def recording(spec: StepSpec) -> StreamProgram:
    """`spec`'s recording: from this process's memory, else the disk, else recorded through
    torch interception (and stored)."""
    program = load_recording(spec)
    if program is None:
        program = record_step.__wrapped__(spec)  # this cache stands in for record_step's
        store_recording(spec, program)
    return program
