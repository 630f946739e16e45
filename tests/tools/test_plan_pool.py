"""`plan`'s steps on a process pool: the same answers as one process, and Ctrl-C leaves no
worker behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dbo.sim.hardware import H800
from dbo.sim.routing import balanced, contiguous, zipf
from scenarios.lib.cluster_step import StepSpec
from scenarios.model_presets import preset
from scenarios.tools.plan_cache import recording
from scenarios.tools.plan_pool import StepTask, run_tasks

ROOT = Path(__file__).resolve().parents[2]
SMALL = preset("deepseek-v3", num_layers=4, num_dense_layers=1, ep_size=8)


@pytest.mark.timeout(300)
def test_the_pool_gives_the_steps_one_process_gives(tmp_path, monkeypatch):
    monkeypatch.setenv("DBO_SIM_CACHE", str(tmp_path))
    recording.cache_clear()
    groups = (
        (balanced(3, 256, 8), contiguous(256, 8)),
        (zipf(3, 256, 0.4, top_k=8), contiguous(256, 8)),
    )
    tasks = [StepTask(StepSpec(SMALL, "decode", 16, n, H800), groups) for n in (None, 2)]
    done: list[str] = []
    pooled = run_tasks(tasks, workers=2, on_done=done.append)
    recording.cache_clear()
    assert pooled == run_tasks(tasks, workers=1)
    assert sorted(done) == sorted(t.what for t in tasks)  # once each, as tasks end


def _alive_with(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "environ").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
@pytest.mark.timeout(300)
def test_ctrl_c_ends_plan_and_every_worker(tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "DBO_SIM_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    config = tmp_path / "small.json"
    config.write_text('{"num_layers": 4, "num_dense_layers": 1}')
    argv = [sys.executable, "-m", "scenarios", "plan", "--config", str(config), "--ep", "8"]
    argv += ["--phase", "decode", "--skew", "balanced", "--workers", "2"]
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not any(cache.rglob("*.pkl")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)  # the pool is at work once its first recording lands
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()[-2000:]
    assert b"Traceback" not in err
    time.sleep(0.5)
    assert _alive_with(str(cache)) == []
