"""scenarios: model-like DBO workloads, their verdicts, the CLI, sweeps, stress and benchmarks.

Depends on `dbo` and `workspace`; nothing imports it.
"""
