"""`liger bench`: the user's own recipe with kernels on and off, each variant a short real run
(`compare.py`), and the comparison as a table and an optional chart (`report.py`). A command on top
of the flow: it may import every stage.
"""

from liger_cli.bench.compare import bench
from liger_cli.bench.report import RunResult, compare

__all__ = ["RunResult", "bench", "compare"]
