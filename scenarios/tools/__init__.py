"""The `dbo-sim` verbs, one tool module each (`add_arguments(parser)`, `run(args)`): list, run,
sweep, stress, bench, fidelity, profile, verify, gpu-check, calibrate-host and race-check,
with what they share (the options of run and sweep, the `UsageError` refusals, the progress
bar). Each is reached through the one CLI (`scenarios.cli`); none is imported by the
workloads themselves."""
