"""`python -m scenarios ...`: see scenarios.cli."""

from scenarios.cli import main

raise SystemExit(main())
