"""`liger generate`: completions of a JSONL file of prompts, written as JSONL in input order.

Each input row gives `--num-return-sequences` output rows: the input row's fields unchanged, plus
`completion` (the text, without the stop token), `completion_ids` (the stop token included),
`finish_reason` (`stop` / `length`), `sample_index` when there are several, and with `--logprobs`
`logprobs` (each token under the distribution it was sampled from). With `--tools` (or `--environment`)
each row is a trajectory of up to `--max-turns` model turns with tool calls between them, run as
training runs them (liger_cli.serve.agent): `completion` is the last turn's text, `completion_ids` every
id after the prompt with `completion_mask` (1 sampled, 0 the environment's), and `messages`, `turns`,
`tool_calls`, `tool_errors`, `finish_reason` (`stop`, `max_turns`, `length`).

A chat row's user turn may hold image parts (`{"type": "image", "path": ...}` relative to the prompts
file, or a data: URI), as training data does: the run's processor renders and expands them
(`Renderer.encode`), and each batch's image tensors go to the prompts' forward.

Under `accelerate launch` the batches are dealt to the processes in turn; every completion depends only
on its prompt, the seed and its place in the file (`engine.py`), so N processes write what one does.
Rank 0 gathers the rows and writes the file, under a temporary name renamed into place.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from liger_cli.errors import UserError
from liger_cli.generate.engine import Completion, Sampling, generate, places_its_own_positions
from liger_cli.generate.load import chat_or_text, find_target, is_vision_model, load_model, load_tokenizer_for
from liger_cli.generate.prompts import (
    PromptError,
    Renderer,
    image_inputs,
    image_row,
    max_length,
    read_prompts,
)
from liger_cli.serve.agent import ToolSession, conversation, load_cli_tools, trajectory_fields


@dataclass(frozen=True)
class Options:
    sampling: Sampling
    num_return_sequences: int = 1
    batch_size: int = 8
    logprobs: bool = False
    kernels: bool = False
    format: str | None = None
    tools: tuple[str, ...] = ()
    """`FILE.py:name` functions the model may call (liger_cli.serve.agent)."""
    environment: str | None = None
    max_turns: int = 4
    engine: str = "transformers"
    """transformers (liger's engine on the loaded model) or vllm (a vLLM server started for the command)."""


def check_options(options: Options) -> None:
    if options.engine not in ("transformers", "vllm"):
        raise UserError(f"--engine {options.engine}: choose transformers or vllm")
    if options.num_return_sequences < 1 or options.batch_size < 1:
        raise UserError("--num-return-sequences and --batch-size must be at least 1")
    if options.num_return_sequences > 1 and options.sampling.greedy:
        raise UserError(
            f"--num-return-sequences {options.num_return_sequences} with --temperature 0 (greedy) gives "
            "identical completions: set --temperature above 0"
        )


def generate_command(
    run_or_model: Path, prompts: Path, out: Path, adapter: Path | None, options: Options, echo=print
) -> int:
    check_options(options)
    _check_out(out, prompts)
    target = find_target(run_or_model, adapter, options.format)
    rows = read_prompts(prompts)
    tokenizer = load_tokenizer_for(target)
    renderer = Renderer(tokenizer, chat_or_text(target, tokenizer))
    prompt_ids, images = render_all(renderer, rows, prompts, target)
    rank, world, device = _processes()
    model = load_model(target, device)
    if options.kernels:
        from liger_cli.serve.kernels import patch_proved_kernels

        patch_proved_kernels(model, target, echo if rank == 0 else lambda *_: None)
    check_lengths(prompt_ids, options.sampling.max_new_tokens, model.config, prompts)
    if any(images) and places_its_own_positions(model):  # on every rank, before any rank generates
        row = next(i for i, blob in enumerate(images, 1) if blob)
        raise UserError(
            f"{prompts} row {row}: an image prompt, but {type(model).__name__} computes its image tokens' "
            "rotary positions itself (multimodal RoPE), which liger's generation does not do yet: give "
            "text-only prompts"
        )
    stops = renderer.stop_ids(getattr(model, "generation_config", None))
    toolset = load_cli_tools(list(options.tools), options.environment, tokenizer, renderer.format)
    # --engine vllm: a server of its own (it dies with this process, however it ends)
    engine = _vllm(target, options, world, any(images), prompt_ids) if options.engine == "vllm" else None
    if toolset is not None:
        if any(images):
            raise UserError(f"{prompts}: image prompts with --tools are not supported yet; give text prompts")
        session = ToolSession(model, tokenizer, toolset, options.sampling, stops, device, options.max_turns,
                              max_length(model.config))  # fmt: skip
        messages = [conversation(renderer, row) for row in rows]
        prompt_ids = [session.renderer.encode(m, generation_prompt=True) for m in messages]
        check_lengths(prompt_ids, options.sampling.max_new_tokens, model.config, prompts)

    n = options.num_return_sequences
    sequences = [(i, r) for i in range(len(rows)) for r in range(n)]
    batches = [sequences[k : k + options.batch_size] for k in range(0, len(sequences), options.batch_size)]
    mine = batches[rank::world]
    done: dict[tuple[int, int], Completion] = {}
    progress = _progress(sum(len(b) for b in mine), rank)
    tokens, start = 0, time.perf_counter()
    for batch in mine:
        batch_ids = [prompt_ids[i] for i, _ in batch]
        if toolset is not None:  # episodes: turns, tool calls and results, token in and token out
            found = [session.start(messages[i], i * n + r, _fields(rows[i]), i + 1) for i, r in batch]
            session.run(found)
            session.end(found)
            done.update(zip(batch, found, strict=True))
            tokens += sum(sum(t.segments[0].mask) for t in found)
            progress.update(len(batch))
            continue
        keys = [i * n + r for i, r in batch]
        found = engine.complete(batch_ids, keys, options.sampling, stops) if engine else generate(
            model, batch_ids, options.sampling, stop_ids=stops, pad_id=tokenizer.pad_token_id,
            keys=keys, device=device, inputs=image_inputs([images[i] for i, _ in batch], batch_ids),
        )  # fmt: skip
        done.update(zip(batch, found, strict=True))
        tokens += sum(len(c.ids) for c in found)
        progress.update(len(batch))
        progress.set_postfix_str(f"{tokens / max(time.perf_counter() - start, 1e-9):.1f} tokens/s")
    progress.close()
    if engine is not None:
        engine.server.stop()
    done = _gathered(done, world)
    if rank == 0:
        _write(out, [output_row(rows[i], done[(i, r)], tokenizer, r if n > 1 else None, options.logprobs)
                     for i, r in sequences])  # fmt: skip
        elapsed = time.perf_counter() - start
        total = sum(
            len(c.ids) if isinstance(c, Completion) else sum(c.segments[0].mask) for c in done.values()
        )
        echo(f"wrote {len(sequences)} completions to {out} ({total} tokens, {total / max(elapsed, 1e-9):.1f} tokens/s"
             f"{f' over {world} processes' if world > 1 else ''}; model: {target.describe}, format {renderer.format}"
             f"{', engine vllm' if engine else ''})")  # fmt: skip
    return 0


def _vllm(target, options: Options, world: int, images: bool, prompt_ids):
    """--engine vllm: a vLLM server (liger_cli.generate.vllm_server) on the model folder, the adapter loaded
    on it when there is one; what it cannot do yet is refused before it starts."""
    from liger_cli.generate.load import model_folder
    from liger_cli.generate.vllm_engine import VllmEngine
    from liger_cli.generate.vllm_server import free_port, server_command, server_env, start

    if world > 1 or options.tools or options.environment or images or target.kind == "checkpoint":
        raise UserError("--engine vllm generates in one process from a model or an adapter (a run's final/), "
                        "without --tools and images: drop --engine vllm for the rest")  # fmt: skip
    if options.sampling.top_p < 1 or options.sampling.top_k > 0:
        raise UserError("--engine vllm reports log-probs over the tokens --top-p/--top-k keep: use --top-p 1 "
                        "--top-k 0 with it, or liger's engine")  # fmt: skip
    adapter = target.kind == "adapter" or (target.recipe is not None and target.recipe.adapter.type != "none")
    folder = Path(model_folder(target)).resolve()
    rank = json.loads((target.weights / "adapter_config.json").read_text())["r"] if adapter else 0
    length = max(len(ids) for ids in prompt_ids) + options.sampling.max_new_tokens
    command = server_command(folder, free_port(), dtype=_served_dtype(target, folder), max_model_len=length,
                             max_lora_rank=rank)  # fmt: skip
    log = Path(tempfile.mkdtemp(prefix="liger-vllm-")) / "server.log"
    server = start(command, log, server_env())
    engine = VllmEngine(server.url)
    engine.server = server  # stopped by generate_command
    if adapter:
        engine.load_adapter(target.weights, "generate")
    return engine


def _served_dtype(target, folder: Path) -> str:
    """The dtype liger's engine would load the target in: a run's model.dtype (auto: float32), else the
    model's own config (vLLM's own `auto` would serve an fp32 model in fp16)."""
    if target.recipe is not None:
        from liger_cli.recipe.vllm_section import served_dtype

        return served_dtype(target.recipe)
    config = json.loads((folder / "config.json").read_text())
    found = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return found if found in ("float32", "bfloat16", "float16") else "float32"


def render_all(
    renderer: Renderer, rows: list[dict], source: Path, target
) -> tuple[list[list[int]], list[bytes]]:
    """Every row's prompt ids and image tensors (b"" for a text row); image paths are relative to the
    prompts file's folder."""
    pictured = [line for line, row in enumerate(rows, 1) if image_row(row)]
    if pictured and not is_vision_model(target):
        raise UserError(
            f"{source} row {pictured[0]}: an image prompt, but {target.describe} is a text-only model (no "
            "vision tower): give its rows without image parts, or a vision-language run"
        )
    ids, images = [], []
    for line, row in enumerate(rows, 1):
        try:
            found, blob = renderer.encode(row, source.parent.resolve())
        except (PromptError, ValueError, UserError) as err:  # a UserError: the model's processor
            raise UserError(f"{source} row {line}: {err}") from None
        ids.append(found)
        images.append(blob)
    return ids, images


def check_lengths(prompt_ids: list[list[int]], max_new_tokens: int, config, source) -> None:
    limit = max_length(config)
    if limit is None:
        return
    for line, ids in enumerate(prompt_ids, 1):
        if len(ids) + max_new_tokens > limit:
            raise UserError(
                f"{source} row {line}: its {len(ids)} prompt tokens + --max-new-tokens {max_new_tokens} exceed "
                f"the model's maximum length {limit}: lower --max-new-tokens or shorten the prompt"
            )


def output_row(row: dict, completion, tokenizer, sample: int | None, logprobs: bool) -> dict:
    if not isinstance(completion, Completion):  # a trajectory with tools
        out = {**row, **trajectory_fields(completion)}
        return out | ({"sample_index": sample} if sample is not None else {})
    text_ids = completion.ids[:-1] if completion.finish_reason == "stop" else completion.ids
    out = {**row, "completion": tokenizer.decode(text_ids, skip_special_tokens=True),
           "completion_ids": completion.ids, "finish_reason": completion.finish_reason}  # fmt: skip
    if sample is not None:
        out["sample_index"] = sample
    if logprobs:
        out["logprobs"] = [round(v, 6) for v in completion.logprobs]
    return out


def _fields(row: dict) -> dict:
    """A row's fields an environment is built from: all but the prompt itself."""
    return {k: v for k, v in row.items() if k not in ("prompt", "messages")}


def _check_out(out: Path, prompts: Path) -> None:
    if out.is_dir():
        raise UserError(f"--out {out} is a folder: give a file path, e.g. {out / 'completions.jsonl'}")
    if out.resolve() == prompts.resolve():
        raise UserError(f"--out {out} is the prompts file: choose another file")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: its folder {out.parent} does not exist")


def _processes():
    """(rank, world, device): one process, or those `accelerate launch` started."""
    import torch

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())  # gloo on a CPU
    return state.process_index, state.num_processes, state.device


def _gathered(done: dict, world: int) -> dict:
    if world == 1:
        return done
    import torch.distributed as dist

    parts: list = [None] * world
    dist.all_gather_object(parts, done)
    return {key: value for part in parts for key, value in part.items()}


def _progress(total: int, rank: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="seq", desc="generating", disable=rank != 0 or not sys.stderr.isatty())


def _write(out: Path, rows: list[dict]) -> None:
    """Whole or not at all: a temporary file beside OUT, renamed into place."""
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
