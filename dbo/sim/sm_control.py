"""The simulated device's side of SM control: the two setters vLLM's `SMControlContextManager`
takes (DeepEP's `Buffer.set_num_sms` for the comm kernels, DeepGEMM's `set_num_sms` for the
GEMMs), so that while ubatches overlap, comm kernels run on the SMs reserved for them and a
ubatch's GEMMs on the rest.

Both reuse the device's pricing of SM sharing: a high-throughput comm kernel holds
`profile.comm_sms / num_sms` of the GPU (`dbo.sim.regions`), and under `dbo_gemm_sms` a
ubatch's GEMMs run on that many SMs of their own, never stretched by comm kernels
(`dbo.sim.timeline`). Asked for every SM (the manager's exit), each setter gives back the
device's own setting: the profile's `comm_sms`, and the `dbo_gemm_sms` it was built with.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

__all__ = ["SmControlHooks"]


class SmControlHooks:
    """`set_comm_sms` / `set_compute_sms` for a `SimDevice` (which has `profile` and
    `dbo_gemm_sms`)."""

    profile: Any
    dbo_gemm_sms: int | None  # the device's property: `compute_sms` when set
    compute_sms: int | None = None  # set by `set_compute_sms`; None: the device's own
    own_comm_sms: int | None = None  # the profile's, before the first `set_comm_sms`

    def set_comm_sms(self, sms: int) -> None:
        """From now, high-throughput comm kernels run on `sms` SMs (their share of the GPU)."""
        if self.own_comm_sms is None:
            self.own_comm_sms = self.profile.comm_sms
        own_comm = self.own_comm_sms
        sms = self._checked_sms("comm", sms)
        self.profile = replace(
            self.profile, comm_sms=own_comm if sms == self.profile.num_sms else sms
        )

    def set_compute_sms(self, sms: int) -> None:
        """From now, a ubatch's GEMMs run on `sms` SMs of their own, never stretched by comm
        kernels (the `dbo_gemm_sms` pricing)."""
        sms = self._checked_sms("compute", sms)
        self.compute_sms = None if sms == self.profile.num_sms else sms

    def _checked_sms(self, what: str, sms: Any) -> int:
        total = self.profile.num_sms
        if isinstance(sms, bool) or not isinstance(sms, int) or not 0 < sms <= total:
            raise ValueError(f"{what} SMs must be an int in (0, {total}], got {sms!r}")
        return sms
