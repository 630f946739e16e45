"""A corpus of real DBO bugs from vLLM's and SGLang's trackers, each rebuilt small with its
buggy and fixed variant and caught by this project's tools (`dbo-sim bugs`; docs/bugs.md).

`scenarios.bugs.catalog` imports every entry module and so fills the registry
(`scenarios.bugs.registry.BUGS`); this package imports nothing, so that a rank process of a
DP entry starts without the others.
"""
