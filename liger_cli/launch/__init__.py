"""Stage 6, the launch: where the run happens. One process trains in this process; several are
started through `accelerate launch` (`multiprocess.py`), and each of them is one rank (`rank.py`).
A job on several machines is the same command on each: `liger launch` writes them, or a Slurm
script (`nodes.py`).

The launch is handed the run to start (a function), so it never imports `run`: it may import
`recipe` and `plan`.
"""

from liger_cli.launch.start import launch

__all__ = ["launch"]
