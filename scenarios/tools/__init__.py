"""The `dbo-sim` verbs, one tool module each (`add_arguments(parser)`, `run(args)`): list, run,
sweep, stress, plan, bench, fidelity, profile, verify, gpu-check, calibrate-host, race-check,
bugs and analyze. A verb may keep helpers of its own beside it (`plan_output`, `run_table`,
`fidelity_*`, `analyze_sim`) and the options `run` and `sweep` share (`common`); what several
verbs share lives in `scenarios.lib`. No verb imports another; each is reached through the one
CLI (`scenarios.cli`), which imports only the verb it runs.
"""
