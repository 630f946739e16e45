"""Across processes: real EP all-to-all over gloo, DP agreement, and failures that end promptly.

Two groups are started (2 and 4 ranks on 127.0.0.1, the test process hosting the TCPStore on a
port the OS picks); each worker runs every check of its group in order and writes its results,
so process start-up is paid once per group. The workers are this file run as a script. Then the
CLI: `--ranks 2` end to end, a torchrun-style launch (env vars only), and bad launches.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import dbo
from dbo.sim.options import SimOptions
from dbo.split import split_batch
from scenarios.cli import main
from scenarios.harness import RunOptions
from scenarios.ranks import group, halves
from scenarios.ranks import launch as distributed
from scenarios.ranks.step import rank_device

# Multi-process or long-running: `make test-slow` (and CI) runs these.
pytestmark = pytest.mark.slow

REPO = Path(dbo.__file__).resolve().parent.parent

E, K, H = 8, 2, 16


# --------------------------------------------------------------------------------------------
# What the workers run (imported by them from this file)


def _rank_inputs(rank: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank r's tokens and routing; every rank can rebuild every rank's (seeded by rank)."""
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens, H, generator=gen, dtype=torch.float64)
    weights, ids = (
        torch.randn(tokens, E, generator=gen, dtype=torch.float64).softmax(-1).topk(K, dim=-1)
    )
    return x, ids, weights


def _expert_weights() -> torch.Tensor:
    return torch.randn(E, H, H, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def _dense(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    return (weights.unsqueeze(-1) * torch.einsum("th,tkhd->tkd", x, w[ids])).sum(1)


def _comm_round_trip(ep: Any, rank: int, tokens_of: Callable[[int], int]) -> dict[str, Any]:
    """Dispatch/combine over `ep` in both modes against the dense reference, and what arrived."""
    from dbo.sim import SimDevice

    x, ids, weights = _rank_inputs(rank, tokens_of(rank))
    w = _expert_weights()
    results: dict[str, Any] = {}
    outs = {}
    for mode in ("ht", "ll"):
        device = SimDevice(SimOptions(rank=rank))
        with dbo.use_device(device), device.thread_scope(None):
            plan = ep.prepare(ids, weights, dtype=x.dtype, mode=mode)
            sent = ep.dispatch(x, ids, weights, plan=plan, mode=mode)
            expert_out = torch.bmm(sent.recv_x.unsqueeze(1), w[sent.recv_expert_ids]).squeeze(1)
            outs[mode] = ep.combine(expert_out, sent.handle, mode=mode)
        ids_here = sent.recv_expert_ids.tolist()
        results[f"{mode} equals dense"] = torch.allclose(
            outs[mode], _dense(x, ids, weights, w), rtol=0, atol=1e-12
        )
        results[f"{mode} rows only for local experts"] = all(
            e in ep.local_experts for e in ids_here
        )
        results[f"{mode} expert-major"] = ids_here == sorted(ids_here)
        # What every member routes to this rank's experts, rebuilt from their seeds.
        expected = sorted(
            (e, round(float(xr.sum()), 9))
            for g in ep.global_ranks
            for xr, row in zip(
                _rank_inputs(g, tokens_of(g))[0], _rank_inputs(g, tokens_of(g))[1].tolist()
            )
            for e in row
            if e in ep.local_experts
        )
        got = sorted((e, round(float(r.sum()), 9)) for e, r in zip(ids_here, sent.recv_x))
        results[f"{mode} received exactly the rows routed here"] = got == expected
        results[f"{mode} comm ops"] = [
            r.name for r in device.timeline if r.kind == "comm" and not r.name.endswith(".send")
        ]
    results["ht and ll identical"] = torch.equal(outs["ht"], outs["ll"])
    return results


def _attempt(fn: Callable[[], Any]) -> tuple[str, Any, float]:
    """('ok', value, seconds) or ('error', (type name, message, cause type name), seconds)."""
    start = time.monotonic()
    try:
        value = fn()
        return "ok", value, time.monotonic() - start
    except Exception as error:  # noqa: BLE001 - the parent checks type and message
        cause = error.__cause__
        return (
            "error",
            (type(error).__name__, str(error), type(cause).__name__ if cause else None),
            time.monotonic() - start,
        )


def _worker_two(env: Any, opts: RunOptions) -> dict[str, Any]:
    import torch.distributed as dist

    from dbo.comm import EPGroup, use_ep_group
    from scenarios.model import Batch, MoEModel, preset
    from scenarios.ranks.step import run_rank_step
    from scenarios.registry import SCENARIOS

    rank = env.rank
    out: dict[str, Any] = {}
    # Made first, while every rank is healthy: the failure checks at the end each break one.
    fail_group = dist.new_group([0, 1])
    hang_group = dist.new_group([0, 1])
    kind_group = dist.new_group([0, 1])
    # Rank 1 is refused by this group; the EP groups both ranks build later must still agree on
    # their abort keys (a process-wide count once went out of step here).
    only_rank_0 = dist.new_group([0])
    out["group without this rank"] = _attempt(lambda: EPGroup(only_rank_0, num_experts=E).ep_size)

    ep = EPGroup(env.group, num_experts=E, store=env.store, timeout_s=30)
    out["comm"] = _comm_round_trip(ep, rank, lambda r: 13 + 5 * r)
    out["moe-prefill-ht"] = SCENARIOS["moe-prefill-ht"].rank(env, opts)
    out["moe-decode-ll"] = SCENARIOS["moe-decode-ll"].rank(env, opts)
    out["dp-disagreement"] = SCENARIOS["dp-disagreement"].rank(env, opts)
    out["ep_size 3 of 2"] = _attempt(lambda: EPGroup(env.group, num_experts=6, ep_size=3))

    # Bad routing on rank 1: every rank raises, and the group still works afterwards.
    x, ids, weights = _rank_inputs(rank, 9)
    if rank == 1:
        ids = ids.clone()
        ids[4, 0] = E + 3
    out["bad routing"] = _attempt(lambda: ep.prepare(ids, weights))
    out["after bad routing"] = _comm_round_trip(ep, rank, lambda r: 4 + r)["ht equals dense"]

    # A rank that raises mid-step: rank 1's expert kernel fails in layer 1 under DBO; rank 0 is
    # then waiting in a collective and must end with the peer's failure, promptly.
    class FailingModel(MoEModel):
        calls = 0

        def _experts(self, *args: Any, **kwargs: Any) -> None:
            FailingModel.calls += 1
            if rank == 1 and FailingModel.calls == 3:
                raise RuntimeError("expert kernel failed on rank 1")
            super()._experts(*args, **kwargs)

    config = preset("tiny", ep_size=2)
    batch = Batch(query_start_loc=(0, 30, 64), context_lens=(0, 0))
    model = FailingModel(config, batch)
    failing_ep = EPGroup(fail_group, num_experts=E, store=env.store, timeout_s=30)
    slices = split_batch(batch.query_start_loc, batch.num_tokens, 2)

    def failing_step() -> None:
        with use_ep_group(failing_ep):
            run_rank_step(
                model,
                model.inputs(),
                device=rank_device(env, opts),
                ep=failing_ep,
                slices=slices,
                mode="ht",
                timeout_s=30,
            )

    # Two same-shape exchanges that mean different things on each rank: the run's tracker
    # (dbo.fingerprint, installed when the rank joined) names both kinds on both ranks.
    def swapped_kinds() -> None:
        with dbo.collective_kind("dispatch" if rank == 0 else "combine"):
            dist.all_reduce(torch.ones(2), group=kind_group)

    out["kinds out of step"] = _attempt(swapped_kinds)
    out["raising rank"] = _attempt(failing_step)
    out["after the failure"] = _attempt(lambda: failing_ep.begin_step(1))

    # No store and a peer that never issues the collective: the wait ends at timeout_s.
    if rank == 0:
        lonely = EPGroup(hang_group, num_experts=E, timeout_s=1.0)
        out["peer never comes"] = _attempt(lambda: lonely.begin_step(1))
    else:
        time.sleep(2.5)  # stay alive (a dead peer would end the wait sooner, by a socket error)
    return out


def _worker_four(env: Any, opts: RunOptions) -> dict[str, Any]:
    from dbo.comm import EPGroup
    from scenarios.registry import SCENARIOS

    out: dict[str, Any] = {}
    out["moe-prefill-ht"] = SCENARIOS["moe-prefill-ht"].rank(env, opts)
    out["dp-disagreement"] = SCENARIOS["dp-disagreement"].rank(env, opts)
    # DP 2 x EP 2: ranks {0, 1} and {2, 3} each form an EP group of their own.
    ep = EPGroup(env.group, num_experts=E, ep_size=2, store=env.store, timeout_s=30)
    out["ep2 members"] = ep.global_ranks
    out["ep2 local experts"] = list(ep.local_experts)
    out["ep2 comm"] = _comm_round_trip(ep, env.rank, lambda r: 6 + 3 * r)
    out["ep_size 3 of 4"] = _attempt(lambda: EPGroup(env.group, num_experts=6, ep_size=3))
    return out


WORKERS = {"two": _worker_two, "four": _worker_four}


def _worker_main(which: str, out_path: str) -> None:
    opts = RunOptions(timeout_s=30.0)
    env = distributed.init_rank(opts)
    results = WORKERS[which](env, opts)
    with open(out_path + ".tmp", "wb") as f:
        pickle.dump(results, f)
    os.replace(out_path + ".tmp", out_path)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a broken group's half-done collective must not hold up the exit


# --------------------------------------------------------------------------------------------
# Starting a group


def _base_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    if Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"
    for name in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_USE_AGENT_STORE",
    ):
        env.pop(name, None)
    return env


def _start(
    argv_of: Callable[[int], list[str]], world: int, workdir: Path, *, deadline_s: float
) -> tuple[list[int], list[str]]:
    """Start `world` processes (rank r runs argv_of(r)) round a store this process hosts, wait
    with a deadline, kill leftovers; returns exit codes and outputs."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs, logs = [], []
    try:
        for rank in range(world):
            log = workdir / f"rank{rank}.log"
            logs.append(log)
            env = {
                **_base_env(),
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(store.port),
                group.HOSTED_ENV: "1",
            }
            with open(log, "wb") as f:
                procs.append(
                    subprocess.Popen(
                        argv_of(rank),
                        env=env,
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        cwd=REPO,
                    )
                )
        end = time.monotonic() + deadline_s
        for p in procs:
            p.wait(timeout=max(0.1, end - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{world} ranks did not finish in {deadline_s} s:\n" + _outputs(logs))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], [log.read_text(errors="replace") for log in logs]


def _outputs(logs: list[Path]) -> str:
    return "\n".join(
        f"--- {log.name} ---\n{log.read_text(errors='replace')[-3000:]}"
        for log in logs
        if log.exists()
    )


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def group_results(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str, int], list[dict[str, Any]]]:
    cache: dict[str, list[dict[str, Any]]] = {}

    def get(which: str, world: int) -> list[dict[str, Any]]:
        if which not in cache:
            workdir = tmp_path_factory.mktemp(which)
            outs = [workdir / f"rank{r}.pkl" for r in range(world)]
            codes, logs = _start(
                lambda r: [sys.executable, __file__, which, str(outs[r])],
                world,
                workdir,
                deadline_s=100,
            )
            if any(codes):
                pytest.fail(f"ranks exited with {codes}:\n" + "\n".join(logs))
            cache[which] = [pickle.loads(o.read_bytes()) for o in outs]
        return cache[which]

    return get


# --------------------------------------------------------------------------------------------
# Two ranks


@pytest.mark.timeout(120)
def test_two_ranks_dispatch_and_combine_equal_the_dense_reference(group_results):
    for rank, results in enumerate(group_results("two", 2)):
        comm = results["comm"]
        for key, value in comm.items():
            if key.endswith("comm ops"):
                assert value == ["comm::dispatch_counts", "comm::dispatch", "comm::combine"], (
                    rank,
                    key,
                )
            else:
                assert value is True, (rank, key)


@pytest.mark.timeout(120)
def test_two_ranks_moe_steps_equal_the_single_process_run_with_agreed_padding(group_results):
    results = group_results("two", 2)
    for name in ("moe-prefill-ht", "moe-decode-ll"):
        outcomes = [r[name] for r in results]
        assert all(o.passed for o in outcomes), [o.error for o in outcomes]
        assert all(o.outputs_match and o.max_abs_diff <= 1e-9 for o in outcomes)
        assert all(o.dbo_records and {r.rank for r in o.dbo_records} == {o.rank} for o in outcomes)
        # Rank 1 has fewer tokens; both cut at the largest padded count.
        padded = {o.details["num_tokens_padded"] for o in outcomes}
        assert (
            padded == {outcomes[0].details["tokens"]}
            and outcomes[1].details["tokens"] < outcomes[0].details["tokens"]
        )
        half = outcomes[0].details["tokens"] // 2
        assert [o.details["ubatch_tokens"][0] for o in outcomes] == [half, half]
    merged = distributed.merge_outcomes(
        "moe-prefill-ht", [r["moe-prefill-ht"] for r in results], RunOptions()
    )
    assert merged.passed and merged.details["ranks"] == 2
    per_rank = [o["step_us_dbo"] for o in merged.details["per_rank"]]
    assert merged.step_us_dbo == pytest.approx(max(per_rank))


@pytest.mark.timeout(120)
def test_two_ranks_disagreement_is_caught_on_every_rank(group_results):
    outcomes = [r["dp-disagreement"] for r in group_results("two", 2)]
    assert all(o.passed for o in outcomes), [o.error for o in outcomes]
    assert [o.details["ubatches_alone"] for o in outcomes] == [2, 1]
    for o in outcomes:
        assert "rank 0: 2 ubatches, rank 1: 1 ubatch" in o.details["caught"]
        assert o.details["seconds_to_stop"] < 5


@pytest.mark.timeout(120)
def test_two_ranks_bad_input_is_an_error_on_every_rank(group_results):
    r0, r1 = group_results("two", 2)
    for results in (r0, r1):
        status, (kind, message, _), _ = results["ep_size 3 of 2"]
        assert (
            status == "error"
            and kind == "ValueError"
            and "must divide the process group's size (2)" in message
        )
        assert results["after bad routing"] is True
    assert r0["group without this rank"][:2] == ("ok", 1)
    status, (kind, message, _), _ = r1["group without this rank"]
    assert (
        status == "error"
        and kind == "ValueError"
        and "not a member of the given process group" in message
    )
    assert r1["bad routing"][0] == "error" and "outside [0, 8) on rank 1" in r1["bad routing"][1][1]
    assert (
        r0["bad routing"][0] == "error"
        and "EP rank(s) [1] routed tokens to expert ids outside" in r0["bad routing"][1][1]
    )


@pytest.mark.timeout(120)
def test_a_raising_rank_ends_the_step_on_every_rank_promptly(group_results):
    r0, r1 = group_results("two", 2)
    status, (kind, message, cause), seconds = r1["raising rank"]
    assert (
        status == "error"
        and kind == "UBatchError"
        and cause == "RuntimeError"
        and "expert kernel failed" in message
    )
    status, (kind, message, cause), seconds = r0["raising rank"]
    assert status == "error" and kind == "UBatchError" and cause == "EPPeerFailedError", message
    assert "EP rank 1 failed" in message and "expert kernel failed on rank 1" in message
    assert seconds < 5
    for results in (r0, r1):
        status, (kind, message, _), _ = results["after the failure"]
        assert status == "error" and kind == "EPError" and "re-create the process group" in message


@pytest.mark.timeout(120)
def test_a_scenario_runs_collectives_are_fingerprinted_across_ranks(group_results):
    for results in group_results("two", 2):
        status, (kind, message, _), _ = results["kinds out of step"]
        assert status == "error" and kind == "CollectiveMismatchError"
        assert "rank 0 calls all_reduce ('dispatch') where rank 1 calls all_reduce ('combine')" in (
            message
        )


@pytest.mark.timeout(120)
def test_without_a_store_a_missing_peer_ends_at_the_collective_timeout(group_results):
    status, (kind, message, _), seconds = group_results("two", 2)[0]["peer never comes"]
    assert status == "error" and kind == "EPTimeoutError" and "step 1's handshake" in message
    assert 0.9 < seconds < 5


# --------------------------------------------------------------------------------------------
# Four ranks


@pytest.mark.timeout(120)
def test_four_ranks_moe_prefill_and_disagreement(group_results):
    results = group_results("four", 4)
    outcomes = [r["moe-prefill-ht"] for r in results]
    assert all(o.passed for o in outcomes), [o.error for o in outcomes]
    assert len({o.details["num_tokens_padded"] for o in outcomes}) == 1
    assert len({o.details["tokens"] for o in outcomes}) == 4  # every rank padded to the max
    caught = [r["dp-disagreement"] for r in results]
    assert all(o.passed for o in caught), [o.error for o in caught]
    assert (
        "rank 0: 2 ubatches, rank 1: 1 ubatch, rank 2: 1 ubatch, rank 3: 1 ubatch"
        in caught[3].details["caught"]
    )


@pytest.mark.timeout(120)
def test_four_ranks_as_two_ep_groups_of_two(group_results):
    results = group_results("four", 4)
    assert [r["ep2 members"] for r in results] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [r["ep2 local experts"] for r in results] == [[0, 1, 2, 3], [4, 5, 6, 7]] * 2
    for rank, r in enumerate(results):
        assert all(v is True for k, v in r["ep2 comm"].items() if not k.endswith("comm ops")), (
            rank,
            r["ep2 comm"],
        )
        status, (kind, message, _), _ = r["ep_size 3 of 4"]
        assert status == "error" and kind == "ValueError" and "ep_size (3) must divide" in message


# --------------------------------------------------------------------------------------------
# The CLI across ranks


@pytest.mark.timeout(120)
def test_cli_ranks_runs_each_scenario_on_every_rank_and_merges_one_trace(capsys, tmp_path):
    code = main(
        [
            "run",
            "--ranks",
            "2",
            "--json",
            "--out",
            str(tmp_path),
            "moe-prefill-ht",
            "dp-disagreement",
        ]
    )
    reports = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert code == 0, reports
    assert [r["scenario"] for r in reports] == ["moe-prefill-ht", "dp-disagreement"]
    assert all(r["passed"] for r in reports) and reports[1]["negative"] is True
    prefill = reports[0]
    assert prefill["details"]["ranks"] == 2 and prefill["outputs_match"] is True
    assert prefill["step_us_dbo"] == pytest.approx(
        max(p["step_us_dbo"] for p in prefill["details"]["per_rank"])
    )
    trace = json.loads(Path(prefill["trace"]).read_text())
    processes = {
        e["args"]["name"]
        for e in trace["traceEvents"]
        if e.get("ph") == "M" and e["name"] == "process_name"
    }
    assert processes == {"rank 0", "rank 1"}
    assert Path(prefill["timeline_png"]).read_bytes().startswith(b"\x89PNG")
    # The negative scenario's trace shows the agreed step, a process per rank as well.
    trace = json.loads(Path(reports[1]["trace"]).read_text())
    processes = {
        e["args"]["name"]
        for e in trace["traceEvents"]
        if e.get("ph") == "M" and e["name"] == "process_name"
    }
    assert processes == {"rank 0", "rank 1"}


@pytest.mark.timeout(120)
def test_torchrun_launch_runs_the_scenario_on_two_ranks_and_rank_0_reports(tmp_path):
    # torchrun itself (its agent hosts the store; --standalone picks a free port).
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "scenarios",
        "run",
        "moe-prefill-ht",
        "--no-artifacts",
        "--timeout",
        "30",
    ]
    try:
        done = subprocess.run(
            argv,
            env=_base_env(),
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=100,
        )
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"torchrun did not finish in 100 s:\n{expired.stdout}\n{expired.stderr}")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert out.count("1 passed, 0 failed") == 1, out  # rank 0 reports for both ranks
    assert "moe-prefill-ht  PASS" in out


@pytest.mark.timeout(60)
def test_bad_launches_are_clear_errors(capsys, monkeypatch):
    assert main(["run", "--ranks", "2", "dcp-attention"]) == 2
    assert "dcp-attention run in one process" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["run", "--ranks", "2", "moe-prefill-ht"]) == 2
    assert "under torchrun drop it" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_a_rank_count_that_does_not_divide_the_experts_is_refused_before_any_process_starts(
    capsys, monkeypatch
):
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))
    assert main(["run", "--ranks", "3", "moe-prefill-ht"]) == 2
    err = capsys.readouterr().err
    assert "--ranks 3" in err and "must divide 8: 1, 2, 4, 8" in err
    assert started == []


@pytest.mark.timeout(60)
def test_a_torchrun_world_size_that_does_not_divide_the_experts_is_a_clear_error(
    capsys, monkeypatch
):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setattr(
        distributed, "init_rank", lambda opts: pytest.fail("joined a group it cannot use")
    )
    assert main(["run", "moe-prefill-ht", "--no-artifacts"]) == 1
    assert "WORLD_SIZE=3" in capsys.readouterr().err


def test_the_disagreement_verdict_passes_only_when_the_mismatch_is_caught_naming_every_rank():
    from dbo.comm import EPStepMismatchError, EPTimeoutError

    named = EPStepMismatchError(
        "EP ranks disagree (rank 0: 2 ubatches, rank 1: 1 ubatch)",
        ubatch_counts={0: 2, 1: 1},
        steps={0: 1, 1: 1},
    )
    assert all(halves.disagreement_checks(named, 2, 0.1, 0.0).values())
    # Not caught (a real system would hang), caught late, caught as a timeout, or unnamed ranks.
    assert not all(halves.disagreement_checks(None, 2, 0.1, 0.0).values())
    assert not all(halves.disagreement_checks(named, 2, 30.0, 0.0).values())
    assert not all(
        halves.disagreement_checks(
            EPTimeoutError("rank 0: rank 1:", what="x"), 2, 0.1, 0.0
        ).values()
    )
    assert not all(halves.disagreement_checks(named, 3, 0.1, 0.0).values())
    assert not all(halves.disagreement_checks(named, 2, 0.1, 1.0).values())


@pytest.mark.timeout(60)
def test_an_unreachable_store_and_a_group_that_never_forms_end_with_errors(monkeypatch):
    opts = RunOptions(timeout_s=1.0)
    for name in ("TORCHELASTIC_USE_AGENT_STORE", group.HOSTED_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))  # nothing listens there
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    start = time.monotonic()
    with pytest.raises(distributed.RankSetupError, match="could not reach the rendezvous store"):
        distributed.init_rank(opts)
    # Rank 0 of 2, alone: it hosts the store, but rank 1 never joins.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    with pytest.raises(
        distributed.RankSetupError, match=r"WORLD_SIZE=2 ranks did not form within 1 s"
    ):
        distributed.init_rank(opts)
    assert time.monotonic() - start < 20
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(
        distributed.RankSetupError, match=r"RANK \(2\) must be in \[0, WORLD_SIZE\)"
    ):
        distributed.init_rank(opts)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    _worker_main(sys.argv[1], sys.argv[2])
