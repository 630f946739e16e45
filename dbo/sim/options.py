"""How one simulated device is built: the frozen `SimOptions` record, checked once.

The record holds the hardware profile and the figures a run overrides in it
(`ProfileOverrides`), where the device's tensors live, what it records and checks, and the
knobs of the serving engine being modelled (`EngineKnobs`). Each bad value is refused on
construction with one line naming the field, before any device holds state.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from dbo.checks import as_int
from dbo.sim.hardware import HardwareProfile, profile_from_name

__all__ = ["RACE_ACTIONS", "EngineKnobs", "ProfileOverrides", "SimOptions"]

RACE_ACTIONS = ("record", "raise", "warn")


@dataclass(frozen=True)
class ProfileOverrides:
    """Figures of the profile a run sets itself (None: the profile's own)."""

    launch_us: float | None = None
    handoff_us: float | None = None
    comm_sms: int | None = None
    kernel_fixed_us: float | None = None

    def applied_to(self, profile: HardwareProfile) -> HardwareProfile:
        given = {f.name: getattr(self, f.name) for f in fields(self)}
        given = {name: value for name, value in given.items() if value is not None}
        for name, value in given.items():
            if value < 0:
                raise ValueError(f"overrides.{name} must be >= 0, got {value!r}")
        return replace(profile, **given) if given else profile


@dataclass(frozen=True)
class EngineKnobs:
    """Knobs of the serving engine being modelled, beside the hardware.

    `dbo_gemm_sms`: SGLang's two-batch overlap caps DeepGEMM at (SMs - DeepEP's SMs) for the
    whole ubatched prefill step (sglang operations_strategy.py: deep_gemm_num_sms), so its
    GEMMs never share SMs with the comm kernels, and always run on fewer of them.
    `ht_rdma_share`: of the bytes a multi-node "ht" region sends off-node, the share that
    crosses RDMA: DeepEP's normal kernels send a token once per destination node and forward
    it over NVLink there (`dbo.sim.cost.node_dedup_share` derives it from the routing); 1.0 is
    one RDMA copy per expert copy, as the low-latency kernels send. `ht_nvl_share`: NVLink
    bytes per byte of expert copies sent, one per token and destination rank as DeepEP's
    normal kernels move them (`dbo.sim.traffic.balanced_dedup` gives both shares, its own
    node and rank included); None keeps every byte not on RDMA on NVLink."""

    dbo_gemm_sms: int | None = None
    ht_rdma_share: float = 1.0
    ht_nvl_share: float | None = None

    def check(self, profile: HardwareProfile) -> None:
        sms = self.dbo_gemm_sms
        if sms is not None and not 0 < sms <= profile.num_sms:
            raise ValueError(f"dbo_gemm_sms must be in (0, {profile.num_sms}], got {sms!r}")
        for name in ("ht_rdma_share", "ht_nvl_share"):
            share = getattr(self, name)
            if share is not None and not 0.0 < share < float("inf"):
                raise ValueError(f"{name} must be a positive share of the bytes, got {share!r}")


@dataclass(frozen=True)
class SimOptions:
    """Everything a `SimDevice` is built from; checked on construction.

    `tensor_device`: "cpu" (real values) or "meta" (shapes only; no race checks, as meta
    tensors have no storage). `race_action`: what a race found does besides being recorded
    ("raise" a `RaceError`, "warn")."""

    profile: str | HardwareProfile = "h200"
    overrides: ProfileOverrides = field(default_factory=ProfileOverrides)
    rank: int = 0
    tensor_device: str | torch.device = "cpu"
    check_races: bool = True
    capture_stacks: bool = True
    record_timeline: bool = True
    race_action: str = "record"
    engine: EngineKnobs = field(default_factory=EngineKnobs)

    def __post_init__(self) -> None:
        as_int("rank", self.rank)
        if self.race_action not in RACE_ACTIONS:
            raise ValueError(
                f"race_action must be 'record', 'raise' or 'warn', got {self.race_action!r}"
            )
        self.torch_device()
        self.engine.check(self.hardware())

    def hardware(self) -> HardwareProfile:
        """The profile, by name or as given, with the overrides applied."""
        return self.overrides.applied_to(profile_from_name(self.profile))

    def torch_device(self) -> torch.device:
        """Where the device's tensors live."""
        device = torch.device(self.tensor_device)
        if device.type not in ("cpu", "meta"):
            raise ValueError(
                f"tensor_device must be 'cpu' (real values) or 'meta' (shapes only), got "
                f"{self.tensor_device!r}"
            )
        return device
