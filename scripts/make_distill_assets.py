"""Rebuild recipes/distill/teacher: the teacher of recipes/distill.yaml, the quickstart recipe trained
for its full 300 steps (about 80 of the 100 held-out numbers right), its LoRA adapter merged into the
quickstart model with `liger merge` (a full model folder, 2.3 MB). The student is the quickstart model
with the half-trained recipes/grpo/sft-start adapter (about 0.47 of the held-out numbers right), and
the prompts are recipes/grpo's: `scripts/make_grpo_assets.py` rebuilds those.

    python scripts/make_distill_assets.py
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / "recipes/distill/teacher"


def liger(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "liger_cli", *args], check=True)


def make_teacher() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run, merged = Path(tmp) / "sft", Path(tmp) / "merged"
        sets = [f"output.dir={run}", "training.eval_samples=0", "logging.tensorboard=false"]
        liger("train", str(REPO / "recipes/quickstart.yaml"), *(a for s in sets for a in ("--set", s)))
        liger("merge", str(run), str(merged))
        shutil.rmtree(TARGET, ignore_errors=True)
        TARGET.mkdir(parents=True)
        for path in sorted(merged.iterdir()):  # the model and its tokenizer, nothing of the run
            if path.is_file() and not path.name.startswith(".") and path.name != "README.md":
                shutil.copyfile(path, TARGET / path.name)


if __name__ == "__main__":
    make_teacher()
