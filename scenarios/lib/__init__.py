"""What the `dbo-sim` verbs share, as a library they call: no verb imports another verb.

simulate (one whole model step on a fresh simulated device, and its times), cluster_step
(record one rank's step and replay it for a whole EP group), configs (reading a configuration:
the model and batches a verb runs, by name), trace_window (reading a `--window` and writing a
windowed trace), fidelity_rows (the published figures, the fidelity row records and the stored
run that `plan`'s error bars read), usage (the `UsageError` refusals and the checked values of
the command line), progress (the progress bar). Nothing here takes an argparse namespace: the
verbs read their arguments and pass values.
"""
