"""The `liger` command line: parse, call, print, exit code. Nothing heavy is imported here.

Exit codes: 0 success; 1 runtime failure; 2 user error (bad recipe, arguments, data or path);
3 `inspect-wrap --strict` found warnings.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from liger_cli.errors import RunFailed, UserError

app = typer.Typer(
    name="liger",
    help="Fine-tune LLMs from a YAML recipe: PEFT adapters, our Triton kernels, FSDP done right.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # Plain help text: rich's help formatter (with markdown) costs more to import than typer itself.
    rich_markup_mode=None,
)


def _user_errors(command):
    """Turn a UserError into one line on stderr and exit 2 (a failed check, RunFailed: exit 1): no traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        from liger_cli.process_state import silence_hub_kernel_notice

        silence_hub_kernel_notice()  # before anything imports peft (which imports bitsandbytes)
        try:
            return command(*args, **kwargs)
        except UserError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(err.exit_code) from None
        except RunFailed as err:  # a check that failed (exit 1), said in one line
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(1) from None

    return wrapper


def command(page: str, name: str | None = None):
    """A `liger` command: user errors as one line (exit 2), and its --help ends with the page explaining it."""

    def register(function):
        return app.command(name, epilog=f"Docs: docs/{page}")(_user_errors(function))

    return register


RecipeArgument = Annotated[Path, typer.Argument(help="The YAML recipe.")]
SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a recipe key, e.g. --set training.lr=1e-4 (repeatable)."),
]
DeviceMemoryOption = Annotated[str | None, typer.Option(
    "--device-memory", help="Memory of one device for the fit verdict, e.g. 80GB (default: the GPU's, when there is one).")]  # fmt: skip


def _device_memory(text: str | None) -> int | None:
    from liger_cli.plan.device_memory import detected_device_memory, parse_device_memory

    return parse_device_memory(text) if text is not None else detected_device_memory()


@command("recipes.md")
def init(
    file: Annotated[
        Path, typer.Argument(help="Where to write the recipe; an existing file is never replaced.")
    ],
    model: Annotated[Path, typer.Option(help="A local Hugging Face model folder.")],
    data: Annotated[
        str, typer.Option(help="The training data: a file, a folder of shards or a Hub dataset name.")
    ],
    objective: Annotated[str, typer.Option(help="sft, dpo or grpo (also simpo, orpo, distill).")],
    quantize: Annotated[
        str, typer.Option(help="nf4 or fp4: QLoRA, the base's linear layers in 4 bits.")
    ] = "none",
    backend: Annotated[str, typer.Option(help="none, ddp, fsdp1, fsdp2 or deepspeed.")] = "none",
) -> None:
    """Write a commented starter recipe, every key at its default, that `liger train` accepts as written."""
    from liger_cli.recipe.starter import write_starter

    write_starter(file, model, data, objective, quantize, backend)
    typer.echo(f"wrote {file}: check it with `liger train {file} --dry-run`, then edit and train")


@command("training.md")
def train(
    recipe: RecipeArgument,
    set_: SetOption = None,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Print the resolved recipe, the Plan and the memory plan, then exit."),
    ] = False,
    device_memory: DeviceMemoryOption = None,
    json_out: Annotated[bool, typer.Option("--json", help="With --dry-run: one JSON object.")] = False,
) -> None:
    """Fine-tune a model as the recipe says (one process here, or many through accelerate)."""
    from liger_cli.recipe import load_recipe

    if (device_memory is not None or json_out) and not dry_run:
        raise UserError("--device-memory and --json go with --dry-run: add --dry-run")
    memory_bytes = _device_memory(device_memory) if dry_run else None
    loaded = load_recipe(recipe, set_ or [])
    from liger_cli.process_state import hide_bitsandbytes_unless_quantized, hide_deepspeed_unless_used
    from liger_cli.recipe.rl_section import teacher_quantize

    teacher = teacher_quantize(loaded) if loaded.distill is not None else "none"
    quantized = loaded.model.quantize if teacher == "none" else teacher  # the teacher needs bitsandbytes too
    hide_bitsandbytes_unless_quantized(quantized, loaded.model.path or loaded.model.config)
    hide_deepspeed_unless_used(loaded.distributed.backend)
    if dry_run:
        from liger_cli.plan.dry_run import dry_run

        if not json_out:
            typer.echo("# resolved recipe")
            typer.echo(loaded.to_yaml())
        typer.echo(dry_run(loaded, memory_bytes, as_json=json_out))
        return
    from liger_cli.launch import launch
    from liger_cli.run.train import run

    raise typer.Exit(launch(loaded, recipe_path=recipe, overrides=set_ or [], train=run))


@command("data.md")
def data(
    recipe: Annotated[Path, typer.Argument(help="The YAML recipe whose data section to check.")],
    set_: SetOption = None,
    show: Annotated[
        int, typer.Option(help="Print the first N train examples, learned tokens highlighted.")
    ] = 0,
    jsonl: Annotated[
        Path | None,
        typer.Option(help="Write every example as training receives it before packing (input_ids, labels)."),
    ] = None,
) -> None:
    """Tokenize the recipe's data exactly as train does; report counts, tokens, what is learned, warnings."""
    if show < 0:
        raise UserError(f"--show {show}: must be 0 or more")
    if jsonl is not None and jsonl.is_dir():
        raise UserError(f"--jsonl {jsonl} is a folder: give a file path, e.g. {jsonl / 'examples.jsonl'}")
    from liger_cli.data.report import data_command

    raise typer.Exit(data_command(recipe, set_ or [], show=show, jsonl=jsonl))


@command("distributed.md", "inspect-wrap")
def inspect_wrap(
    model: Annotated[
        str | None,
        typer.Argument(help="A local model folder, a config.json, or package.module:factory."),
    ] = None,
    recipe: Annotated[Path | None, typer.Option(help="Inspect the plan this recipe would run.")] = None,
    backend: Annotated[str | None, typer.Option(help="fsdp1 or fsdp2 (default fsdp2).")] = None,
    wrap_classes: Annotated[str | None, typer.Option(help="Classes to wrap, e.g. A,B.")] = None,
    num_processes: Annotated[int | None, typer.Option(help="Ranks to shard over (per-rank sizes).")] = None,
    lora: Annotated[
        bool, typer.Option(help="Apply the default LoRA to show frozen/trainable mixing.")
    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    strict: Annotated[bool, typer.Option(help="Exit 3 when the plan has warnings.")] = False,
    device_memory: DeviceMemoryOption = None,
    vision: Annotated[
        str | None,
        typer.Option(help="A VLM's vision tower: frozen (default), lora (with --lora) or full."),
    ] = None,
) -> None:
    """Show how FSDP will shard a model, without loading weights, and warn about plans known to break."""
    from liger_cli.plan.inspect_wrap import check_arguments, inspect_command

    check_arguments(model, recipe, backend, num_processes, device_memory, vision)
    memory_bytes = _device_memory(device_memory) if recipe is not None else None
    raise typer.Exit(
        inspect_command(model=model, recipe=recipe, backend=backend, wrap_classes=wrap_classes,
                        num_processes=num_processes, lora=lora, json_out=json_out, strict=strict,
                        device_memory=memory_bytes, vision=vision)
    )  # fmt: skip


@command("distributed.md")
def launch(
    recipe: RecipeArgument,
    nodes: Annotated[int, typer.Option(help="Machines in the job.")] = 1,
    procs: Annotated[int, typer.Option(help="Processes per machine (one per GPU).")] = 1,
    main_ip: Annotated[
        str | None, typer.Option(help="The first machine's address (default: the recipe's main_process_ip).")
    ] = None,
    port: Annotated[int | None, typer.Option(help="The rendezvous port (default: the recipe's).")] = None,
    slurm: Annotated[bool, typer.Option(help="Write a Slurm batch script instead (srun).")] = False,
    out: Annotated[Path | None, typer.Option(help="Write to this file instead of printing.")] = None,
    vllm_serve: Annotated[bool, typer.Option(help="One more machine serves vLLM (rl.engine vllm).")] = False,
    vllm_ip: Annotated[str | None, typer.Option(help="--vllm-serve: that machine's address.")] = None,
    set_: SetOption = None,
) -> None:
    """Print the command each machine runs for NODES x PROCS processes of the recipe, or a Slurm script."""
    from liger_cli.launch.nodes import launch_command

    text = launch_command(recipe, set_ or [], nodes, procs, main_ip, port, slurm, out, vllm_serve, vllm_ip)
    typer.echo(f"wrote {out}" if out is not None else text, nl=out is not None)


@command("adapters.md")
def merge(
    run_dir: Annotated[Path, typer.Argument(help="A finished run's output.dir (holds the final adapter).")],
    out_dir: Annotated[Path, typer.Argument(help="Where to write the merged full model.")],
    overwrite: Annotated[bool, typer.Option(help="Replace a non-empty OUT_DIR.")] = False,
) -> None:
    """Merge a run's LoRA adapter into its base model and save the full model (save_pretrained)."""
    from liger_cli.merge import merge_adapter

    for line in merge_adapter(run_dir, out_dir, overwrite=overwrite).report(out_dir):
        typer.echo(line)


@command("export.md")
def export(
    source: Annotated[Path, typer.Argument(help="A finished run's folder (adapter merged) or a model folder.")],
    out: Annotated[Path, typer.Option("--out", help="The folder to write: the .gguf, export.json, Modelfile.")],
    format_: Annotated[str, typer.Option("--format", help="The format: gguf.")] = "gguf",
    quant: Annotated[str, typer.Option(help="f32, f16, bf16, or llama.cpp's q8_0, q6_k, q4_k_m, ...")] = "f16",
    ollama: Annotated[bool, typer.Option("--ollama", help="Also write an Ollama Modelfile.")] = False,
    min_agreement: Annotated[float | None, typer.Option(help="Quantized: the least greedy agreement.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an OUT that liger export wrote.")] = False,
) -> None:  # fmt: skip
    """Write a GGUF for llama.cpp / Ollama, verified in llama.cpp against liger's engine before it counts."""
    from liger_cli.export.command import export_gguf

    done = export_gguf(source, out, format_, quant, ollama, overwrite, min_agreement, say=typer.echo)
    typer.echo("\n".join([*done.lines, f"exported to {done.path}"]))


@command("rl.md", "vllm-serve")
def vllm_serve(
    model: Annotated[Path, typer.Argument(help="The model folder to serve (a run's base: its model.path).")],
    port: Annotated[int, typer.Option(help="The port.")] = 8000,
    host: Annotated[str, typer.Option(help="The address to bind (0.0.0.0: every interface).")] = "127.0.0.1",
    max_model_len: Annotated[int, typer.Option(help="Positions per sequence (at least data.max_seq_len).")] = 2048,
    max_lora_rank: Annotated[int, typer.Option(help="The largest adapter rank (0: full fine-tuning only).")] = 64,
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16 (the run's model.dtype).")] = "float32",
    memory: Annotated[float, typer.Option("--gpu-memory-utilization", help="The GPU memory share it takes.")] = 0.9,
) -> None:  # fmt: skip
    """Serve MODEL with vLLM for training runs elsewhere (rl.vllm.server: URL): ids in and out, runtime adapters,
    weight reload."""
    from liger_cli.generate.vllm_server import serve_command

    raise typer.Exit(serve_command(model.resolve(), port, host, max_model_len, max_lora_rank, dtype, memory))


@command("bench.md")
def bench(
    recipe: RecipeArgument,
    steps: Annotated[int, typer.Option(help="Optimizer steps measured per run.")] = 10,
    warmup: Annotated[int, typer.Option(help="Steps run before measuring (not counted).")] = 2,
    out: Annotated[
        Path | None,
        typer.Option(help="Where bench.json, bench.png and both runs go (default: OUTPUT.DIR-bench)."),
    ] = None,
    set_: SetOption = None,
) -> None:
    """Train the recipe twice in fresh processes, kernels as it says and all off; compare speed, memory, loss."""
    from liger_cli.bench import bench as run_bench

    raise typer.Exit(run_bench(recipe, set_ or [], steps=steps, warmup=warmup, out_dir=out))


SamplingOptions = dict(
    max_new_tokens=typer.Option(256, help="Most tokens generated per completion."),
    temperature=typer.Option(0.0, help="Sampling temperature; 0 is greedy."),
    top_p=typer.Option(1.0, help="Sample from the smallest set of tokens holding this much probability."),
    top_k=typer.Option(0, help="Sample from the K most likely tokens (0: all)."),
    seed=typer.Option(0, help="Same seed, same completions (on 1 process or N)."),
)
RunOrModel = Annotated[
    Path,
    typer.Argument(
        help="A run folder (its final/ or checkpoints/step-N), a model folder, or a base model with --adapter."
    ),
]
AdapterOption = Annotated[Path | None, typer.Option(help="A peft adapter folder to put on the model.")]
FormatOption = Annotated[str | None, typer.Option(
    "--format", help="How to render prompts: text, instruction, chat (default: as the run rendered its prompts).")]  # fmt: skip
KernelsOption = Annotated[bool, typer.Option(help="Patch our RMSNorm, RoPE and SwiGLU kernels in.")]
ToolsOption = Annotated[
    list[str] | None,
    typer.Option("--tools", help="A function the model may call, FILE.py:name (repeat for several)."),
]
EnvironmentOption = Annotated[
    str | None,
    typer.Option(help="A class FILE.py:Name whose public methods are the tools (one instance per prompt)."),
]
MaxTurnsOption = Annotated[int, typer.Option(min=1, help="Most model turns per prompt with tools.")]


def _sampling(max_new_tokens: int, temperature: float, top_p: float, top_k: int, seed: int):
    from liger_cli.generate.engine import Sampling

    try:
        return Sampling(max_new_tokens, temperature, top_p, top_k, seed)
    except ValueError as err:
        raise UserError(f"--{str(err).replace('_', '-')}") from None


@command("generation.md", "generate")
def generate_(
    run_or_model: RunOrModel,
    prompts: Annotated[
        Path, typer.Option(help='A JSONL file of {"prompt": ...} or {"messages": [...]} rows.')
    ],
    out: Annotated[Path, typer.Option(help="Where to write the completions (JSONL).")],
    adapter: AdapterOption = None,
    max_new_tokens: int = SamplingOptions["max_new_tokens"],
    temperature: float = SamplingOptions["temperature"],
    top_p: float = SamplingOptions["top_p"],
    top_k: int = SamplingOptions["top_k"],
    seed: int = SamplingOptions["seed"],
    num_return_sequences: Annotated[int, typer.Option(help="Completions per prompt.")] = 1,
    batch_size: Annotated[int, typer.Option(help="Sequences generated together.")] = 8,
    logprobs: Annotated[bool, typer.Option(help="Add each token's log-probability to the output.")] = False,
    format_: FormatOption = None,
    kernels: KernelsOption = False,
    tools: ToolsOption = None,
    environment: EnvironmentOption = None,
    max_turns: MaxTurnsOption = 4,
    engine: Annotated[str, typer.Option(help="transformers (liger's) or vllm (a vLLM server of its own).")] = "transformers",
) -> None:  # fmt: skip
    """Complete a file of prompts with a trained model, rendered exactly as the run trained it."""
    from liger_cli.serve.generate import Options, generate_command

    sampling = _sampling(max_new_tokens, temperature, top_p, top_k, seed)
    options = Options(sampling, num_return_sequences, batch_size, logprobs, kernels, format_, tuple(tools or ()),
                      environment, max_turns, engine)  # fmt: skip
    raise typer.Exit(generate_command(run_or_model, prompts, out, adapter, options, echo=typer.echo))


@command("objectives.md", "score")
def score_(
    run: Annotated[Path, typer.Argument(help="A reward model's run folder (training.objective reward) or its final/.")],
    prompts: Annotated[Path, typer.Option(help='A JSONL file of {"prompt", "completion"} or {"messages"} rows.')],
    out: Annotated[Path, typer.Option(help='Where to write the rows with "score" added (JSONL).')],
    batch_size: Annotated[int, typer.Option(help="Sequences scored together.")] = 16,
) -> None:  # fmt: skip
    """Score each row of a file with a trained reward model, rendered exactly as the run trained it."""
    from liger_cli.serve.score import score_command

    raise typer.Exit(score_command(run, prompts, out, batch_size, echo=typer.echo))


@command("generation.md")
def chat(
    run_or_model: RunOrModel,
    adapter: AdapterOption = None,
    max_new_tokens: int = SamplingOptions["max_new_tokens"],
    temperature: float = SamplingOptions["temperature"],
    top_p: float = SamplingOptions["top_p"],
    top_k: int = SamplingOptions["top_k"],
    seed: int = SamplingOptions["seed"],
    system: Annotated[str | None, typer.Option(help="A system message to start with.")] = None,
    format_: FormatOption = None,
    kernels: KernelsOption = False,
    image: Annotated[Path | None, typer.Option(help="An image for your first message (a vision-language run); "
                                                    "/image PATH in the chat.")] = None,
    tools: ToolsOption = None,
    environment: EnvironmentOption = None,
    max_turns: MaxTurnsOption = 4,
) -> None:  # fmt: skip
    """Chat with a trained model in the terminal; replies stream as they are generated."""
    from liger_cli.serve.chat import chat_command

    sampling = _sampling(max_new_tokens, temperature, top_p, top_k, seed)
    agent = (tuple(tools or ()), environment, max_turns)
    raise typer.Exit(
        chat_command(run_or_model, adapter, sampling, kernels, format_, system, image=image, agent=agent)
    )


def main() -> NoReturn:
    """`liger`: the command, then an exit without the interpreter's teardown (process_state.leave). A bug's
    exception is not caught: Python prints its traceback and exits 1 as usual."""
    from liger_cli.process_state import leave

    try:
        app(prog_name="liger")
    except SystemExit as done:
        leave(done.code)
    leave(0)


if __name__ == "__main__":
    sys.exit(main())
