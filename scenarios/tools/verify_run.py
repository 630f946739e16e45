"""The work of `dbo-sim verify`: load the user's forward and inputs, verify it serially and
ubatched (or across ranks), and print or write the report.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dbo.errors import UBatchTimeoutError
from dbo.sim.trace import WindowSpec
from dbo.verification import VerifyReport, verify
from dbo.verification.ranks import verify_ranks
from scenarios.lib.usage import UsageError, writable_dir

__all__ = ["load_attribute", "run"]


def load_attribute(spec: str, what: str) -> Any:
    """`MODULE:ATTR` -> the object; UsageError saying what is wrong otherwise."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"{what} must look like MODULE:NAME, got {spec!r}")
    module = _load_module(module_name, what)
    value: Any = module
    for part in attr.split("."):
        if not hasattr(value, part):
            raise UsageError(f"{what}: {module_name} has no attribute {attr!r}")
        value = getattr(value, part)
    return value


def _load_module(name: str, what: str) -> Any:
    if name.endswith(".py") or "/" in name or "\\" in name:
        path = Path(name)
        if not path.is_file():
            raise UsageError(f"{what}: no such file {name!r}")
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)  # the module's own sibling imports
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise UsageError(f"{what}: cannot load {name!r} as a Python module")
        loader, module = spec.loader, importlib.util.module_from_spec(spec)
        sys.modules.setdefault(path.stem, module)
        _exec(lambda: loader.exec_module(module), name, what, own=True)
        return module
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # as `python -m` finds modules
    try:
        return _exec(lambda: importlib.import_module(name), name, what)
    except ModuleNotFoundError as error:
        raise UsageError(f"{what}: cannot import {name!r} ({error})") from None


def _exec(load: Callable[[], Any], name: str, what: str, *, own: bool = False) -> Any:
    """Run the import; `own` (a module named by its file): a ModuleNotFoundError is one of
    its own imports failing, not the module missing."""
    try:
        return load()
    except ModuleNotFoundError as error:
        if not own and error.name == name.split(".")[0]:
            raise
        raise UsageError(f"{what}: importing {name!r} failed: {error}") from None
    except SystemExit as error:
        raise UsageError(
            f"{what}: importing {name!r} called sys.exit({error.code!r}) at import; put the "
            f"module's script code under `if __name__ == '__main__':`"
        ) from None
    except Exception as error:  # noqa: BLE001 - the user's module failed on import
        first = str(error).splitlines()[0] if str(error) else ""
        raise UsageError(
            f"{what}: importing {name!r} raised {type(error).__name__}: {first}"
        ) from None


def run(args: argparse.Namespace) -> int:
    """The verb: load, check, verify, print; returns the exit status."""
    forward = load_attribute(args.forward, "MODULE:FORWARD")
    if not callable(forward):
        raise UsageError(f"{args.forward} is a {type(forward).__name__}, not a callable")
    factory = load_attribute(args.inputs, "--inputs")
    if not callable(factory):
        raise UsageError(f"--inputs {args.inputs} is a {type(factory).__name__}, not a callable")
    if args.window is not None and args.out is None:
        raise UsageError("--window narrows the trace and PNG: give --out DIR too")
    if args.out is not None:
        _check_out(args.out)
    if getattr(args, "ranks", None) is not None:
        return _run_ranks(args, forward, factory)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            "--device cuda needs a CUDA GPU, and none is present here; use --device sim"
        )
    try:
        batch = factory()
    except Exception as error:  # noqa: BLE001 - nothing can be verified without inputs
        raise UsageError(f"--inputs {args.inputs} raised {type(error).__name__}: {error}") from None
    try:
        report = verify(
            forward,
            batch,
            num_ubatches=args.ubatches,
            device=args.device,
            atol=args.atol,
            rtol=args.rtol,
            timeout=args.timeout,
            race_order=args.race_order,
        )
    except (TypeError, ValueError) as error:
        if _raised_by_verify(error):
            raise UsageError(str(error)) from None
        return _serial_failed(error)
    except Exception as error:  # noqa: BLE001 - the serial forward failed: nothing to compare
        return _serial_failed(error)
    if args.out is not None:
        _write_artifacts(report, args.out, args.window)
    _print(report, args.json)
    return 0 if report.ok else 1


def _run_ranks(args: argparse.Namespace, forward: Any, factory: Any) -> int:
    """`--ranks N`: `dbo.verify_ranks`, one report for the group."""
    unsupported = [
        flag
        for flag, given in (
            ("--out", args.out is not None),
            ("--device cuda", args.device != "sim"),
            ("--race-order adversarial", args.race_order != "issue"),
        )
        if given
    ]
    if unsupported:
        raise UsageError(f"{unsupported[0]} is not supported with --ranks yet; drop it")
    try:
        report = verify_ranks(
            forward,
            factory,
            num_ranks=args.ranks,
            num_ubatches=args.ubatches,
            atol=args.atol,
            rtol=args.rtol,
            timeout=args.timeout,
        )
    except (TypeError, ValueError, RuntimeError) as error:
        raise UsageError(str(error)) from None
    if args.json:
        print(json.dumps(report.to_dict(), allow_nan=False))
    else:
        print(report.describe())
    return 0 if report.ok else 1


def _check_out(out: str) -> None:
    """--out must be a folder that exists or can be made, and be writable, before any work:
    made and written to, since permission bits do not say it (root under /proc)."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise UsageError(f"--out {out!r} is a file, not a folder; name a folder for the artifacts")
    writable_dir(path)


def _write_artifacts(report: VerifyReport, out: str, spec: WindowSpec | None) -> None:
    window = None
    if spec is not None:
        try:
            window = spec.resolve(report.records.get("ubatched") or report.records["serial"])
        except (KeyError, ValueError) as error:
            print(f"dbo-sim: no window drawn: {error}", file=sys.stderr)
    report.write_artifacts(out, window=window)


# verify's own checks, run before any work: an error raised in one of them is a usage error.
_CHECKS = frozenset(
    {
        "_check_args",
        "_check_adversarial",
        "_check_workspace",
        "_resolve",
        "split_inputs",
        "_ubatch_inputs",
        "verify",
    }
)


def _raised_by_verify(error: BaseException) -> bool:
    """Whether verify's argument checks refused (a usage error), not the user's code: the
    innermost frame of `dbo.verify` on the traceback is one of its checks."""
    innermost = None
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_globals.get("__name__") == "dbo.verification":
            innermost = tb.tb_frame.f_code.co_name
        tb = tb.tb_next
    return innermost in _CHECKS


def _serial_failed(error: BaseException) -> int:
    if isinstance(error, UBatchTimeoutError):  # a hang has no traceback, only where it stands
        print(f"dbo.verify: FAILED: {error}", file=sys.stderr)
        print(error.stacks.get(-1, ""), file=sys.stderr, end="")
        return 1
    print("dbo.verify: FAILED: the serial forward raised; nothing to compare", file=sys.stderr)
    traceback.print_exception(error, file=sys.stderr)
    return 1


def _print(report: VerifyReport, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report.to_dict(), allow_nan=False))
    else:
        print(report.describe())
