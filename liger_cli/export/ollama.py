"""An Ollama Modelfile beside the GGUF: FROM the file, a stop for each token liger's engine stops at,
the model's own sampling defaults, and a TEMPLATE only where liger can write it exactly.

Exact: runs trained on text (`{{ .Prompt }}` as it is) and on instructions (liger's instruction template
around a one-line prompt; a comment says that a multi-line one is rendered otherwise by liger). A chat template is Jinja and Ollama's
templates are Go; liger does not translate one into the other, so Ollama takes the template stored in
the GGUF (it recognises the common ones) and the Modelfile says so.
"""

from __future__ import annotations

from pathlib import Path

from liger_cli.data.encode import INSTRUCTION_TEMPLATE_NO_INPUT

SAMPLING = ("temperature", "top_p", "top_k")


def modelfile(
    gguf_name: str, stop_texts: list[str], generation_config, fmt: str, projector: str | None = None
) -> str:
    lines = [f"FROM ./{gguf_name}"]
    if projector:
        lines.append(
            f"# {projector} is for llama.cpp (llama-mtmd-cli --mmproj); Ollama does not take a separate projector "
            "file for an imported model, so this Modelfile serves the language model alone (text prompts)."
        )
    for text in stop_texts:
        lines.append(f"PARAMETER stop {quoted(text)}")
    for name in SAMPLING:
        value = getattr(generation_config, name, None)
        if value is not None and getattr(generation_config, "do_sample", False):
            lines.append(f"PARAMETER {name} {value}")
    if fmt == "text":
        lines.append('TEMPLATE """{{ .Prompt }}"""')
    elif fmt == "instruction":
        template = INSTRUCTION_TEMPLATE_NO_INPUT.replace("{instruction}", "{{ .Prompt }}")
        lines.append(f'TEMPLATE """{template}"""')
        lines.append(
            "# Exact for one-line prompts: liger renders a multi-line prompt's first line as the instruction "
            "and the rest as its ### Input:, which this template does not split."
        )
    else:
        lines.append(
            "# No TEMPLATE: Ollama uses the chat template stored in the GGUF (liger does not translate Jinja "
            "templates into Ollama's Go templates)."
        )
    return "\n".join(lines) + "\n"


def quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_modelfile(folder: Path, gguf_name: str, stop_texts: list[str], generation_config, fmt: str,
                    projector: str | None = None) -> Path:  # fmt: skip
    path = folder / "Modelfile"
    path.write_text(modelfile(gguf_name, stop_texts, generation_config, fmt, projector))
    return path
