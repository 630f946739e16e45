"""dbo.analysis: what a real GPU profiler trace says DBO did.

`analyze_trace(path)` reads a `torch.profiler` Chrome trace (or one `dbo-sim` wrote) and
returns a `TraceReport`: per step the busy time of each stream, the overlap of comm under
compute, the exposed comm, the idle gaps and what the host threads did then, the kernels that
ran side by side and how much slower than alone, the layers, and a verdict in words.

Modules, one job each: reader (the file, streamed), events (each event checked and slimmed;
a malformed one skipped and counted), kernels (kernel classes), timeline (the trace as the
simulator's `OpRecord`s, cut into steps), metrics (per-step figures), sidebyside (slowdowns of
kernels sharing the GPU), layers, report (the report and its text), analyze (the phases in
order), against (a DBO step against a serial trace's), calibration (the simulator's host
costs and overlap rates from traces), profiler_form (records written as torch.profiler writes
a trace).
"""

from dbo.analysis.analyze import analyze_timeline, analyze_trace, load_timeline, step_report
from dbo.analysis.kernels import CLASSES, add_kernel_pattern, classify_kernel
from dbo.analysis.reader import TraceError
from dbo.analysis.report import StepReport, TraceReport, format_report

__all__ = [
    "CLASSES",
    "StepReport",
    "TraceError",
    "TraceReport",
    "add_kernel_pattern",
    "analyze_timeline",
    "analyze_trace",
    "classify_kernel",
    "format_report",
    "load_timeline",
    "step_report",
]
