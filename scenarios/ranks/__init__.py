"""Scenarios across processes: one rank per process, each a DBO step with real EP all-to-all."""
