"""What the split checker's rules share: the violation they report (`MetadataViolation`,
raised to callers as `UBatchMetadataError`), `fail` to stop at the first one, and each
metadata record read onto the host once (`HostMetadata`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

import torch

from dbo.split.metadata import CommonAttentionMetadata

__all__ = [
    "OPTIONAL_FIELDS",
    "HostMetadata",
    "MetadataViolation",
    "UBatchMetadataError",
    "ViolationFound",
    "fail",
    "host_ints",
]


@dataclass(frozen=True)
class MetadataViolation:
    """The first broken invariant: which (see the module docstring), in which field, ubatch
    and parent request (None where it is not about one), and why."""

    invariant: str
    field: str
    ubatch: int | None
    request: int | None
    message: str

    def describe(self) -> str:
        where = [f"ubatch {self.ubatch}"] if self.ubatch is not None else ["parent"]
        if self.request is not None:
            where.append(f"request {self.request}")
        return f"{', '.join(where)}, {self.field}: {self.message} [{self.invariant}]"


class UBatchMetadataError(ValueError):
    """A split's ubatch metadata breaks an invariant; `violation` says which and where."""

    def __init__(self, violation: MetadataViolation) -> None:
        super().__init__(f"ubatch metadata: {violation.describe()}")
        self.violation = violation


class ViolationFound(Exception):
    """Carries the first violation out of the nested checks."""

    def __init__(self, violation: MetadataViolation) -> None:
        self.violation = violation


def fail(invariant: str, field: str, ubatch: int | None, request: int | None, why: str) -> NoReturn:
    """Stop the checks at this violation (`find_metadata_violation` catches it)."""
    raise ViolationFound(MetadataViolation(invariant, field, ubatch, request, why))


def host_ints(t: torch.Tensor | None) -> list[int] | None:
    return None if t is None else [int(v) for v in t.detach().cpu().reshape(-1).tolist()]


@dataclass
class HostMetadata:
    """One record's fields on the host, read once."""

    qsl: list[int]
    qsl_dev: list[int]
    seq: list[int]
    computed: list[int]
    table: torch.Tensor
    slots: list[int]
    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    optional: dict[str, list[int] | None]

    @classmethod
    def of(cls, m: CommonAttentionMetadata) -> HostMetadata:
        return cls(
            qsl=host_ints(m.query_start_loc_cpu),
            qsl_dev=host_ints(m.query_start_loc),
            seq=host_ints(m.seq_lens),
            computed=host_ints(m.num_computed_tokens_cpu),
            table=m.block_table_tensor.detach().cpu(),
            slots=host_ints(m.slot_mapping),
            num_reqs=int(m.num_reqs),
            num_tokens=int(m.num_actual_tokens),
            max_query_len=int(m.max_query_len),
            max_seq_len=int(m.max_seq_len),
            optional={name: host_ints(getattr(m, name)) for name in OPTIONAL_FIELDS},
        )


# Optional fields and what they are indexed by.
OPTIONAL_FIELDS = {
    "positions": "token",
    "is_prefilling": "request",
    "seq_lens_cpu_upper_bound": "request",
}
