"""Every entry of the bug corpus, registered: importing this module imports each entry module
once, in the order `dbo-sim bugs` lists them."""

from scenarios.bugs import (
    dp_graphs,
    dp_modes,
    dp_ranks,
    dp_steps,
    sglang_split,
    vllm_fallback,
    vllm_graphs,
    vllm_metadata,
    vllm_wrapper,
)
from scenarios.bugs.registry import BUGS, Bug, BugResult, Verdict, run_bug

__all__ = ["BUGS", "Bug", "BugResult", "Verdict", "run_bug"]
ENTRY_MODULES = (
    vllm_metadata,
    vllm_wrapper,
    vllm_graphs,
    vllm_fallback,
    dp_ranks,
    dp_steps,
    dp_graphs,
    dp_modes,
    sglang_split,
)
