"""dbo.comm in one process: dispatch/combine values against a dense reference, high-throughput
and low-latency modes alike, the comm ops the simulator places, bad input, bounded waits, and
the all-to-all path over a gloo group of one (the multi-process runs are in test_distributed).
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dbo
from dbo.comm import (
    DispatchPlan,
    EPError,
    EPGroup,
    EPPeerFailedError,
    EPTimeoutError,
    current_ep_group,
    ep_group_for,
    use_ep_group,
)
from dbo.comm.collectives import Collectives
from dbo.sim import SimDevice
from dbo.sim.options import SimOptions
from dbo.split import split_batch
from scenarios.harness import run_step
from scenarios.model import Batch, MoEModel, preset

pytestmark = pytest.mark.timeout(60)

E, K, H = 8, 2, 16


def _routing(
    tokens: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, topk ids, topk weights and per-expert weight matrices for a small MoE layer."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen, dtype=torch.float64)
    logits = torch.randn(tokens, E, generator=gen, dtype=torch.float64)
    weights, ids = logits.softmax(-1).topk(K, dim=-1)
    experts = torch.randn(E, H, H, generator=gen, dtype=torch.float64)
    return x, ids, weights, experts


def _dense(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    """Every token through every one of its top-k experts, weighted: no dispatch at all."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            out[t] += weights[t, j] * (x[t] @ experts[ids[t, j]])
    return out


def _apply_experts(
    recv_x: torch.Tensor, recv_ids: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    return torch.bmm(recv_x.unsqueeze(1), experts[recv_ids]).squeeze(1)


def _round_trip(ep: EPGroup, x, ids, weights, experts, mode: str) -> tuple[torch.Tensor, Any]:
    plan = ep.prepare(ids, weights, dtype=x.dtype, mode=mode)
    recv = torch.empty(plan.num_recv_rows, H, dtype=x.dtype)
    sent = ep.dispatch(x, ids, weights, plan=plan, out=recv, mode=mode)
    out = ep.combine(
        _apply_experts(sent.recv_x, sent.recv_expert_ids, experts), sent.handle, mode=mode
    )
    return out, sent


# --------------------------------------------------------------------------------------------
# Values in one process


@pytest.mark.parametrize("mode", ["ht", "ll"])
def test_round_trip_equals_the_dense_reference(mode):
    x, ids, weights, experts = _routing(37)
    out, sent = _round_trip(EPGroup(num_experts=E, ep_size=4), x, ids, weights, experts, mode)
    assert torch.allclose(out, _dense(x, ids, weights, experts), rtol=0, atol=1e-12)
    # The receive buffer is expert-major and each row is its token's row.
    plan = sent.handle.plan
    assert plan.num_recv_rows == 37 * K and sent.recv_x.shape == (37 * K, H)
    assert bool((sent.recv_expert_ids[1:] >= sent.recv_expert_ids[:-1]).all())
    assert torch.equal(sent.recv_x, x[plan.token_of_row])
    assert sorted(sent.recv_expert_ids.tolist()) == sorted(ids.reshape(-1).tolist())


def test_high_throughput_and_low_latency_give_identical_values_and_their_own_placement():
    x, ids, weights, experts = _routing(29, seed=3)
    outs, names = {}, {}
    for mode in ("ht", "ll"):
        device = SimDevice()
        with dbo.use_device(device), device.thread_scope(None):
            outs[mode], _ = _round_trip(
                EPGroup(num_experts=E, ep_size=8), x, ids, weights, experts, mode
            )
        names[mode] = [(r.name, r.stream) for r in device.timeline if r.kind == "comm"]
    assert torch.equal(outs["ht"], outs["ll"])
    # One comm op per transfer: ht on the issuing stream, ll as a send there plus a link transfer.
    assert names["ht"] == [("comm::dispatch", "default"), ("comm::combine", "default")]
    assert names["ll"] == [
        ("comm::dispatch.send", "default"),
        ("comm::dispatch", "link"),
        ("comm::combine.send", "default"),
        ("comm::combine", "link"),
    ]


def test_dispatch_prepares_and_allocates_when_not_given_a_plan_or_buffer():
    x, ids, weights, experts = _routing(11, seed=5)
    ep = EPGroup(num_experts=E)
    sent = ep.dispatch(x, ids, weights)
    assert isinstance(sent.handle.plan, DispatchPlan) and sent.recv_x.shape == (11 * K, H)
    out = ep.combine(_apply_experts(sent.recv_x, sent.recv_expert_ids, experts), sent.handle)
    assert torch.allclose(out, _dense(x, ids, weights, experts), rtol=0, atol=1e-12)
    assert sent.handle.dispatch_event is not None and sent.handle.combine_event is not None


def test_combine_accumulates_into_the_given_output():
    x, ids, weights, experts = _routing(9, seed=6)
    ep = EPGroup(num_experts=E, ep_size=2)
    sent = ep.dispatch(x, ids, weights)
    residual = torch.ones_like(x)
    got = ep.combine(
        _apply_experts(sent.recv_x, sent.recv_expert_ids, experts), sent.handle, out=residual
    )
    assert got is residual
    assert torch.allclose(got, 1 + _dense(x, ids, weights, experts), rtol=0, atol=1e-12)


def test_model_outputs_are_the_same_in_both_modes_serial_and_ubatched():
    batch = Batch(query_start_loc=(0, 20, 50, 64), context_lens=(0, 0, 0))
    config = preset("tiny")
    x = MoEModel(config, batch).inputs()
    outputs = {}
    for mode in ("ht", "ll"):
        for n in (None, 2):
            run = run_step(
                MoEModel(config, batch), x, device=SimDevice(), num_ubatches=n, mode=mode
            )
            assert not run.races and run.allocations_during_step == 0
            outputs[(mode, n)] = run.output
    ref = outputs[("ht", None)]
    assert all(torch.allclose(o, ref, rtol=0, atol=1e-9) for o in outputs.values())
    assert torch.equal(outputs[("ht", None)], outputs[("ll", None)])


def test_shape_only_model_still_dispatches_in_process():
    config = preset("deepseek-v3", num_layers=4)
    model = MoEModel(config, Batch.decode(64, 128))
    run = run_step(
        model,
        model.inputs(),
        device=SimDevice(SimOptions(tensor_device="meta")),
        num_ubatches=2,
        mode="ll",
    )
    assert run.output.is_meta and any(r.name == "comm::dispatch" for r in run.records)


# --------------------------------------------------------------------------------------------
# Bad input


def test_bad_group_arguments_are_refused():
    with pytest.raises(ValueError, match="divisible by ep_size"):
        EPGroup(num_experts=8, ep_size=3)
    with pytest.raises(ValueError, match="num_experts must be >= 1"):
        EPGroup(num_experts=0)
    with pytest.raises(TypeError, match="ep_size must be an integer"):
        EPGroup(num_experts=8, ep_size=True)
    with pytest.raises(ValueError, match="timeout_s"):
        EPGroup(num_experts=8, timeout_s=0)
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            EPGroup(object(), num_experts=8)


def test_bad_routing_and_buffers_are_refused_naming_the_argument():
    x, ids, weights, _ = _routing(6)
    ep = EPGroup(num_experts=E, ep_size=2)
    with pytest.raises(TypeError, match="topk_ids must hold integer"):
        ep.prepare(ids.double(), weights)
    with pytest.raises(ValueError, match="topk_weights must have"):
        ep.prepare(ids, weights[:, :1])
    with pytest.raises(ValueError, match="topk_ids must be 2-D"):
        ep.prepare(ids.reshape(-1), weights.reshape(-1))
    with pytest.raises(ValueError, match="mode must be one of"):
        ep.prepare(ids, weights, mode="fast")
    plan = ep.prepare(ids, weights)
    with pytest.raises(ValueError, match="out must have 12 rows"):
        ep.dispatch(x, ids, weights, plan=plan, out=torch.empty(5, H, dtype=x.dtype))
    with pytest.raises(TypeError, match="out must have x's dtype"):
        ep.dispatch(x, ids, weights, plan=plan, out=torch.empty(12, H, dtype=torch.float32))
    with pytest.raises(ValueError, match="x must have 6 rows"):
        ep.dispatch(x[:4], ids, weights, plan=plan)
    with pytest.raises(ValueError, match="prepared for"):
        ep.dispatch(x, ids[:3], weights[:3], plan=plan)
    sent = ep.dispatch(x, ids, weights, plan=plan)
    with pytest.raises(ValueError, match="expert_out must have 12 rows"):
        ep.combine(torch.empty(3, H, dtype=x.dtype), sent.handle)
    with pytest.raises(TypeError, match="handle must be"):
        ep.combine(sent.recv_x, plan)


def test_the_process_group_must_match_the_model():
    assert current_ep_group() is None
    local = ep_group_for(8, 4)
    assert local is ep_group_for(8, 4) and not local.is_distributed and local.ep_size == 4
    with use_ep_group(EPGroup(num_experts=8, ep_size=2)) as ep:
        assert ep_group_for(8, 2) is ep
        with pytest.raises(ValueError, match="build the model config with the group's ep_size"):
            ep_group_for(8, 4)
    assert current_ep_group() is None
    with pytest.raises(TypeError):
        with use_ep_group("world"):  # type: ignore[arg-type]
            pass


# --------------------------------------------------------------------------------------------
# Bounded waits (the logic, with a collective that never completes)


class _NeverDone:
    def is_completed(self) -> bool:
        return False

    def wait(self) -> None:  # pragma: no cover - never reached
        raise AssertionError


def _pretend_distributed(ep: EPGroup, store=None, rank: int = 0) -> EPGroup:
    # the wait logic only (a gloo-like backend: waits poll); no collective is issued
    ep.collectives = Collectives(
        object(),
        members=(0, 1),
        rank=rank,
        backend="gloo",
        store=store,
        timeout_s=ep.timeout_s,
        abort_poll_s=ep.abort_poll_s,
        key="dbo-ep-abort/pretend/0",  # two ranks of one generation
    )
    return ep


def test_a_wait_ends_at_the_timeout_and_leaves_the_group_refusing_use():
    ep = _pretend_distributed(EPGroup(num_experts=8, timeout_s=0.3))
    start = time.monotonic()
    with pytest.raises(EPTimeoutError, match="did not complete within 0.3 s") as info:
        ep.collectives.wait(_NeverDone(), "dispatch (collective 3 of step 1, ubatch 1) on rank 0")
    assert 0.25 < time.monotonic() - start < 3.0
    assert "ubatch 1" in info.value.what
    with pytest.raises(EPError, match="unusable"):
        ep.begin_step(2)


def test_a_peer_abort_ends_a_wait_promptly_naming_the_peer():
    store = dist.HashStore()
    waiting = _pretend_distributed(EPGroup(num_experts=8, timeout_s=30), store)
    failing = _pretend_distributed(EPGroup(num_experts=8), store, rank=1)
    failing.abort("RuntimeError: expert kernel failed")
    failing.abort("a later error must not replace the first")
    start = time.monotonic()
    with pytest.raises(EPPeerFailedError, match="EP rank 1 failed") as info:
        waiting.collectives.wait(_NeverDone(), "combine")
    assert time.monotonic() - start < 2.0
    assert info.value.rank == 1 and info.value.reason == "RuntimeError: expert kernel failed"


def test_step_reports_a_local_failure_to_peers_but_not_a_peer_failure_back():
    store = dist.HashStore()
    ep = _pretend_distributed(EPGroup(num_experts=8), store)
    ep.begin_step = lambda n: None  # type: ignore[method-assign]
    with pytest.raises(EPPeerFailedError):
        with ep.step(2):
            raise EPPeerFailedError("peer", rank=1, reason="x")
    assert not store.check([ep.collectives.key])
    with pytest.raises(ZeroDivisionError):
        with ep.step(2):
            _ = 1 / 0
    assert store.get(ep.collectives.key).decode().startswith("0\nZeroDivisionError")


def test_abort_keys_are_counted_per_process_group():
    # A rank refused by one group (not a member) must not shift the keys of the groups it is in.
    from dbo.comm.collectives import abort_key

    class Group:
        def __init__(self, name: str) -> None:
            self.group_name = name

    first, second = Group("test-keys-a"), Group("test-keys-b")
    assert abort_key(first, (0, 1)) == "dbo-ep-abort/test-keys-a/0"
    assert abort_key(second, (0, 1)) == "dbo-ep-abort/test-keys-b/0"
    assert abort_key(first, (0, 1)) == "dbo-ep-abort/test-keys-a/1"


# --------------------------------------------------------------------------------------------
# The all-to-all path over a gloo group of one, in this process


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def world_of_one():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{_free_port()}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=20),
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["ht", "ll"])
def test_process_group_path_equals_the_dense_reference(world_of_one, mode):
    x, ids, weights, experts = _routing(23, seed=8)
    ep = EPGroup(world_of_one, num_experts=E)
    assert ep.is_distributed and ep.ep_size == 1 and ep.local_experts == range(E)
    device = SimDevice()
    with dbo.use_device(device), device.thread_scope(None):
        out, sent = _round_trip(ep, x, ids, weights, experts, mode)
    assert torch.allclose(out, _dense(x, ids, weights, experts), rtol=0, atol=1e-12)
    assert sent.handle.plan.send_counts == (23 * K,) == sent.handle.plan.recv_counts
    comm = [r.name for r in device.timeline if r.kind == "comm" and not r.name.endswith(".send")]
    assert comm == ["comm::dispatch_counts", "comm::dispatch", "comm::combine"]


def test_process_group_refusals(world_of_one):
    with pytest.raises(
        ValueError, match=r"ep_size \(2\) must divide the process group's size \(1\)"
    ):
        EPGroup(world_of_one, num_experts=8, ep_size=2)
    ep = EPGroup(world_of_one, num_experts=E)
    x, ids, weights, _ = _routing(5)
    bad = ids.clone()
    bad[2, 1] = E  # out of range
    with pytest.raises(ValueError, match=r"expert ids outside \[0, 8\) on rank 0"):
        ep.prepare(bad, weights)
    with pytest.raises(ValueError, match="meta tensors"):
        ep.prepare(ids.to("meta"), weights.to("meta"))
    # Both refusals left the group consistent: it still moves data.
    assert torch.allclose(
        ep.dispatch(x, ids, weights).recv_x.sum(0), x.sum(0) * K, rtol=0, atol=1e-12
    )


def test_model_over_the_process_group_equals_the_in_process_run(world_of_one):
    batch = Batch(query_start_loc=(0, 24, 40), context_lens=(0, 0))
    config = preset("tiny", ep_size=1)
    x = MoEModel(config, batch).inputs()
    local = run_step(MoEModel(config, batch), x, device=SimDevice(), num_ubatches=2, mode="ht")
    with use_ep_group(EPGroup(world_of_one, num_experts=config.num_experts)):
        across = run_step(MoEModel(config, batch), x, device=SimDevice(), num_ubatches=2, mode="ll")
    assert torch.allclose(local.output, across.output, rtol=0, atol=1e-9)
    assert not across.races and across.allocations_during_step == 0
    assert split_batch(batch.query_start_loc, batch.num_tokens, 2)[0].num_tokens == 20
