"""Cost model: how long one op or one communication takes on a `HardwareProfile`.

Pure functions of shapes, dtypes and the profile; no clocks, no state. The device calls them
for every placed op; tests and the fidelity work call them directly.

Compute: one public place decides what an op costs, `op_cost(call, profile)`. It asks the op
cost registry (`register_op_cost`, in the spirit of torch.utils.flop_counter's
register_flop_formula: a user adds or overrides an op's cost without editing this file, for
every profile or for one), whose built-in entries price each covered op family (GEMMs,
grouped GEMMs, attention prefill and decode, elementwise ops and copies, norms, index gathers
and scatter-adds, sort and top-k) from the profile's measured kernel table
(`dbo.sim.tables`). Where no entry answers (no table, an op family or dtype the table does
not cover) the roofline is the fallback, and the returned `OpCost` says so, so a summary can
report how much of a step rests on it:
roofline time = max(FLOPs / peak(dtype), bytes / HBM bandwidth) + kernel_fixed_us, where FLOPs
come from torch.utils.flop_counter's registered formulas (0 when an op has none: it is then
memory bound) and bytes = nbytes of every tensor input and output.

Host: `host_family(name)` sorts an op into the kinds whose eager host cost differs (a GEMM
call walks more Python and library heuristics than an elementwise one); the profile says
what each kind costs.

Communication:  time = latency + algo_factor(kind, ep_size) * max(nvlink bytes / NVLink bw,
RDMA bytes / RDMA bw), the two links working in parallel. Latency is the link's for "ht"
(DeepEP normal-style kernels) and `ll_latency_us` for "ll" (low-latency kernels). A group
within one node uses NVLink only; a larger group splits a rank's bytes by where its peers are
(`ep_traffic`), unless the caller says how many of them cross nodes (`rdma_bytes`, e.g. after
the per-node de-duplication of DeepEP's normal internode kernels). An EP group of one rank
moves nothing over a link: its "communication" is a local permutation, costed by the HBM
roofline of the bytes it moves (`local_copy_us`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dbo.sim.families import FAMILY_OPS, GEMM_OPS, host_family, op_family
from dbo.sim.flops import aliased_input_bytes, flop_formula, op_flops
from dbo.sim.hardware import PROFILES, HardwareProfile
from dbo.sim.tables import KernelTable, load_table

__all__ = [
    "GEMM_OPS",
    "OpCall",
    "OpCost",
    "register_op_cost",
    "unregister_op_cost",
    "op_cost",
    "price_op",
    "add_op_observer",
    "remove_op_observer",
    "op_family",
    "host_family",
    "kernel_table",
    "ROOFLINE",
    "NVLINK",
    "RDMA",
    "COMM_MODES",
    "compute_time_us",
    "comm_time_us",
    "comm_link",
    "algo_factor",
    "ep_traffic",
    "node_dedup_share",
    "local_copy_us",
    "flop_formula",
    "op_flops",
    "aliased_input_bytes",
]

NVLINK = "nvlink"
RDMA = "rdma"
COMM_MODES = ("ht", "ll")


def compute_time_us(
    profile: HardwareProfile, flops: float, nbytes: float, dtype: torch.dtype
) -> float:
    """Roofline time of one kernel: the slower of its math and its memory traffic, plus the
    fixed per-kernel time."""
    math_us = flops / profile.peak_flops_per_us(dtype) if flops else 0.0
    mem_us = nbytes / profile.hbm_bytes_per_us_for(dtype) if nbytes else 0.0
    return max(math_us, mem_us) + profile.kernel_fixed_us


def comm_link(profile: HardwareProfile, ep_size: int, link: str | None = None) -> str:
    """Which link carries a group's traffic: NVLink within a node, RDMA once the group spans
    nodes (a simplification: a multi-node group is costed at the slower link throughout)."""
    if link is not None:
        if link not in (NVLINK, RDMA):
            raise ValueError(f"link must be {NVLINK!r}, {RDMA!r} or None, got {link!r}")
        return link
    return NVLINK if ep_size <= profile.gpus_per_node else RDMA


def algo_factor(kind: str, ep_size: int) -> float:
    """Bytes on the wire per payload byte, by collective.

    dispatch/combine/all_to_all/send/recv: `nbytes` is what this rank sends, factor 1.
    all_reduce (ring): 2 (n-1)/n of the buffer crosses each link; all_gather and
    reduce_scatter: (n-1)/n. Unknown kinds are treated as point-to-point (factor 1).
    """
    n = max(int(ep_size), 1)
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0


def ep_traffic(nbytes: float, ep_size: int, gpus_per_node: int) -> tuple[float, float]:
    """(NVLink bytes, RDMA bytes) of `nbytes` a rank sends to the other ranks of its group,
    spread evenly over its peers (balanced routing): (g - 1) of the ep - 1 peers share its
    node, the rest are reached over RDMA. A group within one node is all NVLink."""
    n = max(int(ep_size), 1)
    if n <= gpus_per_node:
        return float(nbytes), 0.0
    rdma = nbytes * (n - gpus_per_node) / (n - 1)
    return float(nbytes) - rdma, rdma


def node_dedup_share(
    top_k: int, ep_size: int, gpus_per_node: int, num_groups: int = 1, topk_groups: int = 1
) -> float:
    """Of a token's expert copies bound for other nodes, the share that DeepEP's normal (HT)
    internode kernels put on RDMA: they send a token once per destination node and forward it
    over NVLink there (DeepEP README: "asymmetric-domain bandwidth forwarding").

    Balanced routing. With group-limited routing (DeepSeek-V3: n_group 8, topk_group 4) whose
    groups tile the nodes, a token reaches the nodes holding its `topk_groups` groups (each
    chosen group is assumed to receive at least one of its experts); otherwise each of the
    `top_k` experts lands on a node independently.
    """
    nodes = -(-max(int(ep_size), 1) // gpus_per_node)
    if nodes <= 1 or top_k <= 0:
        return 1.0
    if topk_groups > 1 and num_groups >= nodes and num_groups % nodes == 0:
        per_node = num_groups // nodes
        untouched = math.comb(num_groups - per_node, topk_groups) / math.comb(
            num_groups, topk_groups
        )
    else:
        untouched = (1 - 1 / nodes) ** top_k
    remote_nodes = nodes * (1 - untouched) * (nodes - 1) / nodes  # own node is one of them
    remote_copies = top_k * (nodes - 1) / nodes
    return min(1.0, remote_nodes / remote_copies)


def local_copy_us(profile: HardwareProfile, nbytes: float) -> float:
    """A permutation inside one GPU (an EP group of one): bytes read and written through HBM,
    as a memory-bound kernel."""
    return compute_time_us(profile, 0.0, nbytes, torch.uint8)


def comm_time_us(
    profile: HardwareProfile,
    kind: str,
    nbytes: float,
    ep_size: int,
    mode: str = "ht",
    link: str | None = None,
    *,
    rdma_bytes: float | None = None,
) -> float:
    """Time of one communication op (dispatch, combine, all_to_all, all_reduce, ...).

    `nbytes`: what this rank sends to other ranks. `mode` "ht" (high-throughput, DeepEP
    normal-style) pays the link latency; "ll" (low-latency) pays `ll_latency_us`, its fixed
    time (see the profile). `link` forces every byte onto one link. Otherwise a group within a
    node is NVLink only, and a multi-node group splits the bytes between NVLink and RDMA
    (`rdma_bytes` if given, else by peer count) and takes the slower of the two, which run in
    parallel. NVLink bandwidth is one direction of the datasheet total; RDMA is the per-GPU NIC;
    both are scaled by the profile's measured efficiencies. ep_size 1 (and no `link`): a local
    copy of `nbytes` (read + write) at the HBM roofline, whatever the mode.
    """
    if mode not in COMM_MODES:
        raise ValueError(f"mode must be one of {COMM_MODES}, got {mode!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if ep_size < 1:
        raise ValueError(f"ep_size must be >= 1, got {ep_size}")
    if rdma_bytes is not None and not 0 <= rdma_bytes <= nbytes:
        raise ValueError(f"rdma_bytes must be in [0, nbytes={nbytes}], got {rdma_bytes}")
    which = comm_link(profile, ep_size, link)
    if ep_size == 1 and link is None:
        return local_copy_us(profile, nbytes)
    nvl_bw = profile.nvlink_bytes_per_us
    rdma_bw = profile.rdma_bytes_per_us(mode)
    if link is not None:
        nvl, rdma = (float(nbytes), 0.0) if which == NVLINK else (0.0, float(nbytes))
    elif rdma_bytes is not None and ep_size > profile.gpus_per_node:
        nvl, rdma = float(nbytes) - rdma_bytes, float(rdma_bytes)
    else:
        nvl, rdma = ep_traffic(nbytes, ep_size, profile.gpus_per_node)
    if mode == "ll":
        latency = profile.ll_latency_us
    else:
        latency = profile.nvlink_latency_us if which == NVLINK else profile.rdma_latency_us
    wire_us = max(nvl / nvl_bw, rdma / rdma_bw)
    return latency + algo_factor(kind, ep_size) * wire_us


# --------------------------------------------------------------------------------------------
# Op cost: the registry, the kernel-table entries, the roofline fallback

ROOFLINE = "roofline"  # OpCost.source of a fallback estimate


@dataclass(frozen=True)
class OpCall:
    """One executed op as the cost model sees it: its name, the call itself, and what the
    interceptor measured of it (tensor inputs and outputs, FLOPs, bytes, math dtype)."""

    name: str  # "aten::mm"
    func: Any  # the op overload (None for a synthetic call)
    args: tuple
    kwargs: dict
    out: Any
    ins: list = field(default_factory=list)  # tensor inputs
    outs: list = field(default_factory=list)  # tensor outputs
    flops: float = 0.0
    nbytes: float = 0.0
    dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class OpCost:
    """An op's device time and where it came from: "table:<family>", "roofline", or a
    registered cost function's own label."""

    us: float
    source: str

    @property
    def is_fallback(self) -> bool:
        return self.source == ROOFLINE


# An op cost function: (call, profile) -> us, an OpCost, or None ("not mine: ask the next").
OpCostFn = Callable[[OpCall, HardwareProfile], "float | OpCost | None"]
# (profile name or None for every profile, op key) -> a user's cost function. An op key is
# "ns::name" (every overload) or "ns::name.overload" (that overload only).
_REGISTRY: dict[tuple[str | None, str], OpCostFn] = {}
# op name -> the built-in entry (the kernel-table families), asked after the user's entries.
_BUILTIN: dict[str, OpCostFn] = {}


def _op_key(op: Any) -> str:
    """The registry key of an op overload, packet or "ns::name[.overload]" string; a string
    must name an op torch knows, so a typo fails here instead of never matching."""
    if isinstance(op, str):
        return _resolve_op_string(op)
    if isinstance(op, torch._ops.OpOverload):
        return f"{op._schema.name}.{op._overloadname}"
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    raise TypeError(
        f"cannot name op {op!r}: give an op (torch.ops.aten.mm), an overload "
        "(torch.ops.aten.add.Tensor) or a string ('aten::mm', 'aten::add.Tensor')"
    )


def _resolve_op_string(text: str) -> str:
    qualified = text if "::" in text else f"aten::{text}"
    namespace, _, rest = qualified.partition("::")
    name, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
        if overload:
            getattr(packet, overload)
    except (AttributeError, RuntimeError):
        raise ValueError(
            f"no op {text!r} is registered with torch: give 'ns::name' for every overload of an "
            "op (e.g. 'aten::add') or 'ns::name.overload' for one (e.g. 'aten::add.Tensor'); "
            "a custom op must be defined before its cost is registered"
        ) from None
    return qualified


def _profile_key(profile: Any) -> str | None:
    """The registry's profile name: None (every profile), a known profile's name, or the
    name of a HardwareProfile given as an object (a user's own profile)."""
    if profile is None:
        return None
    if isinstance(profile, HardwareProfile):
        return profile.name
    if isinstance(profile, str) and profile.lower() in PROFILES:
        return profile.lower()
    raise ValueError(
        f"unknown hardware profile {profile!r}: give one of {', '.join(sorted(PROFILES))}, "
        "a HardwareProfile, or None for every profile"
    )


def register_op_cost(*ops: Any, profile: Any = None) -> Callable[[OpCostFn], OpCostFn]:
    """Decorator: `fn(call, profile)` prices `ops` (ops, overloads, "ns::name" strings for
    every overload or "ns::name.overload" for one), for every hardware profile or, with
    `profile="h200"` (or a HardwareProfile), for that one only. A per-device entry wins over
    a general one, an overload's over its op's. Returning None hands the op to the next in
    line: the per-profile entry, the general entry, the built-in measured kernel table, then
    the roofline. Ops and profile are checked here, before any pricing."""
    if not ops:
        raise ValueError("register_op_cost needs at least one op")
    keys = [_op_key(op) for op in ops]
    key_profile = _profile_key(profile)

    def decorator(fn: OpCostFn) -> OpCostFn:
        if not callable(fn):
            raise TypeError(f"register_op_cost decorates a function, got {fn!r}")
        for key in keys:
            _REGISTRY[(key_profile, key)] = fn
        return fn

    return decorator


def unregister_op_cost(*ops: Any, profile: Any = None) -> None:
    """Remove entries added by `register_op_cost` (the built-in table entries stay)."""
    key_profile = _profile_key(profile)
    for op in ops:
        _REGISTRY.pop((key_profile, _op_key(op)), None)


def kernel_table(profile: HardwareProfile) -> KernelTable | None:
    """The profile's measured kernel table, or None (an uncalibrated, roofline-only profile)."""
    return load_table(profile.kernel_table) if profile.kernel_table else None


def op_cost(call: OpCall, profile: HardwareProfile) -> OpCost:
    """What one op costs on `profile`: a user entry for this profile, else a user entry for
    every profile, else the built-in kernel-table entry, else the roofline (source
    "roofline"). An entry returning None passes the op on."""
    overload = getattr(call.func, "_overloadname", None)
    exact = f"{call.name}.{overload}" if overload is not None else None
    entries = (
        _REGISTRY.get((profile.name, exact)) if exact else None,
        _REGISTRY.get((profile.name, call.name)),
        _REGISTRY.get((None, exact)) if exact else None,
        _REGISTRY.get((None, call.name)),
        _BUILTIN.get(call.name),
    )
    for fn in entries:
        if fn is None:
            continue
        got = fn(call, profile)
        if got is None:
            continue
        return _checked_cost(got, fn, call)
    return OpCost(compute_time_us(profile, call.flops, call.nbytes, call.dtype), ROOFLINE)


def _checked_cost(got: Any, fn: OpCostFn, call: OpCall) -> OpCost:
    """A cost function's answer as an OpCost; a time the clock cannot take (negative: the op
    would end before it starts; nan or inf) is the cost function's bug, named here."""
    cost = got if isinstance(got, OpCost) else None
    us = cost.us if cost is not None else got
    try:
        us = float(us)
    except (TypeError, ValueError):
        us = math.nan
    if not (math.isfinite(us) and us >= 0.0):
        who = getattr(fn, "__qualname__", repr(fn))
        raise ValueError(
            f"the cost function {who} priced {call.name} at {got!r}: an op's device time "
            "must be a finite number of microseconds >= 0 (or None to pass the op on)"
        )
    return cost if cost is not None else OpCost(us, f"user:{call.name}")


def _table_cost(call: OpCall, profile: HardwareProfile) -> OpCost | None:
    """The built-in entry of every covered op: its family's estimate from the profile's table."""
    table = kernel_table(profile)
    family = op_family(call.name)
    if table is None or family is None:
        return None
    if family in ("mm", "grouped_mm"):
        return _gemm_cost(table, family, call)
    if family == "attention":
        family = _attention_family(call)
        if family is None:
            return None
    us = table.estimate(family, flops=call.flops, nbytes=_table_bytes(family, call))
    return None if us is None else OpCost(us, f"table:{family}")


def _table_bytes(family: str, call: OpCall) -> float:
    """The bytes measure of a call in its table rows' convention (see PROVENANCE.md): a copy
    or a gather counts its output read and written (an in-place copy's target is not read), a
    scatter-add its source rows three times (read, and the target rows read and written);
    every other family, all its tensors' bytes."""
    if family in ("index_select", "copy") and call.outs:
        return 2.0 * sum(t.numel() * t.element_size() for t in call.outs)
    if family == "index_add" and call.ins:
        return 3.0 * max(t.numel() * t.element_size() for t in call.ins)
    return call.nbytes


def _gemm_cost(table: KernelTable, family: str, call: OpCall) -> OpCost | None:
    if call.dtype not in (torch.bfloat16, torch.float16) or len(call.ins) < 2:
        return None  # the table holds bf16 GEMMs; FP8 and FP32 ones fall back to the roofline
    addmm = call.name == "aten::addmm" and len(call.ins) > 2  # addmm(bias, a, b)
    a, b = (call.ins[1], call.ins[2]) if addmm else call.ins[:2]
    if family == "mm":
        if a.dim() != 2 or b.dim() != 2:
            return None
        m, k, n, groups = a.shape[0], a.shape[1], b.shape[1], 1
    else:
        if a.dim() != 2 or b.dim() != 3:
            return None  # the measured form: 2-D rows against (groups, k, n) weights
        m, groups, k, n = a.shape[0], b.shape[0], b.shape[1], b.shape[2]
    us = table.estimate(family, m=m, n=n, k=k, groups=groups, nbytes=call.nbytes)
    return None if us is None else OpCost(us, f"table:{family}")


def _attention_family(call: OpCall) -> str | None:
    """Decode (one query per sequence, no mask) or causal prefill; other forms fall back."""
    if not call.ins or call.ins[0].dim() != 4:
        return None
    if call.ins[0].shape[-2] == 1:
        return "sdpa_decode"
    names = [a.name for a in call.func._schema.arguments] if hasattr(call.func, "_schema") else []
    at = names.index("is_causal") if "is_causal" in names else -1
    causal = call.kwargs.get("is_causal", call.args[at] if 0 <= at < len(call.args) else False)
    return "sdpa_causal" if causal is True else None


_BUILTIN.update(dict.fromkeys(FAMILY_OPS, _table_cost))


# An observer sees every OpCall priced while it is registered (the profiler records the ops a
# model issues this way, through the same interception that costs them).
_OBSERVERS: list[Callable[[OpCall], None]] = []


def add_op_observer(fn: Callable[[OpCall], None]) -> None:
    _OBSERVERS.append(fn)


def remove_op_observer(fn: Callable[[OpCall], None]) -> None:
    if fn in _OBSERVERS:
        _OBSERVERS.remove(fn)


def price_op(call: OpCall, profile: HardwareProfile) -> OpCost:
    """`op_cost`, shown to the registered observers first: what the interceptor calls."""
    for observer in _OBSERVERS[:]:  # an observer may remove itself
        observer(call)
    return op_cost(call, profile)
