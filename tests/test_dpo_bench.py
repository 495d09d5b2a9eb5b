"""bench/dpo_vs_trl.py's liger side at a tiny size: it measures, reports, and starts DPO at ln 2.

TRL is not in the test environment (it lives in .venv-trl only) and is never imported here: the TRL
variant is left out. Speed is not asserted.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("dpo_vs_trl", REPO / "bench" / "dpo_vs_trl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_liger_side_reports_real_numbers_and_ln2(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    """The parent runs here (its imports are the test process's own); the liger run is its fresh process."""
    out = tmp_path / "dpo"
    code = _script().main(
        ["--variants", "liger_on", "--model-config", str(tiny_model_dir / "config.json"), "--seq-len", "64",
         "--pairs", "2", "--steps", "1", "--warmup", "1", "--repeats", "1", "--out", str(out)]
    )  # fmt: skip
    shown = capsys.readouterr()
    assert code == 0, shown.out + shown.err
    assert "the same ids on both sides" in shown.out
    assert "0.693147" in shown.out  # the step-1 loss is printed
    report = json.loads((out / "dpo_vs_trl.json").read_text())
    assert "trl" not in report["table"] and report["versions"]["trl_env"] is None
    [run] = report["runs"]
    assert run["variant"] == "liger_on" and run["measured_steps"] == 1
    assert run["step_time_s"] > 0 and run["peak_mem_mb"] > 0 and run["baseline_mb"] > 0
    assert run["tokens_per_step"] > 2 * 2 * 32  # 2 pairs = 4 rows of more than half of 64 tokens
    assert math.isclose(run["first_step_loss"], math.log(2), rel_tol=1e-4)
    pairs = [json.loads(line) for line in (out / "pairs.jsonl").read_text().splitlines()]
    assert len(pairs) == 4 and all(p["chosen"] != p["rejected"] for p in pairs)
