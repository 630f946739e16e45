"""Recordings kept on disk between `plan` runs: one rank's stream program per configuration.

One job: find, store and invalidate the pickled `StreamProgram` of a `StepSpec`. Recording a
step through torch interception costs seconds; replaying it for a whole EP group costs a
fraction of that, so a second `plan` over the same points only replays.

The key is a hash of everything the recording depends on: the spec (model configuration,
phase, tokens, ubatches, the whole hardware profile, GPUs per node, context and prompt), the
bytes of the profile's kernel table and host figures (a re-measured or re-derived table
prices ops differently under the same name), and a code version: the source of the packages
the recording runs through (`dbo`, `workspace`, the model and steps of `scenarios`), the torch
and Python versions and `FORMAT`. Any edit to that code is a new key, so a stale recording is
never replayed; old entries are pruned beyond `MAX_ENTRIES`, least recently used first.

Where: `$DBO_SIM_CACHE` if set (`off` turns the disk cache off), else `~/.cache/dbo-sim`,
under `recordings/`. Entries are written to a temporary name and renamed, so a reader never
sees half a file and concurrent writers of one key leave one whole entry. A file that does not
load is a miss (and is removed). The files are pickles: the cache trusts its own directory as
the code trusts its own source tree.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import sys
import tempfile
from pathlib import Path

import torch

from dbo.sim.cluster_program import StreamProgram
from dbo.sim.tables import table_path
from scenarios.lib.cluster_step import StepSpec, record_step

__all__ = [
    "FORMAT",
    "MAX_ENTRIES",
    "cache_dir",
    "cache_key",
    "code_version",
    "load_recording",
    "recording",
    "source_hash",
    "store_recording",
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
    path = folder / f"{cache_key(spec)}.pkl"
    try:
        with open(path, "rb") as f:
            program = pickle.load(f)
    except FileNotFoundError:
        return None
    except Exception:  # a truncated or foreign file: a miss, and out of the way
        path.unlink(missing_ok=True)
        return None
    if not isinstance(program, StreamProgram):
        path.unlink(missing_ok=True)
        return None
    try:
        os.utime(path)  # recently used: pruned last
    except OSError:  # pruned by another process meanwhile: the program is read already
        pass
    return program


def store_recording(spec: StepSpec, program: StreamProgram) -> Path | None:
    """Write `spec`'s recording (atomically) and prune the oldest beyond MAX_ENTRIES."""
    folder = cache_dir()
    if folder is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{cache_key(spec)}.pkl"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".part")  # not *.pkl
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(program, f, protocol=pickle.HIGHEST_PROTOCOL)
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
