"""Rebuild recipes/grpo/: the prompt files (the quickstart's rows as GRPO prompts with their answers)
and the SFT adapter GRPO starts from (`sft-start/`: the quickstart recipe trained for 150 steps instead
of 300, so it answers about half of the held-out numbers and GRPO has room to raise that).

    python scripts/make_grpo_assets.py
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = (
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"  # the instruction format's
)


def write_prompts() -> None:
    for split in ("train", "eval"):
        rows = [
            json.loads(line)
            for line in (REPO / "recipes/quickstart/data" / f"{split}.jsonl").read_text().splitlines()
        ]
        with open(REPO / "recipes/grpo" / f"{split}.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps({"prompt": TEMPLATE.format(**r), "answer": r["output"]}) + "\n")


def train_start_adapter() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sft"
        sets = [
            "training.max_steps=150",
            f"output.dir={out}",
            "training.eval_samples=0",
            "training.eval_every=null",
        ]
        argv = [sys.executable, "-m", "liger_cli", "train", str(REPO / "recipes/quickstart.yaml")]
        subprocess.run([*argv, *(a for s in sets for a in ("--set", s))], check=True)
        target = REPO / "recipes/grpo/sft-start"
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        shutil.copy(out / "final/adapter_model.safetensors", target)
        config = json.loads((out / "final/adapter_config.json").read_text())
        config["base_model_name_or_path"] = (
            "recipes/quickstart/model"  # relative: the repo's, not this machine's
        )
        (target / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


if __name__ == "__main__":
    write_prompts()
    train_start_adapter()
