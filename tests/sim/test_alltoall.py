"""The all-to-all coupling rule: a receiving port takes rows in at its line rate, a sending
kernel pushes them out at the achieved share."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dbo.sim.alltoall import all_to_all_ends, egress_gbps, ingress_gbps
from dbo.sim.hardware import H800

# One GPU per node: every pair crosses the NIC.
NIC_ONLY = replace(H800, gpus_per_node=1)
SENT = 4e6  # bytes every rank sends


def _hot_receiver(extra: float) -> np.ndarray:
    """4 ranks each sending SENT; rank 0 receives `extra` times SENT, the others less."""
    t = np.zeros((4, 4))
    t[0, 1:] = SENT / 3
    for p in (1, 2, 3):
        t[p, 0] = extra * SENT / 3
        t[p, [r for r in (1, 2, 3) if r != p]] = (SENT - extra * SENT / 3) / 2
    assert np.allclose(t.sum(axis=1), SENT)
    return t


def test_a_receiving_port_runs_at_the_line_rate_a_sender_at_its_achieved_share():
    assert ingress_gbps(H800) == (H800.nvlink_gbps, H800.rdma_gbps)
    assert egress_gbps(H800) == (
        H800.nvlink_gbps * H800.nvlink_efficiency,
        H800.rdma_gbps * H800.rdma_efficiency,
    )


def test_a_receiver_fed_a_few_percent_more_than_its_peers_send_waits_for_no_one():
    # its port has the headroom between the senders' achieved rate and the line rate
    ends = all_to_all_ends(NIC_ONLY, "ll", np.zeros(4), _hot_receiver(1.05))
    send_us = SENT / (egress_gbps(NIC_ONLY)[1] * 1e3)
    assert np.allclose(ends.end, NIC_ONLY.ll_latency_us + send_us)


def test_a_receiver_fed_past_its_line_rate_ends_when_its_port_has_taken_everything():
    extra = 1.2  # above line rate over achieved share (1 / 0.92)
    ends = all_to_all_ends(NIC_ONLY, "ll", np.zeros(4), _hot_receiver(extra))
    recv_us = extra * SENT / (ingress_gbps(NIC_ONLY)[1] * 1e3)
    assert ends.end[0] == pytest.approx(NIC_ONLY.ll_latency_us + recv_us)
    assert ends.end[0] > ends.end[1:].max()
