"""Hardware profiles of the simulated GPU: the numbers every cost in the simulator comes from.

A profile is a frozen dataclass; a user makes their own with `dataclasses.replace(H200, ...)`
or by constructing `HardwareProfile` directly. A profile with a `kernel_table` is calibrated:
the ops its table covers are priced from kernels measured on that GPU, or for H100 and H800
derived from the H200's measurements (same die; `dbo.sim.tables.derive`), provenance beside
the files, and its host costs come from the same machine's profiler
traces; the others price every op by the roofline below and are marked uncalibrated.
Datasheet numbers carry their source in a comment; numbers that are modelling assumptions say
so. The link efficiencies and the
low-latency fixed time come from DeepEP's published measurements (sources beside them); the
SGLang step-level results (published DBO/TBO throughput) never set a number here: they are
what `scenarios.tools.fidelity` checks the model against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dbo.sim.tables import load_table

__all__ = [
    "HardwareProfile",
    "H200",
    "H100",
    "H800",
    "B200",
    "PROFILES",
    "profile_from_name",
    "dtype_class",
    "HOST_KINDS",
    "OVERLAP_KINDS",
]

# The two kinds of kernel that take the GPU in turn (see HardwareProfile.overlap_rates).
OVERLAP_KINDS = ("compute", "full_grid")

# Op kinds whose eager host cost differs (see dbo.sim.cost.host_family).
HOST_KINDS = ("elementwise", "gemm", "attention", "sort_topk", "index")


def dtype_class(dtype: torch.dtype) -> str:
    """The peak-throughput class of a dtype: one of the keys of `HardwareProfile.peak_tflops`."""
    return _DTYPE_CLASS.get(dtype, "fp32")


_DTYPE_CLASS: dict[torch.dtype, str] = {
    torch.float64: "fp64",
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "bf16",  # fp16 and bf16 share the tensor-core peak on Hopper and Blackwell
    torch.int8: "int8",
    torch.uint8: "int8",
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _DTYPE_CLASS[getattr(torch, _name)] = "fp8"


@dataclass(frozen=True)
class HardwareProfile:
    """One GPU model as the simulator sees it. Units: TFLOP/s, GB/s (1e9 B/s), microseconds."""

    name: str
    num_sms: int
    # Dense (no sparsity) peak per dtype class, TFLOP/s. Keys: fp64, fp32, bf16, fp8, int8.
    peak_tflops: dict[str, float]
    hbm_gbps: float  # HBM bandwidth, GB/s
    nvlink_total_gbps: float  # NVLink bandwidth per GPU as datasheets quote it (both directions)
    rdma_gbps: float  # inter-node RDMA bandwidth per GPU, one direction
    gpus_per_node: int = 8  # HGX/DGX boards: EP groups larger than this cross nodes (RDMA)
    # HBM capacity, GB (1e9 B) as the datasheet quotes it; None: unknown (no memory check).
    hbm_gb: float | None = None
    # Achieved fraction of the peaks above. A roofline at 100% of peak is an upper bound no
    # real kernel reaches; the factors turn it into a typical large-kernel rate.
    compute_efficiency: float = 0.8  # large bf16 GEMMs reach about this share (the H200 table)
    # FP8 GEMMs with fine-grained (block) scaling reach a smaller share of their doubled peak:
    # DeepGEMM's README (Feb 2025, H800, DeepSeek-V3 shapes at M=4096) lists 990-1358 TFLOPS
    # for dense and 1093-1297 for grouped MoE GEMMs, i.e. 0.50-0.69 of 1979; 0.6 is the middle.
    compute_efficiency_fp8: float = 0.6
    memory_efficiency: float = 0.85  # assumption: large streaming kernels reach ~85% of HBM peak
    # FP8 GEMMs at decode sizes are weight-streaming kernels that reach less: DeepGEMM's README
    # (H800, M=64..128, DeepSeek-V3 shapes) lists 2221-2604 GB/s of the 3350 peak -> 0.7.
    memory_efficiency_fp8: float = 0.7
    # Achieved share of the link bandwidths, from DeepEP's measurements (deepseek-ai/DeepEP,
    # docs/legacy.md "Performance"): on H800 "~160 GB/s NVLink maximum bandwidth" of the 200 GB/s
    # one-way datasheet figure (its normal kernels reach 153-158 GB/s) -> 0.8; a CX7 400 Gb/s
    # NIC is "~50 GB/s maximum" -> 0.92 (46 GB/s), first read off its low-latency kernels'
    # 39-46 GB/s at EP >= 64 by a balanced formula; the normal kernels keep it, and with it
    # the all-ranks replay reads each of their internode bandwidths (43-58 GB/s at EP
    # 16/32/64, counted with the own node) within 10% of DeepEP's figure.
    # Assumed to carry over to H100/H200/B200 (same NVLink protocol, same NIC).
    nvlink_efficiency: float = 0.8
    rdma_efficiency: float = 0.92
    # The NIC's share under DeepEP's low-latency kernels (one put per token and expert, posted
    # from the GPU): read off DeepEP's EP 64 and 256 low-latency times through the all-ranks
    # replay of its benchmark (random routing on every rank, its 30-run loop), which holds the
    # routing's imbalance that a balanced formula would fold into the constant
    # (`scenarios/tools/fidelity_fit.py`; a slow test holds the value to the fit). Below the
    # wire's payload share (InfiniBand headers on a 4096-byte MTU: 0.994).
    ll_rdma_efficiency: float = 0.98
    # Host costs, for profiles without their own: the order of magnitude that
    # `dbo-sim calibrate-host` finds for a bare eager op and a bare baton pass
    # on a recent host (README, "Fidelity and the GPU check"). They belong to the host, not the
    # GPU: measure and override them per machine. A calibrated profile takes its host figures
    # from its table (derived from profiler traces of real steps, see dbo.sim.tables).
    # kernel_fixed_us is an assumption.
    launch_us: float = 10.0  # host time to launch one kernel eagerly (Python + CUDA launch)
    kernel_fixed_us: float = 2.5  # fixed device time of any kernel (ramp-up, tail, sync)
    handoff_us: float = 10.0  # host time of one baton pass between ubatch threads
    # Host time of one CUDA graph launch (the whole graph): an assumption (a few us of
    # cudaGraphLaunch), not measured; it matters only against a whole step's device time.
    graph_launch_us: float = 8.0
    # Communication. Latency is the fixed cost of one collective/dispatch kernel before bytes
    # flow (signalling, barriers): assumption, order of magnitude only.
    nvlink_latency_us: float = 5.0
    rdma_latency_us: float = 10.0
    ll_send_us: float = (
        2.5  # device time of the tiny "send" kernel of a low-latency op (assumption)
    )
    # Fixed time of one low-latency (DeepEP LL-style) dispatch or combine on top of its bytes
    # over the link: launching the send, the per-expert count/flag message that follows the
    # data and the receiver polls for (a second network latency), and the receive-side unpack
    # into the expert-major layout. Not a datasheet number: DeepEP's EP 8 dispatch (77 us for
    # 6.6 MB that ~160 GB/s NVLink moves in 41 us) leaves ~35 us that no bandwidth explains.
    # One value for every EP size, both kernels and every GPU; `scenarios.tools.fidelity` checks it
    # against the five other DeepEP latencies it was not taken from.
    ll_latency_us: float = 35.0
    # SMs a high-throughput comm kernel occupies while it runs. DeepEP's README example sets
    # `Buffer.set_num_sms(24)` for its normal (high-throughput) kernels.
    comm_sms: int = 24
    max_comm_sm_share: float = (
        0.9  # assumption: concurrent comm kernels never starve compute completely
    )
    # Measured kernel table (dbo/sim/tables/<name>.csv, or a path to one) pricing the ops it
    # covers; None: the roofline prices every op (an uncalibrated profile).
    kernel_table: str | None = None
    # Eager host time of one op of each kind (HOST_KINDS) as a multiple of launch_us (an
    # elementwise op, or any op not listed, is 1): a GEMM walks more Python and library
    # heuristics per call than an add.
    host_op_scale: dict[str, float] = field(default_factory=dict)
    # How fast a kernel progresses while one of the other kind runs on another stream, per
    # kind ("compute", "full_grid": the local comm ops of one rank), as a share of its solo
    # rate. The simulator runs the two kinds in turn; when one had to wait for the other, the
    # pair is charged what running them together at these rates would have cost beyond the
    # turns (dbo.sim.device.SimDevice.place_op). Empty: turns cost nothing extra (uncalibrated).
    # A calibrated profile takes them from its table, derived from profiler traces of DBO steps
    # (dbo.analysis.calibration.overlap_rates_from_traces).
    overlap_rates: dict[str, float] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # free-form notes for reports

    def __post_init__(self) -> None:
        if self.num_sms <= 0:
            raise ValueError(f"num_sms must be positive, got {self.num_sms}")
        if not 0 <= self.comm_sms < self.num_sms:
            raise ValueError(
                f"comm_sms must be in [0, num_sms={self.num_sms}), got {self.comm_sms}"
            )
        for key in ("fp32", "bf16"):
            if self.peak_tflops.get(key, 0) <= 0:
                raise ValueError(f"peak_tflops needs a positive {key!r} entry")
        for name in ("hbm_gbps", "nvlink_total_gbps", "rdma_gbps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        rates = self.overlap_rates
        if rates and (
            set(rates) != set(OVERLAP_KINDS) or not all(0.0 < v <= 1.0 for v in rates.values())
        ):
            raise ValueError(
                f"overlap_rates needs a rate in (0, 1] for each of {OVERLAP_KINDS} (or none), "
                f"got {rates!r}"
            )

    def __hash__(self) -> int:
        # The dict fields make the generated hash fail; profiles are small, hash their repr.
        return hash(repr(self))

    @property
    def calibrated(self) -> bool:
        """Whether measured kernels (not only the roofline) price this profile's ops."""
        return self.kernel_table is not None

    @property
    def kernels_derived(self) -> bool:
        """Whether its kernel table is derived from another GPU's measurements, not measured
        on this one (`dbo.sim.tables.derive`)."""
        return bool(self.extra.get("kernels_derived_from"))

    @property
    def kernel_source(self) -> str:
        """What prices its ops, in a run header's words: measured, derived, or roofline."""
        if self.kernel_table is None:
            return "roofline (uncalibrated)"
        if self.kernels_derived:
            return (
                f"derived from the {self.extra['kernels_derived_from']} table ({self.kernel_table})"
            )
        return f"measured table {self.kernel_table}"

    def eager_host_us(self, kind: str) -> float:
        """Host time to issue one eager op of `kind` (its launch and the Python around it)."""
        return self.launch_us * self.host_op_scale.get(kind, 1.0)

    @property
    def nvlink_gbps(self) -> float:
        """One direction of NVLink: a rank's sends use half of the datasheet's total."""
        return self.nvlink_total_gbps / 2

    @property
    def nvlink_bytes_per_us(self) -> float:
        """What a rank's NVLink moves one way, at its achieved share."""
        return self.nvlink_gbps * 1e3 * self.nvlink_efficiency

    def rdma_bytes_per_us(self, mode: str) -> float:
        """What a rank's NIC moves under `mode`'s kernels: DeepEP's low-latency puts ("ll")
        or its normal kernels (any other mode)."""
        share = self.ll_rdma_efficiency if mode == "ll" else self.rdma_efficiency
        return self.rdma_gbps * 1e3 * share

    def peak_flops_per_us(self, dtype: torch.dtype) -> float:
        """Achievable FLOPs per microsecond for matmul-like work in `dtype`."""
        cls = dtype_class(dtype)
        tflops = self.peak_tflops.get(cls) or self.peak_tflops["fp32"]
        efficiency = self.compute_efficiency_fp8 if cls == "fp8" else self.compute_efficiency
        return tflops * 1e6 * efficiency  # 1 TFLOP/s = 1e6 FLOP/us

    @property
    def hbm_bytes_per_us(self) -> float:
        return self.hbm_gbps * 1e3 * self.memory_efficiency  # 1 GB/s = 1e3 B/us

    def hbm_bytes_per_us_for(self, dtype: torch.dtype) -> float:
        """Achievable HBM bytes per microsecond of a kernel whose math runs in `dtype` (FP8
        kernels are the model's FP8 GEMMs: see memory_efficiency_fp8)."""
        if dtype_class(dtype) == "fp8":
            return self.hbm_gbps * 1e3 * self.memory_efficiency_fp8
        return self.hbm_bytes_per_us


def _host_costs(table: str) -> dict:
    """A table's host figures (and its overlap rates) as profile fields. The table keeps them
    apart (a bare launch per op kind, the Python between ops); the profile's launch_us is a
    whole eager elementwise op, Python included, and each kind a multiple of it, so
    `replace(profile, launch_us=...)` rescales every kind at once."""
    host = load_table(table).host
    if "launch_us" not in host:
        return {}
    bare, python = host["launch_us"], host.get("python_us", 0.0)
    whole = bare + python
    fields = {
        "launch_us": round(whole, 2),
        "host_op_scale": {
            k: round((bare * v + python) / whole, 3)
            for k, v in host.get("host_op_scale", {}).items()
        },
    }
    if "handoff_us" in host:
        fields["handoff_us"] = host["handoff_us"]
    if "overlap_rates" in host:
        fields["overlap_rates"] = dict(host["overlap_rates"])
    return fields


# NVIDIA H200 SXM datasheet: FP64 34 TF, FP32 67 TF, BF16/FP16 989 TF dense (1979 with
# sparsity), FP8/INT8 1979 dense, HBM3e 4.8 TB/s, NVLink 900 GB/s; 132 SMs (GH100 SXM5 config).
# Calibrated: kernels and host costs measured on one H200 (tables/PROVENANCE.md).
H200 = HardwareProfile(
    name="h200",
    num_sms=132,
    peak_tflops={"fp64": 34.0, "fp32": 67.0, "bf16": 989.0, "fp8": 1979.0, "int8": 1979.0},
    hbm_gbps=4800.0,
    nvlink_total_gbps=900.0,
    rdma_gbps=50.0,  # ConnectX-7 400 Gb/s per GPU = 50 GB/s
    hbm_gb=141.0,  # HBM3e 141 GB
    kernel_table="h200",
    **_host_costs("h200"),
)

# H100 and H800 kernels: derived from the measured H200 table (same GH100 die; compute-bound
# kernels keep their time, memory-bound ones scale by the HBM bandwidth ratio; see
# tables/derive.py and PROVENANCE.md). Their host costs stay the defaults above.
_DERIVED = {"kernels_derived_from": "h200"}

# NVIDIA H100 SXM datasheet: same tensor-core peaks as H200 (989 TF BF16 dense, FP8 2x),
# HBM3 3.35 TB/s, NVLink 900 GB/s, 132 SMs.
H100 = HardwareProfile(
    name="h100",
    num_sms=132,
    peak_tflops={"fp64": 34.0, "fp32": 67.0, "bf16": 989.0, "fp8": 1979.0, "int8": 1979.0},
    hbm_gbps=3350.0,
    nvlink_total_gbps=900.0,
    rdma_gbps=50.0,  # ConnectX-7 400 Gb/s
    hbm_gb=80.0,  # HBM3 80 GB
    kernel_table="h100",
    extra=dict(_DERIVED),
)

# NVIDIA H800 SXM: the H100 SXM die with NVLink cut to 400 GB/s total (export variant);
# compute and HBM3 3.35 TB/s as H100 SXM.
H800 = HardwareProfile(
    name="h800",
    num_sms=132,
    peak_tflops={"fp64": 34.0, "fp32": 67.0, "bf16": 989.0, "fp8": 1979.0, "int8": 1979.0},
    hbm_gbps=3350.0,
    nvlink_total_gbps=400.0,
    rdma_gbps=50.0,  # ConnectX-7 400 Gb/s
    hbm_gb=80.0,  # HBM3 80 GB, as H100 SXM
    kernel_table="h800",
    extra=dict(_DERIVED),
)

# NVIDIA B200 (HGX B200 datasheet, per GPU = 1/8 of the 8-GPU board, dense): BF16 ~2.25 PF,
# FP8 ~4.5 PF, FP32 ~75 TF, FP64 ~37 TF; HBM3e 8 TB/s; NVLink 5 1.8 TB/s; 148 SMs.
B200 = HardwareProfile(
    name="b200",
    num_sms=148,
    peak_tflops={"fp64": 37.0, "fp32": 75.0, "bf16": 2250.0, "fp8": 4500.0, "int8": 4500.0},
    hbm_gbps=8000.0,
    nvlink_total_gbps=1800.0,
    rdma_gbps=50.0,  # ConnectX-7 400 Gb/s (the same NIC class on HGX B200)
    hbm_gb=180.0,  # HGX B200: 1,440 GB over 8 GPUs
)

PROFILES: dict[str, HardwareProfile] = {p.name: p for p in (H200, H100, H800, B200)}


def profile_from_name(name: str | HardwareProfile) -> HardwareProfile:
    """Look a profile up by name (case-insensitive); a HardwareProfile passes through."""
    if isinstance(name, HardwareProfile):
        return name
    if not isinstance(name, str):
        raise TypeError(f"profile must be a name or a HardwareProfile, got {type(name).__name__}")
    key = name.strip().lower().replace("-sxm", "").replace("_sxm", "")
    try:
        return PROFILES[key]
    except KeyError:
        raise ValueError(
            f"unknown hardware profile {name!r}; valid names: {', '.join(sorted(PROFILES))} "
            f"(or pass a HardwareProfile)"
        ) from None
