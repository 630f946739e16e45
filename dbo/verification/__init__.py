"""dbo.verification: the tools that check a user's forward under DBO, above the runtime, the
simulator and the workspace (none of which imports them).

`verify(forward, inputs)` runs the forward serially and ubatched and compares (`VerifyReport`);
`verify_ranks` does so on N real gloo ranks (`RanksReport`). Modules, one job each: driver
(`verify`'s phases in order), arguments (checked before any work), inputs (the batch cut into
ubatch inputs), runs (the measured steps under one workspace), compare (what "the same output"
means), report (the report and its words), race_causes (races grouped by the missing wait),
layout (where an engine runs an empty ubatch), graphs and graph_runner (steps served through
CUDA graphs), runtimes, vllm_runtime and runtime_diff (vLLM's ring beside dbo's), ranks,
rank_processes, rank_history and ranks_report (across processes), pytest_plugin (fixtures).
"""

from dbo.verification.arguments import RACE_ORDERS
from dbo.verification.driver import verify
from dbo.verification.inputs import split_inputs
from dbo.verification.ranks import RanksReport, VerifyRanksError, verify_ranks
from dbo.verification.report import RunRaces, VerifyError, VerifyReport

__all__ = [
    "RACE_ORDERS",
    "RanksReport",
    "RunRaces",
    "VerifyError",
    "VerifyRanksError",
    "VerifyReport",
    "split_inputs",
    "verify",
    "verify_ranks",
]
