"""`dbo.verify` never says ok wrongly: the forwards below differ between their serial and
ubatched runs in ways a naive comparison misses (aliased outputs, mutated inputs, complex
values, dtypes, containers), and the calls that cannot be verified are refused clearly."""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import threading

import pytest
import torch

import dbo
import workspace
from dbo.verification.compare import compare
from workspace import reset_workspace_manager

HIDDEN = 4


def batch(rows: int = 8, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(1), dtype=dtype)


def yield_once() -> None:
    dbo.dbo_yield_and_switch_from_compute_to_comm()
    dbo.dbo_switch_to_compute_sync()


@pytest.fixture(autouse=True)
def no_workspace():
    reset_workspace_manager()
    yield
    reset_workspace_manager()


@pytest.mark.timeout(30)
def test_a_serial_output_aliasing_memory_the_ubatched_run_writes_is_compared_as_it_was():
    buffer = torch.zeros(8, HIDDEN, dtype=torch.float64)

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = buffer[: x.shape[0]]  # both ubatches write rows 0..3: the later one wins
        out.copy_(x * 2)
        yield_once()
        return out

    report = dbo.verify(forward, batch())
    assert not report.ok and not report.outputs_match, report.describe()


@pytest.mark.timeout(30)
def test_each_run_gets_its_own_copy_of_a_batch_the_forward_mutates():
    x = batch()
    original = x.clone()

    def forward(x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        yield_once()
        return x + 1

    report = dbo.verify(forward, x)
    assert report.ok, report.describe()
    assert report.input_mutated
    assert "mutated its input" in report.describe()
    assert torch.equal(x, original)  # the caller's batch is never written


@pytest.mark.timeout(30)
def test_a_forward_that_leaves_its_input_alone_is_not_said_to_mutate_it():
    report = dbo.verify(lambda x: x * 2, batch())
    assert not report.input_mutated
    assert "mutated" not in report.describe()


@pytest.mark.timeout(30)
def test_complex_outputs_differing_only_in_their_imaginary_part_fail():
    def forward(x: torch.Tensor) -> torch.Tensor:
        imag = x * (2.0 if dbo.dbo_enabled() else 1.0)
        return torch.complex(x, imag)

    report = dbo.verify(forward, batch())
    assert not report.outputs_match, report.describe()
    assert report.max_abs_diff is not None and report.max_abs_diff > 0


@pytest.mark.timeout(30)
def test_equal_complex_outputs_match():
    report = dbo.verify(lambda x: torch.complex(x, -x), batch())
    assert report.outputs_match, report.describe()


@pytest.mark.timeout(30)
def test_a_dtype_difference_fails_the_comparison():
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.float() if dbo.dbo_enabled() else x

    report = dbo.verify(forward, batch())
    assert not report.outputs_match
    assert "dtype" in report.mismatch


@pytest.mark.timeout(30)
def test_a_tuple_against_a_list_fails_the_comparison():
    def forward(x: torch.Tensor):
        pair = (x, x + 1)
        return list(pair) if dbo.dbo_enabled() else pair

    report = dbo.verify(forward, batch(), merge=lambda outs: [torch.cat(p) for p in zip(*outs)])
    assert not report.outputs_match
    assert "list" in report.mismatch and "tuple" in report.mismatch


@pytest.mark.timeout(30)
def test_an_int_against_a_float_scalar_fails_the_comparison():
    def forward(x: torch.Tensor):
        return 1.0 if dbo.dbo_enabled() else 1

    report = dbo.verify(forward, batch(), merge=lambda outs: outs[0])
    assert not report.outputs_match
    assert "float" in report.mismatch and "int" in report.mismatch


@pytest.mark.timeout(30)
def test_a_device_difference_fails_the_comparison():
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.to("meta") if dbo.dbo_enabled() else x

    report = dbo.verify(forward, batch(), merge=lambda outs: torch.cat(outs))
    assert not report.outputs_match
    assert "device" in report.mismatch


@pytest.mark.timeout(30)
def test_the_timeout_bounds_a_stuck_serial_run():
    release = threading.Event()

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not dbo.dbo_enabled():
            release.wait(20)  # stuck in the serial run only
        return x

    try:
        with pytest.raises(dbo.UBatchTimeoutError, match="serial run"):
            dbo.verify(forward, batch(), timeout=0.5, warmup=0)
    finally:
        release.set()


@pytest.mark.timeout(30)
def test_a_serial_run_cut_off_by_the_timeout_cannot_reach_a_later_workspace():
    release, came_back = threading.Event(), threading.Event()
    seen: dict[str, str] = {}

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not dbo.dbo_enabled() and not release.is_set():
            release.wait(20)  # outlives the timeout, then touches the workspace
            try:
                workspace.current_workspace_manager().get_simultaneous(((8, 4), torch.float64))
                seen["then"] = "wrote a later step's slot"
            except BaseException as error:  # noqa: BLE001 - what the thread saw is the result
                seen["then"] = type(error).__name__
            came_back.set()
        return x

    with pytest.raises(dbo.UBatchTimeoutError):
        dbo.verify(forward, batch(), timeout=0.5, warmup=0)
    workspace.init_workspace_manager(torch.device("cpu"), 2)  # a later, unrelated manager
    release.set()
    assert came_back.wait(10)
    assert seen["then"] == "UBatchAbandoned"


@pytest.mark.timeout(30)
def test_verify_called_inside_a_ubatch_is_refused():
    refused: list[BaseException] = []

    def forward(x: torch.Tensor) -> torch.Tensor:
        try:
            dbo.verify(lambda y: y, x)
        except RuntimeError as error:
            refused.append(error)
        return x

    dbo.run_ubatches(forward, [batch(4), batch(4)], device=dbo.sim.SimDevice())
    assert len(refused) == 2
    assert "inside a ubatch" in str(refused[0])


@pytest.mark.timeout(30)
def test_races_are_falsy_when_there_are_none_and_counted_when_there_are():
    clean = dbo.verify(lambda x: x * 2, batch())
    assert not clean.races and len(clean.races) == 0

    def racy(x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        dbo.dbo_yield()
        dbo.dbo_switch_to_comm()  # no wait for the compute stream
        with dbo.current_device().comm_region("dispatch", nbytes=h.numel() * 8):
            out = h + 1
        dbo.dbo_switch_to_compute_sync()
        return out

    report = dbo.verify(racy, batch())
    assert report.races and len(report.races) == len(report.races.ubatched) > 0
    assert report.races["ubatched"] == report.races.ubatched and report.races.serial == []


@pytest.mark.timeout(30)
def test_a_yield_mismatch_says_not_compared():
    def forward(x: torch.Tensor) -> torch.Tensor:
        yield_once()
        if dbo.dbo_current_ubatch_id() == 1:
            dbo.dbo_yield()
        return x

    text = dbo.verify(forward, batch()).describe()
    assert "outputs match    not compared" in text
    assert "NO" not in text.splitlines()[1]


@pytest.mark.timeout(30)
def test_a_yield_mismatch_names_a_file_and_line_for_every_ubatch():
    def forward(x: torch.Tensor) -> torch.Tensor:
        yield_once()
        if dbo.dbo_current_ubatch_id() == 1:
            dbo.dbo_yield()
        return x

    report = dbo.verify(forward, batch())
    lines = [line for line in str(report.error).splitlines() if "yield(s)" in line]
    assert len(lines) == 2
    assert all("test_verify_verdicts.py:" in line for line in lines), lines


@pytest.mark.timeout(30)
def test_a_step_without_communication_says_so():
    text = dbo.verify(lambda x: x * 2, batch()).describe()
    assert "no communication" in text


@pytest.mark.timeout(30)
def test_a_tiny_step_says_it_is_host_bound():
    def forward(x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        dbo.dbo_yield_and_switch_from_compute_to_comm()
        with dbo.current_device().comm_region("dispatch", nbytes=h.numel() * 8):
            h = h + 1
        dbo.dbo_switch_to_compute_sync()
        return h

    report = dbo.verify(forward, batch())
    assert "host-bound" in report.describe()
    assert "no communication" not in report.describe()


def racy(x: torch.Tensor) -> torch.Tensor:
    h = x * 2
    dbo.dbo_yield()
    dbo.dbo_switch_to_comm()  # the bug: the comm stream does not wait for h
    with dbo.current_device().comm_region("dispatch", nbytes=h.numel() * 8, ep_size=8):
        out = h + 1
    dbo.dbo_switch_to_compute_sync()
    return out


def correct(x: torch.Tensor) -> torch.Tensor:
    h = x * 2
    dbo.dbo_yield_and_switch_from_compute_to_comm()
    with dbo.current_device().comm_region("dispatch", nbytes=h.numel() * 8, ep_size=8):
        out = h + 1
    dbo.dbo_switch_to_compute_sync()
    return out


@pytest.mark.timeout(30)
def test_in_issue_order_a_race_leaves_the_outputs_matching():
    report = dbo.verify(racy, batch())
    assert report.outputs_match and report.races and not report.ok
    assert report.adversarial is None and report.race_order == "issue"


@pytest.mark.timeout(30)
def test_the_adversarial_order_shows_the_values_a_race_changes():
    report = dbo.verify(racy, batch(), race_order="adversarial")
    assert not report.ok and not report.outputs_match
    assert report.adversarial is not None and report.adversarial.changed
    assert "the race changes values" in report.describe()
    assert "in the adversarial order" in report.describe().splitlines()[1]
    assert report.to_dict()["adversarial"]["changed"] is True


@pytest.mark.timeout(30)
def test_the_adversarial_order_of_a_correct_forward_is_benign():
    report = dbo.verify(correct, batch(), race_order="adversarial")
    assert report.ok, report.describe()
    assert not report.adversarial.changed and "benign here" in report.describe()


_W = torch.randn(4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def doubles_its_input(x):
    x.mul_(2.0)  # legal: each run gets its own copy of the batch
    return torch.tanh(x @ _W)


@pytest.mark.timeout(30)
def test_the_adversarial_order_of_a_forward_that_rewrites_its_input_is_benign():
    # The re-executions start from memory as the capture left it; compared with each other
    # they agree, where a comparison with the serial output would see the input doubled twice.
    report = dbo.verify(doubles_its_input, batch(), race_order="adversarial")
    assert report.ok, report.describe()
    assert "benign here" in report.describe()


_CACHE = torch.arange(64.0, dtype=torch.float64).reshape(16, 4) / 10


def writes_part_of_a_cache(x):
    _CACHE[0].fill_(1.0)  # the step's first access to the cache writes one row of it only
    return x @ _CACHE.T


@pytest.mark.timeout(30)
def test_the_adversarial_order_of_a_partly_written_cache_is_benign():
    report = dbo.verify(writes_part_of_a_cache, batch(), race_order="adversarial")
    assert report.ok, report.describe()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"race_order": "random"}, "race_order must be one of"),
        ({"race_order": "adversarial", "inputs": torch.zeros(8, 4, device="meta")}, "meta"),
    ],
)
def test_a_race_order_that_cannot_run_is_refused_before_any_work(kwargs, message):
    inputs = kwargs.pop("inputs", batch())
    with pytest.raises(ValueError, match=message):
        dbo.verify(racy, inputs, **kwargs)


@pytest.mark.timeout(60)
def test_an_ep_group_all_to_all_counts_as_communication():
    from examples import ep_moe

    report = dbo.verify(ep_moe.forward, ep_moe.make_batch(), atol=1e-9, rtol=1e-9)
    assert report.ok, report.describe()
    assert report.comm_us and report.comm_us > 0
    assert "no communication" not in report.describe()


@pytest.mark.timeout(60)
def test_an_exchange_written_as_plain_ops_is_reported_as_no_communication():
    from examples import ep_moe

    report = dbo.verify(ep_moe.hand_rolled_forward, ep_moe.make_batch(), atol=1e-9, rtol=1e-9)
    assert report.ok and report.comm_us == 0.0
    assert "no communication" in report.describe()


def test_artifacts_naming_a_file_is_refused_before_any_work(tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("")
    ran: list[bool] = []
    with pytest.raises(ValueError, match="is a file"):
        dbo.verify(lambda x: ran.append(True) or x, batch(), artifacts=taken)
    assert not ran


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs a /proc file system")
def test_artifacts_that_cannot_be_created_are_refused_before_any_work():
    ran: list[bool] = []
    with pytest.raises(ValueError, match="cannot create or write"):
        dbo.verify(lambda x: ran.append(True) or x, batch(), artifacts="/proc/dbo/verify")
    assert not ran


@pytest.mark.timeout(30)
def test_communication_that_never_leaves_the_gpu_is_explained():
    def forward(x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        dbo.dbo_yield_and_switch_from_compute_to_comm()
        with dbo.current_device().comm_region("dispatch", nbytes=h.numel() * 8):  # ep_size 1
            h = h + 1
        dbo.dbo_switch_to_compute_sync()
        return h

    report = dbo.verify(forward, batch())
    assert report.local_comm and "all communication is local" in report.describe()
    assert not dbo.verify(correct, batch()).local_comm  # ep_size=8: it leaves the GPU


def _resolves(dotted: str) -> bool:
    """Whether `dbo.a.b` names something: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            if not hasattr(value, part):
                return False
            value = getattr(value, part)
        return True
    return False


@pytest.mark.timeout(30)
def test_meta_inputs_are_verified_as_shapes_only_with_no_false_races():
    weight = torch.empty(64, 64, device="meta")

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = x @ weight
        dbo.dbo_yield_and_switch_from_compute_to_comm()
        with dbo.current_device().comm_region("dispatch", nbytes=h.numel() * 4, ep_size=8):
            h = h * 2
        dbo.dbo_switch_to_compute_sync()
        return h + x

    report = dbo.verify(forward, torch.empty(32, 64, device="meta"))
    assert report.ok and report.shapes_only, report.describe()
    assert "no values" in report.describe() and "races            not checked" in report.describe()


@pytest.mark.timeout(30)
def test_the_notes_name_only_dbo_names_that_exist():
    def local(x: torch.Tensor) -> torch.Tensor:
        dbo.dbo_yield_and_switch_from_compute_to_comm()
        with dbo.current_device().comm_region("dispatch", nbytes=x.numel() * 8):
            h = x + 1
        dbo.dbo_switch_to_compute_sync()
        return h

    text = dbo.verify(local, batch()).describe() + dbo.verify(lambda x: x * 2, batch()).describe()
    names = set(re.findall(r"\bdbo(?:\.[A-Za-z_]\w*)+", text))
    assert names, text
    assert [name for name in names if not _resolves(name)] == []


@dataclasses.dataclass
class _Hidden:
    hidden: torch.Tensor


def test_dataclass_outputs_are_compared_field_by_field():
    same = compare(_Hidden(torch.ones(3)), _Hidden(torch.ones(3)), 0.0, 0.0)
    differs = compare(_Hidden(torch.ones(3)), _Hidden(torch.zeros(3)), 0.0, 0.0)
    assert same.match and not differs.match and "output.hidden" in differs.mismatch


def test_an_output_type_without_equality_is_refused_with_what_to_return():
    class Box:
        def __init__(self, t):
            self.t = t

    with pytest.raises(TypeError, match="cannot compare Box values"):
        compare(Box(torch.ones(3)), Box(torch.ones(3)), 0.0, 0.0)


def test_equal_infinities_add_nothing_to_the_difference():
    a = torch.tensor([1.0, float("inf"), -float("inf")])
    found = compare(a, a.clone(), 0.0, 0.0)
    assert found.match and found.max_abs_diff == 0.0
