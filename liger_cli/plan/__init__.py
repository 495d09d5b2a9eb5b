"""Stage 5, the plan: every decision the launcher makes, made once and printed (`decide.py`).

The backend's facts (`backends.py`), the FSDP wrap plan (`wrap/`), the per-rank memory plan
(`memory.py`, activations measured by `activations.py`, a VLM's on pictures too: `image_inputs.py`),
`inspect-wrap` (`inspect_wrap.py`) and `--dry-run` (`dry_run.py`) all read the same frozen Plan. May
import every earlier stage (`recipe`, `data`, `model`, `twin`), never `launch` or `run`.
"""

from liger_cli.plan.decide import Applied, Plan, build_plan, render_with

__all__ = ["Applied", "Plan", "build_plan", "render_with"]
