"""`python -m scenarios ...` and the `dbo-sim` console script: see scenarios.cli.

The CLI is imported inside `run`, not at the top, so that a Ctrl-C while torch is still
loading ends like any other interrupt (one line, exit status 130), not with a traceback.
"""

import sys


def run() -> None:
    try:
        from scenarios.cli import main
    except KeyboardInterrupt:
        print("dbo-sim: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    raise SystemExit(main())


if __name__ == "__main__":
    run()
