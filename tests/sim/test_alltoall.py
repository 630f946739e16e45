"""The all-to-all coupling rule: a port takes its rows in from when they start coming, which
for DeepEP's one-sided low-latency puts can be before the receiving kernel runs."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dbo.sim import SimDevice
from dbo.sim.alltoall import all_to_all_ends
from dbo.sim.cluster import simulate_cluster
from dbo.sim.cluster_program import record_program
from dbo.sim.hardware import H800
from dbo.sim.options import SimOptions
from dbo.sim.routing import Routing, contiguous

# One GPU per node: every pair crosses the NIC, at one share for both kernel families, so
# the port rule alone sets the times.
NIC_ONLY = replace(H800, gpus_per_node=1, ll_rdma_efficiency=H800.rdma_efficiency)
SENT = 4e6  # bytes every rank sends
EXTRA = 1.5  # what the busiest receiver takes, over what a rank sends
WIRE_US = SENT / (NIC_ONLY.rdma_gbps * 1e3 * NIC_ONLY.rdma_efficiency)  # one rank's send
LL, HT = NIC_ONLY.ll_latency_us, NIC_ONLY.rdma_latency_us


def _hot_shares(extra: float = EXTRA) -> np.ndarray:
    """[p, r]: 4 ranks each sending all its rows to the others; rank 0 receives `extra`
    times what a rank sends, the others less."""
    c = np.zeros((4, 4))
    c[0, 1:] = 1 / 3
    for p in (1, 2, 3):
        c[p, 0] = extra / 3
        c[p, [r for r in (1, 2, 3) if r != p]] = (1 - extra / 3) / 2
    assert np.allclose(c.sum(axis=1), 1.0)
    return c


def test_the_busiest_receiver_ends_when_its_port_has_taken_its_rows():
    ends = all_to_all_ends(NIC_ONLY, "ll", np.zeros(4), _hot_shares() * SENT)
    assert ends.end[0] == pytest.approx(LL + EXTRA * WIRE_US)
    assert ends.end[0] > ends.end[1:].max()


@pytest.mark.parametrize("mode", ["ll", "ht"])
def test_a_port_takes_no_row_before_its_senders_start(mode):
    late_senders = np.array([0.0, 200.0, 200.0, 200.0])
    ends = all_to_all_ends(NIC_ONLY, mode, late_senders, _hot_shares() * SENT)
    latency = LL if mode == "ll" else HT
    assert ends.end[0] == pytest.approx(200.0 + latency + EXTRA * WIRE_US)
    assert ends.peer_wait_us[0] == pytest.approx(200.0)  # waiting on peers, not its own bytes
    assert ends.gate[0] == 1  # the first of its senders


def test_low_latency_puts_land_before_a_late_receiver_starts_normal_rows_wait_for_it():
    # DeepEP's low-latency puts are one-sided; a normal kernel's receiving SMs drain its rows
    late_receiver = np.array([200.0, 0.0, 0.0, 0.0])
    ll = all_to_all_ends(NIC_ONLY, "ll", late_receiver, _hot_shares() * SENT)
    ht = all_to_all_ends(NIC_ONLY, "ht", late_receiver, _hot_shares() * SENT)
    assert ll.end[0] == pytest.approx(200.0 + LL + WIRE_US)  # its own send is what is left
    assert ht.end[0] == pytest.approx(200.0 + HT + EXTRA * WIRE_US)


def test_the_replay_lets_a_late_ranks_port_take_its_next_dispatch_as_it_frees():
    # back-to-back dispatches: the busiest receiver ends the first last; its peers' puts of
    # the second land once its port has taken the first's rows, before its kernel starts
    device = SimDevice(SimOptions(NIC_ONLY, tensor_device="meta"))
    nbytes = int(SENT * 3 / 4)  # the recording's bytes to other ranks under balanced routing

    def step() -> None:
        with device.thread_scope(None):
            for _ in range(2):
                with device.comm_region("dispatch", nbytes=nbytes, mode="ll", ep_size=4):
                    pass

    program = record_program(step, device)
    routing = Routing(_hot_shares()[None], "hot receiver", top_k=1)
    result = simulate_cluster(program, routing, contiguous(4, 4))
    first, second = (c.op for c in program.collectives)
    t0 = result.start[first][0]
    assert result.end[first][0] - t0 == pytest.approx(LL + EXTRA * WIRE_US)
    port_back_to_back = LL + 2 * EXTRA * WIRE_US
    assert result.end[second][0] - t0 == pytest.approx(port_back_to_back)
    assert port_back_to_back < result.end[first][0] - t0 + LL + EXTRA * WIRE_US  # own start


def test_low_latency_puts_and_normal_kernels_move_at_their_own_nic_shares():
    nic = replace(H800, gpus_per_node=1)  # the real profile's two shares
    even = (np.ones((4, 4)) - np.eye(4)) * SENT / 3
    ll = all_to_all_ends(nic, "ll", np.zeros(4), even).end - nic.ll_latency_us
    ht = all_to_all_ends(nic, "ht", np.zeros(4), even).end - nic.rdma_latency_us
    assert np.allclose(ht / ll, nic.ll_rdma_efficiency / nic.rdma_efficiency)
