"""The all-to-all coupling rule: a kernel sends at its link's achieved share, a NIC takes rows
in at the wire's payload rate, and no port takes rows before they are sent."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dbo.sim import SimDevice
from dbo.sim.alltoall import all_to_all_ends, egress_gbps, ingress_gbps
from dbo.sim.cluster import simulate_cluster
from dbo.sim.cluster_program import record_program
from dbo.sim.hardware import H800
from dbo.sim.options import SimOptions
from dbo.sim.routing import Routing, contiguous

# One GPU per node: every pair crosses the NIC.
NIC_ONLY = replace(H800, gpus_per_node=1)
SENT = 4e6  # bytes every rank sends
HEADROOM = NIC_ONLY.rdma_ingress_efficiency / NIC_ONLY.rdma_efficiency
A_FEW_PERCENT = 1 + (HEADROOM - 1) / 2  # inside the port's headroom
PAST_THE_PORT = 1.1 * HEADROOM


def _hot_shares(extra: float) -> np.ndarray:
    """[p, r]: 4 ranks each sending all its rows to the others; rank 0 receives `extra`
    times what a rank sends, the others less."""
    c = np.zeros((4, 4))
    c[0, 1:] = 1 / 3
    for p in (1, 2, 3):
        c[p, 0] = extra / 3
        c[p, [r for r in (1, 2, 3) if r != p]] = (1 - extra / 3) / 2
    assert np.allclose(c.sum(axis=1), 1.0)
    return c


def _send_us(nbytes: float) -> float:
    return nbytes / (egress_gbps(NIC_ONLY)[1] * 1e3)


def _recv_us(nbytes: float) -> float:
    return nbytes / (ingress_gbps(NIC_ONLY)[1] * 1e3)


def test_a_nic_receives_at_the_wires_payload_rate_and_nvlink_as_it_sends():
    assert ingress_gbps(H800)[1] == H800.rdma_gbps * H800.rdma_ingress_efficiency
    assert ingress_gbps(H800)[1] > egress_gbps(H800)[1]
    assert ingress_gbps(H800)[0] == egress_gbps(H800)[0]


def test_a_receiver_fed_a_few_percent_more_than_its_peers_send_waits_for_no_one():
    ends = all_to_all_ends(NIC_ONLY, "ll", np.zeros(4), _hot_shares(A_FEW_PERCENT) * SENT)
    assert np.allclose(ends.end, NIC_ONLY.ll_latency_us + _send_us(SENT))


def test_a_receiver_fed_past_its_ports_rate_ends_when_its_port_has_taken_everything():
    ends = all_to_all_ends(NIC_ONLY, "ll", np.zeros(4), _hot_shares(PAST_THE_PORT) * SENT)
    assert ends.end[0] == pytest.approx(NIC_ONLY.ll_latency_us + _recv_us(PAST_THE_PORT * SENT))
    assert ends.end[0] > ends.end[1:].max()


@pytest.mark.parametrize("mode", ["ll", "ht"])
def test_a_port_takes_no_row_before_its_senders_start(mode):
    late = np.array([0.0, 200.0, 200.0, 200.0])
    ends = all_to_all_ends(NIC_ONLY, mode, late, _hot_shares(PAST_THE_PORT) * SENT)
    latency = NIC_ONLY.ll_latency_us if mode == "ll" else NIC_ONLY.rdma_latency_us
    assert ends.end[0] >= 200.0 + latency + _recv_us(PAST_THE_PORT * SENT) - 1e-9


def test_low_latency_puts_land_before_a_late_receiver_starts_normal_rows_wait_for_it():
    # DeepEP's low-latency puts are one-sided; a normal kernel's receiving SMs drain its rows
    late_receiver = np.array([200.0, 0.0, 0.0, 0.0])
    traffic = _hot_shares(PAST_THE_PORT) * SENT
    ll = all_to_all_ends(NIC_ONLY, "ll", late_receiver, traffic)
    ht = all_to_all_ends(NIC_ONLY, "ht", late_receiver, traffic)
    port = _recv_us(PAST_THE_PORT * SENT)
    assert ll.end[0] == pytest.approx(200.0 + NIC_ONLY.ll_latency_us + _send_us(SENT))
    assert ht.end[0] == pytest.approx(200.0 + NIC_ONLY.rdma_latency_us + port)


def test_the_group_replay_lets_a_busiest_receiver_inside_the_headroom_wait_for_no_one():
    device = SimDevice(SimOptions(NIC_ONLY, tensor_device="meta"))
    nbytes = int(SENT * 3 / 4)  # the recording's bytes to other ranks under balanced routing

    def step() -> None:
        with device.thread_scope(None):
            with device.comm_region("dispatch", nbytes=nbytes, mode="ll", ep_size=4):
                pass

    program = record_program(step, device)
    routing = Routing(_hot_shares(A_FEW_PERCENT)[None], "hot receiver", top_k=1)
    result = simulate_cluster(program, routing, contiguous(4, 4))
    op = program.collectives[0].op
    took = result.end[op] - result.start[op]
    assert np.allclose(took, NIC_ONLY.ll_latency_us + _send_us(nbytes * 4 / 3))
