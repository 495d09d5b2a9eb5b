"""recipes/vision.yaml, the shipped vision-language example, as a user runs it: `liger train` on the tiny
LLaVA and its drawn pictures answers held-out pictures better than before (eval_sample_match), the Plan
says what trains, and the saved adapter is checked."""

from __future__ import annotations

import json
from pathlib import Path

import warm_python

REPO = Path(__file__).resolve().parents[1]


def test_the_vision_recipe_answers_unseen_pictures_better(tmp_path: Path) -> None:
    out = tmp_path / "run"
    sets = [
        f"output.dir={out}",
        "training.max_steps=100",
        "training.eval_every=100",
        "training.eval_samples=40",
    ]
    proc = warm_python.run(
        [
            "-m",
            "liger_cli",
            "train",
            REPO / "recipes" / "vision.yaml",
            *(arg for s in sets for arg in ("--set", s)),
        ],
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "vision tower (model.vision_tower): frozen" in proc.stdout
    assert "projector (model.multi_modal_projector): full" in proc.stdout
    assert "final model verified" in proc.stdout
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    match = {m["step"]: m["eval_sample_match"] for m in logged if "eval_sample_match" in m}
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    last = [s for s in samples if s["step"] == 100]
    assert len(last) == 40 and match[100] == sum(s["completion"] == s["reference"].strip() for s in last) / 40
    assert match[0] <= 0.1 and match[100] >= match[0] + 0.3, match  # 4 colours, 3 shapes: chance is ~0.3
    assert (out / "final" / "adapter_model.safetensors").is_file()
