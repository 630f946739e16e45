"""Small user-side examples: a model written outside `scenarios/` and checked with `dbo.verify`,
the pytest plugin and `dbo-sim verify` (the README's "Verify your own model")."""
