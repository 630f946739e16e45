"""The tools around the workloads: benchmarks, fidelity, the GPU check, host calibration,
the sweep, the workspace stress run and the progress bar they share. Each is reached through
the one `dbo-sim` CLI (`scenarios.cli`); none is imported by the workloads themselves."""
