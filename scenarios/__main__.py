"""`python -m scenarios ...` and the `dbo-sim` console script: see scenarios.cli.

The CLI is imported inside `run`, not at the top, and the verb runs inside the same `try`,
so that a Ctrl-C while torch is still loading ends like any other interrupt (one line, exit
status 130), not with a traceback, and so that a Python without the project's dependencies
(not the project's venv) gets one line naming the fix instead of a `ModuleNotFoundError`
traceback, whenever the verb first imports one.
"""

import sys

_OURS = ("dbo", "workspace", "scenarios")
EXIT_NOT_INSTALLED = 1


def missing_dependency_line(name: str) -> str:
    """What to do when `name` (a dependency, not one of the project's own packages) cannot
    be imported by this Python."""
    return (
        f"dbo-sim: {name} is not installed for {sys.executable}; in the project folder run "
        "`make install`, then `. .venv/bin/activate` (or run .venv/bin/dbo-sim)"
    )


def run() -> None:
    try:
        from scenarios.cli import main

        status = main()  # a verb imports its own dependencies (torch, ...) when it runs
    except KeyboardInterrupt:
        print("dbo-sim: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except ModuleNotFoundError as error:
        top = (error.name or "").partition(".")[0]
        if not top or top in _OURS:
            raise  # our own code is broken: the traceback is the report
        print(missing_dependency_line(top), file=sys.stderr)
        raise SystemExit(EXIT_NOT_INSTALLED) from None
    raise SystemExit(status)


if __name__ == "__main__":
    run()
