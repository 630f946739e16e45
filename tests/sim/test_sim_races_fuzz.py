"""Race checker against a brute-force oracle on random stream programs.

Each program issues reads and writes of random views (contiguous, strided, matrix blocks,
through a second storage over the same memory) on three streams, mixed with event record and
wait, stream / event / device synchronize and event polling. The oracle keeps the program as
a graph (stream order, event waits, host syncs as edges) and the exact set of bytes each op
touches; an op races when an earlier op that is not its ancestor in the graph touches one of
its bytes and one of the two writes. After every op the checker must have reported a race
exactly when the oracle says that op races.
"""

from __future__ import annotations

import random

import torch

from dbo.sim import SimDevice
from dbo.sim.options import SimOptions

SEED = 12
PROGRAMS = 150
STEPS = 14
N = 64  # float32 elements in the buffer


def _views(rng: random.Random) -> tuple[str, callable]:
    kind = rng.choice(["slice", "strided", "rows", "cols", "block"])
    if kind == "slice":
        a = rng.randrange(N)
        b = rng.randrange(a + 1, N + 1)
        return f"[{a}:{b}]", lambda t: t[a:b]
    if kind == "strided":
        a, k = rng.randrange(8), rng.randrange(2, 6)
        return f"[{a}::{k}]", lambda t: t[a::k]
    if kind == "rows":
        r0 = rng.randrange(8)
        r1 = rng.randrange(r0 + 1, 9)
        return f"rows {r0}:{r1}", lambda t: t.view(8, 8)[r0:r1]
    if kind == "cols":
        c0 = rng.randrange(8)
        c1 = rng.randrange(c0 + 1, 9)
        return f"cols {c0}:{c1}", lambda t: t.view(8, 8)[:, c0:c1]
    r, c = rng.randrange(0, 8, 2), rng.randrange(0, 8, 2)
    return f"block {r},{c}", lambda t: t.view(8, 8)[r : r + 2, c : c + 3].t()


class Oracle:
    def __init__(self) -> None:
        self.parents: list[set[int]] = []  # node -> direct predecessors
        self.touch: list[tuple[frozenset[int], bool] | None] = []
        self.last: dict[int, int] = {}  # stream -> last node
        self.host: int | None = None  # latest host-sync node

    def _node(self, stream: int | None, preds: set[int], touch) -> int:
        n = len(self.parents)
        if stream is not None and stream in self.last:
            preds.add(self.last[stream])
        if self.host is not None:
            preds.add(self.host)
        self.parents.append(preds)
        self.touch.append(touch)
        if stream is not None:
            self.last[stream] = n
        return n

    def _ancestors(self, n: int) -> set[int]:
        seen, todo = set(), [n]
        while todo:
            for p in self.parents[todo.pop()]:
                if p not in seen:
                    seen.add(p)
                    todo.append(p)
        return seen

    def op(self, stream: int, elems: frozenset[int], write: bool) -> bool:
        n = self._node(stream, set(), (elems, write))
        before = self._ancestors(n)
        for i in range(n):
            t = self.touch[i]
            if t is None or i in before:
                continue
            if (write or t[1]) and elems & t[0]:
                return True
        return False

    def marker(self, stream: int) -> int | None:
        return self.last.get(stream)

    def wait(self, stream: int, marker: int | None) -> None:
        if marker is not None:
            self._node(stream, {marker}, None)

    def host_sync(self, markers: list[int | None]) -> None:
        self.host = self._node(None, {m for m in markers if m is not None}, None)


def _run_program(rng: random.Random) -> list[str]:
    """Mismatches between checker and oracle, one line each (empty when they agree)."""
    d = SimDevice(SimOptions("h200"))
    streams = [d.Stream(f"s{i}") for i in range(3)]
    buf = torch.zeros(N)
    alias = torch.from_dlpack(buf)  # a second storage over the same bytes
    index = torch.arange(N)
    oracle = Oracle()
    events: list[tuple[object, int | None]] = []
    log: list[str] = []
    mismatches: list[str] = []
    with d.thread_scope(0):
        for step in range(STEPS):
            roll = rng.random()
            s = rng.randrange(3)
            if roll < 0.6:
                what, view = _views(rng)
                write = rng.random() < 0.5
                target = alias if rng.random() < 0.3 else buf
                with d.suspended():  # bookkeeping: no host read of the device
                    elems = frozenset(view(index).flatten().tolist())
                d.set_stream(streams[s])
                before = len(d.races)
                if write:
                    view(target).fill_(float(step))
                else:
                    view(target).sum()
                got = len(d.races) > before
                want = oracle.op(s, elems, write)
                log.append(f"s{s} {'write' if write else 'read'} {what}")
                if got != want:
                    mismatches.append(f"step {step}: checker {got}, oracle {want}: {log}")
            elif roll < 0.75:
                events.append((streams[s].record_event(), oracle.marker(s)))
                log.append(f"record e{len(events) - 1} on s{s}")
            elif roll < 0.9 and events:
                k = rng.randrange(len(events))
                streams[s].wait_event(events[k][0])
                oracle.wait(s, events[k][1])
                log.append(f"s{s} waits e{k}")
            elif roll < 0.95 and events:
                k = rng.randrange(len(events))
                event = events[k][0]
                if rng.random() < 0.5:
                    event.synchronize()
                else:
                    while not event.query():
                        pass
                oracle.host_sync([events[k][1]])
                log.append(f"host syncs e{k}")
            elif roll < 0.98:
                streams[s].synchronize()
                oracle.host_sync([oracle.marker(s)])
                log.append(f"host syncs s{s}")
            else:
                d.synchronize()
                oracle.host_sync([oracle.marker(i) for i in range(3)])
                log.append("device sync")
    return mismatches


def test_checker_agrees_with_the_oracle_on_random_programs() -> None:
    rng = random.Random(SEED)
    print(f"race fuzz: seed {SEED}, {PROGRAMS} programs of {STEPS} steps")
    mismatches = [m for _ in range(PROGRAMS) for m in _run_program(rng)]
    assert mismatches == [], mismatches[:3]
