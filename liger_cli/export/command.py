"""`liger export RUN_OR_MODEL --format gguf --out DIR`: merge, write, quantize, verify, then publish.

Everything is checked before any work (the family, the tokenizer, the type, OUT), everything is written
into a temporary folder beside OUT, and that folder is renamed to OUT only after llama.cpp has
reproduced liger's tokens, template, next-token log-probs and stops on the file (`verify.py`). A failed
check leaves nothing that looks finished.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from liger_cli.errors import UserError
from liger_cli.export import runtime
from liger_cli.export.gguf_file import PLAIN_TYPES
from liger_cli.export.verify import FLOORS, PROBE_CONVERSATIONS, PROBE_TEXTS, Report

EXPORT_MARKER = ".liger-export"
EVAL_PROMPTS = 4
DTYPE_TYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


@dataclass
class Exported:
    path: Path
    report: Report
    lines: list[str] = field(default_factory=list)


def check_request(
    source: Path, out: Path, fmt: str, quant: str, min_agreement: float | None, overwrite: bool
):
    """The command line's choices, the source and OUT, checked before anything is loaded."""
    from liger_cli.generate.load import find_target
    from liger_cli.merge import check_output_folder

    if fmt != "gguf":
        raise UserError(f"--format {fmt}: liger exports gguf (llama.cpp, Ollama, LM Studio)")
    if quant not in (*PLAIN_TYPES, *runtime.QUANT_TYPES):
        raise UserError(f"--quant {quant}: choose one of {', '.join([*PLAIN_TYPES, *runtime.QUANT_TYPES])}")
    if min_agreement is not None and not 0 < min_agreement <= 1:
        raise UserError(f"--min-agreement {min_agreement}: a share in (0, 1]")
    if min_agreement is not None and quant in PLAIN_TYPES:
        raise UserError(
            f"--min-agreement goes with a quantized --quant; {quant} must match the model (bounds: docs/export.md)"
        )
    target = find_target(source)
    if target.kind not in ("final", "model"):
        raise UserError(
            f"{source} is a{'n' if target.kind == 'adapter' else ''} {target.kind}: give a finished run's folder "
            "(its adapter is merged as liger merge merges it) or a full model folder"
        )
    precious = {target.weights: "the source", target.base: "the source's base model",
                target.recipe and target.weights.parent: "the run folder"}  # fmt: skip
    out = check_output_folder(out, {k: v for k, v in precious.items() if k}, EXPORT_MARKER, overwrite, "--out",
                              "liger export")  # fmt: skip
    runtime.binding()  # installed, or a UserError saying how
    return target, out


def export_gguf(source: Path, out: Path, fmt: str = "gguf", quant: str = "f16", ollama: bool = False,
                overwrite: bool = False, min_agreement: float | None = None, max_new_tokens: int = 32,
                say=print) -> Exported:  # fmt: skip
    from liger_cli import process_state
    from liger_cli.export.families import family_of
    from liger_cli.export.gguf_projector import check_tower
    from liger_cli.export.gguf_tokenizer import describe, read_tokenizer_json
    from liger_cli.generate.load import config_source, model_folder
    from liger_cli.model import read_config

    process_state.hide_deepspeed_unless_used("none")  # nothing here trains
    process_state.quiet_libraries()
    quant = quant.lower()
    target, out = check_request(Path(source), Path(out), fmt, quant, min_agreement, overwrite)
    adapter = (target.weights / "adapter_config.json").is_file()
    config = read_config(config_source(target))
    family = family_of(config)  # before any work: the family, its tower, the tokenizer
    describe(read_tokenizer_json(target.weights))
    if family.projector:
        check_tower(config, family)
        runtime.multimodal_binding()
    if family.projector and not (model_folder(target) / "preprocessor_config.json").is_file():
        raise UserError(
            f"{model_folder(target)} has no preprocessor_config.json: a vision-language model's export needs "
            "its processor (the image size, mean and std llama.cpp is told); save it with processor.save_pretrained"
        )
    name = (target.weights.parent if target.kind == "final" else target.weights).name
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        (tmp / EXPORT_MARKER).touch()
        folder = target.weights
        if adapter:
            from liger_cli.merge import merge_adapter

            folder = tmp / "merged"
            for line in merge_adapter(target.weights.parent, folder).report(folder)[1:]:
                say(line)
        exported = write_and_verify(target, folder, tmp, name, family, quant, min_agreement, max_new_tokens,
                                    ollama, say)  # fmt: skip
        shutil.rmtree(tmp / "merged", ignore_errors=True)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    exported.path = out / exported.path.name
    return exported


def write_and_verify(target, folder: Path, tmp: Path, name: str, family, quant: str, min_agreement, max_new_tokens,
                     ollama: bool, say) -> Exported:  # fmt: skip
    """The GGUF (and Modelfile, and export.json) in `tmp`, verified; raises ExportMismatch if not."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    from liger_cli.export.gguf_file import write_gguf
    from liger_cli.export.ollama import write_modelfile
    from liger_cli.generate.load import chat_or_text
    from liger_cli.generate.prompts import Renderer, turn_end_ids
    from liger_cli.model import model_class, read_config

    tokenizer = AutoTokenizer.from_pretrained(folder)
    # The reference computes in f32 whatever the saved dtype: llama.cpp computes in f32 on a CPU.
    on_disk = read_config(folder)
    model = model_class(on_disk).from_pretrained(folder, dtype=torch.float32).eval()
    config = model.config
    saved = str(getattr(on_disk, "dtype", None) or "float32").removeprefix("torch.")
    generation = GenerationConfig.from_model_config(config)
    if (folder / "generation_config.json").is_file():
        generation = GenerationConfig.from_pretrained(folder)
    fmt = chat_or_text(target, tokenizer)
    stops = Renderer(tokenizer, fmt).stop_ids(generation)
    turn_end = next(iter(t for t in turn_end_ids(tokenizer) if t in stops), None)
    plain = quant if quant in PLAIN_TYPES else DTYPE_TYPES.get(saved, "f32")
    path = tmp / f"{name}-{plain}.gguf"
    pre = write_gguf(folder, path, config, family, tokenizer, plain, turn_end, name)
    if quant not in PLAIN_TYPES:
        quantized = tmp / f"{name}-{quant}.gguf"
        runtime.quantize(path, quantized, quant)
        path.unlink()
        path = quantized
    projector = write_projector_file(folder, tmp, name, config, family, quant) if family.projector else None
    report = verify_file(
        path, model, tokenizer, target, fmt, stops, quant, min_agreement, max_new_tokens, projector
    )
    lines = [f"wrote {path.name} ({path.stat().st_size / 2**20:.1f} MiB, {quant}, llama.cpp architecture "
             f"{family.arch.lower()}, pre-tokenizer {pre})", *summary(report, quant, tokenizer)]  # fmt: skip
    if projector:
        lines.insert(1, f"wrote {projector[1].name} (llama.cpp's projector file, {family.projector})")
    if ollama:
        texts = [tokenizer.convert_ids_to_tokens(t) for t in stops]
        write_modelfile(tmp, path.name, texts, generation, fmt, projector and projector[1].name)
        lines.append("wrote Modelfile: ollama create NAME -f Modelfile (in the output folder)")
    record = {"file": path.name, "quant": quant, "family": config.model_type, "arch": family.arch.lower(),
              "pre_tokenizer": pre, "format": fmt, "bytes": path.stat().st_size, **report.as_dict()}  # fmt: skip
    (tmp / "export.json").write_text(json.dumps(record, indent=2) + "\n")
    return Exported(path, report, lines)


def write_projector_file(folder: Path, tmp: Path, name: str, config, family, quant: str):
    """A vision-language model's tower and projector: llama.cpp's second file (f16 beside a quantized
    model). Returns the image processor (what the check encodes the probe image with) and the file."""
    from transformers import AutoImageProcessor

    from liger_cli.export.gguf_projector import write_projector

    kind = quant if quant in PLAIN_TYPES else "f16"
    image_processor = AutoImageProcessor.from_pretrained(folder)
    path = tmp / f"mmproj-{name}-{kind}.gguf"
    write_projector(folder, path, config, family, image_processor, kind)
    return image_processor, path


def verify_file(path: Path, model, tokenizer, target, fmt: str, stops: list[int], quant: str, min_agreement,
                max_new_tokens: int, projector=None) -> Report:  # fmt: skip
    from liger_cli.data.chat import render
    from liger_cli.export import verify
    from liger_cli.export.verify_image import check_image
    from liger_cli.generate.engine import Sampling, generate
    from liger_cli.generate.prompts import PromptError, Renderer

    renderer = Renderer(tokenizer, fmt)
    conversations = []
    if getattr(tokenizer, "chat_template", None):
        for messages in PROBE_CONVERSATIONS:
            try:
                render(tokenizer, messages, generation_prompt=True)
                conversations.append(messages)
            except ValueError:
                continue  # a template that refuses, e.g., a system turn
    rows = eval_rows(target)
    if fmt in ("chat", "preference"):
        rows += [{"messages": m} for m in conversations]
    else:
        rows += [{"prompt": t} for t in PROBE_TEXTS[:2]]
    texts, prompts = list(PROBE_TEXTS), []
    for row in rows:
        try:
            texts.append(renderer.text(row))
            prompts.append(renderer.ids(row))
        except (PromptError, ValueError):
            continue
    if fmt not in ("chat", "preference"):  # chat formats rendered them above, as prompts
        texts += [render(tokenizer, m, generation_prompt=True) for m in conversations]
    if not prompts:
        raise UserError(
            f"no probe prompt renders in the run's format ({fmt}): its chat template refused them all"
        )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    done = generate(
        model, prompts, Sampling(max_new_tokens=max_new_tokens, temperature=0), stop_ids=stops, pad_id=pad
    )
    context = max(len(p) for p in prompts) + max_new_tokens + 1
    report = Report()
    loaded = runtime.Runtime(path, context)
    try:
        verify.check_tokens(loaded, tokenizer, texts, report)
        verify.check_template(loaded, tokenizer, conversations, report)
        verify.check_stops(loaded, stops, [c.ids for c in done], report)
        floor = min_agreement if min_agreement is not None else FLOORS.get(quant)
        verify.check_next_tokens(loaded, model, prompts, [c.ids for c in done], quant,
                                 None if quant in PLAIN_TYPES else floor, report)  # fmt: skip
        if projector is not None:
            check_image(loaded, projector[1], model, tokenizer, projector[0], quant, report)
    finally:
        loaded.close()
    return report


def eval_rows(target) -> list[dict]:
    """The first EVAL_PROMPTS rows of the run's local eval JSONL files, answers dropped."""
    if target.recipe is None:
        return []
    rows: list[dict] = []
    for entry in target.recipe.data.entries("eval"):
        path = Path(str(entry.path))
        if path.suffix != ".jsonl" or not path.is_file():
            continue
        for line in path.read_text().splitlines():
            if len(rows) == EVAL_PROMPTS:
                return rows
            row = json.loads(line) if line.strip() else None
            if isinstance(row, dict):
                rows.append(without_answer(row))
    return rows


def without_answer(row: dict) -> dict:
    messages = row.get("messages")
    if isinstance(messages, list):
        while messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
            messages = messages[:-1]
        return {"messages": messages}
    return {k: v for k, v in row.items() if k not in ("output", "chosen", "rejected", "completion", "label")}


def summary(report: Report, quant: str, tokenizer) -> list[str]:
    tokens = f"tokens: llama.cpp tokenizes {report.texts} probe and prompt texts as the tokenizer does"
    template = "template: the file's chat template renders the run's text" if report.template == "same" else (
        "template: none (the run's tokenizer has none)")  # fmt: skip
    if quant in PLAIN_TYPES:
        ties = f"; {report.near_ties} near tie(s) within the bound" if report.near_ties else ""
        logits = (f"next tokens: at {report.positions} completion positions of {report.prompts} prompts llama.cpp's "
                  f"greedy token is liger's engine's{ties}; largest log-prob difference "
                  f"{report.largest_logprob_diff:.2g}")  # fmt: skip
    else:
        logits = (f"next tokens ({quant}): greedy agreement {report.agreement:.1%} over {report.positions} positions "
                  f"of {report.prompts} prompts, mean KL {report.mean_kl:.3g} to the unquantized model")  # fmt: skip
    stops = f"stops: llama.cpp ends generation on exactly liger's stop ids {list(report.stops)}"
    if report.extra_stops:
        pieces = ", ".join(f"{t} {tokenizer.convert_ids_to_tokens(t)!r}" for t in report.extra_stops)
        stops = (f"stops: llama.cpp ends generation on liger's stop ids {list(report.stops)} and also on {pieces}, "
                 "which it marks end-of-generation by its text (no probe completion reaches it)")  # fmt: skip
    found = ["verified in llama.cpp:", f"  {tokens}", f"  {template}", f"  {logits}", f"  {stops}"]
    if report.image_logprob_diff is not None:
        found.append(
            f"  image: llama.cpp's embeddings of a probe picture within {report.image_embedding_diff:.2g} of the "
            f"model's (relative); the next token after it within {report.image_logprob_diff:.2g} in log-prob"
        )
    return found
