"""`hasten bench`: hasten against its peers, measured side by side on this machine.

The command and its options: command.py. The table of workloads (B1-B8) and
the run: measure.py. docs/benchmarks.md says what each workload measures.
"""

from .command import BenchError, main
from .measure import WORKLOADS, run

__all__ = ["WORKLOADS", "BenchError", "main", "run"]
