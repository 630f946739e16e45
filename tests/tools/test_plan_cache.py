"""`plan`'s recordings and replays on disk: stored and found by configuration (a replay also
by its routing and placement), invalidated by the kernel table's bytes and the code's source,
a bad file a miss, and off when asked."""

from __future__ import annotations

import shutil
from dataclasses import replace

import numpy as np
import pytest

from dbo.sim.hardware import H800
from dbo.sim.routing import balanced, contiguous, zipf
from dbo.sim.tables import table_path
from scenarios.lib.cluster_step import StepSpec
from scenarios.model_presets import preset
from scenarios.tools import plan_cache
from scenarios.tools.plan_cache import (
    cache_key,
    load_recording,
    load_replay,
    recording,
    replay_key,
    source_hash,
    store_recording,
    store_replay,
)

SMALL = preset("deepseek-v3", num_layers=4, num_dense_layers=1, ep_size=8)
SPEC = StepSpec(SMALL, "decode", 16, None, H800)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DBO_SIM_CACHE", str(tmp_path))
    recording.cache_clear()
    yield tmp_path / "recordings"
    recording.cache_clear()


@pytest.mark.timeout(120)
def test_a_recording_is_stored_and_read_back_whole(cache):
    program = recording(SPEC)
    assert len(list(cache.glob("*.pkl"))) == 1
    stored = load_recording(SPEC)
    assert stored.num_ops == program.num_ops
    assert np.array_equal(stored.end0, program.end0)


def test_a_replays_figures_are_read_back_for_its_group_only(cache):
    even, skewed = balanced(3, 256, 8), zipf(3, 256, 0.4, top_k=8)
    place = contiguous(256, 8)
    store_replay(SPEC, even, place, (812.5, 3, 0.0, 41.25))
    assert load_replay(SPEC, even, place) == (812.5, 3, 0.0, 41.25)
    assert load_replay(SPEC, skewed, place) is None
    assert load_replay(replace(SPEC, tokens=32), even, place) is None


def test_a_routings_shares_are_in_the_replay_key():
    place = contiguous(256, 8)
    one, other = zipf(3, 256, 0.4, top_k=8, seed=0), zipf(3, 256, 0.4, top_k=8, seed=1)
    assert replay_key(SPEC, one, place) != replay_key(SPEC, other, place)
    assert replay_key(SPEC, one, place) == replay_key(SPEC, zipf(3, 256, 0.4, top_k=8), place)


def test_every_field_of_the_configuration_is_in_the_key():
    assert cache_key(SPEC) != cache_key(replace(SPEC, tokens=32))
    assert cache_key(SPEC) != cache_key(replace(SPEC, num_ubatches=2))
    assert cache_key(SPEC) != cache_key(replace(SPEC, profile=replace(H800, launch_us=1.0)))


def test_a_kernel_table_changed_under_the_same_name_is_a_new_key(tmp_path):
    table = tmp_path / "mine.csv"
    shutil.copy(table_path("h800"), table)
    spec = replace(SPEC, profile=replace(H800, kernel_table=str(table)))
    before = cache_key(spec)
    table.write_text(table.read_text() + "\n")
    assert cache_key(spec) != before


def test_a_source_edit_is_a_new_code_version(tmp_path):
    (tmp_path / "pkg").mkdir()
    module = tmp_path / "pkg" / "step.py"
    module.write_text("X = 1\n")
    before = source_hash(tmp_path, ("pkg",))
    module.write_text("X = 2\n")
    assert source_hash(tmp_path, ("pkg",)) != before


def test_the_code_version_covers_the_recording_code():
    sources = [p for p in plan_cache.SOURCES if (plan_cache.ROOT / p).exists()]
    assert "dbo" in sources and "scenarios/lib/cluster_step.py" in sources


@pytest.mark.timeout(120)
def test_an_unreadable_entry_is_a_miss_and_is_removed(cache):
    store_recording(SPEC, recording(SPEC))
    (entry,) = cache.glob("*.pkl")
    entry.write_bytes(b"not a pickle")
    assert load_recording(SPEC) is None and not entry.exists()


@pytest.mark.timeout(120)
def test_off_stores_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("DBO_SIM_CACHE", "off")
    monkeypatch.setenv("HOME", str(tmp_path))
    recording.cache_clear()
    try:
        recording(SPEC)
    finally:
        recording.cache_clear()
    assert plan_cache.cache_dir() is None and not any(tmp_path.rglob("*.pkl"))


def test_the_oldest_entries_go_beyond_the_bound(cache, monkeypatch):
    monkeypatch.setattr(plan_cache, "MAX_ENTRIES", 2)
    blank = plan_cache.StreamProgram.__new__(plan_cache.StreamProgram)
    for tokens in (16, 32, 64):
        store_recording(replace(SPEC, tokens=tokens), blank)
    assert len(list(cache.glob("*.pkl"))) == 2
    assert (cache / f"{cache_key(replace(SPEC, tokens=64))}.pkl").exists()
