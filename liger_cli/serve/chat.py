"""`liger chat`: talk to a trained model in the terminal, loaded and prompted as `liger generate` does.

The reply is printed token by token as the engine chooses it. A line that ends with a backslash
continues on the next line (for an `instruction` run the first line is the instruction, the rest
its input). Commands: `/reset` forgets the conversation, `/system TEXT` sets a system message (and
starts over; `/system` alone removes it), `/image PATH` puts an image before your next message (a
vision-language run; `--image PATH` does so for the first), `/exit` (or end of input) leaves. Runs
trained on chat data keep the conversation, images included; `text` and `instruction` runs have no
turns, so each message is answered on its own (the banner says so).
"""

from __future__ import annotations

import sys
from pathlib import Path

from liger_cli.errors import UserError
from liger_cli.generate.engine import Sampling, generate, places_its_own_positions
from liger_cli.generate.episodes import Segment
from liger_cli.generate.load import chat_or_text, find_target, is_vision_model, load_model, load_tokenizer_for
from liger_cli.generate.prompts import PromptError, Renderer, image_inputs, max_length
from liger_cli.serve.agent import ToolSession, load_cli_tools

HELP = "/reset forgets the conversation, /system TEXT sets a system message, /exit leaves"
IMAGE_HELP = "/image PATH puts an image before your next message"


def chat_command(
    run_or_model: Path, adapter: Path | None, sampling: Sampling, kernels: bool, fmt: str | None,
    system: str | None, out=sys.stdout, image: Path | None = None, agent: tuple = ((), None, 4),
) -> int:  # fmt: skip
    import torch

    target = find_target(run_or_model, adapter, fmt)
    tokenizer = load_tokenizer_for(target)
    renderer = Renderer(tokenizer, chat_or_text(target, tokenizer), system)
    keeps_history = renderer.format in ("chat", "preference")
    images = is_vision_model(target) and keeps_history
    pending = None  # the image part the next user message starts with
    if image is not None:
        if not images:
            why = "a text-only model" if keeps_history else f"format {renderer.format}, not chat"
            raise UserError(
                f"--image {image}: {target.describe} takes no images ({why}): chat without --image, or with "
                "a vision-language run trained on chat data"
            )
        try:
            pending = image_part(image)
        except ValueError as err:
            raise UserError(f"--image {err}") from None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(target, device)
    if images and places_its_own_positions(model):  # multimodal RoPE: the engine would misplace images
        if pending is not None:
            raise UserError(
                f"--image {image}: {type(model).__name__} computes its image tokens' rotary positions itself "
                "(multimodal RoPE), which liger's generation does not do yet: chat without --image"
            )
        images = False
    if kernels:
        from liger_cli.serve.kernels import patch_proved_kernels

        patch_proved_kernels(model, target, lambda line: (out.write(line + "\n"), out.flush()))
    stops = renderer.stop_ids(getattr(model, "generation_config", None))
    say = lambda text="", end="\n": (out.write(text + end), out.flush())  # noqa: E731
    tools, environment, max_turns = agent
    toolset = load_cli_tools(list(tools), environment, tokenizer, renderer.format)
    if toolset is not None:
        if images:
            raise UserError("--tools with a vision-language model is not supported yet: chat without --tools")
        session = ToolSession(
            model, tokenizer, toolset, sampling, stops, device, max_turns, max_length(model.config)
        )
        names = ", ".join(t["function"]["name"] for t in toolset.schemas)
        say(f"(tools: {names}; up to {max_turns} model turns a message; replies print as each turn ends)")
        return _tool_chat(session, renderer, say)
    say(f"liger chat: {target.describe} (format {renderer.format}"
        f"{'' if keeps_history else ', each message answered on its own'}). {HELP}"
        f"{f'; {IMAGE_HELP}' if images else ''}.")  # fmt: skip
    history: list[dict] = []
    turn = 0
    while (message := _read_message()) is not None:
        if message.strip() == "/exit":
            break
        if message.strip() == "/reset":
            history, pending = [], None
            say("(conversation reset)")
            continue
        if message.startswith("/image"):
            pending = _next_image(message[len("/image") :].strip(), images, pending, say)
            continue
        if message.startswith("/system"):
            renderer.system = message[len("/system") :].strip() or None
            history = []
            say(f"(system message {'set' if renderer.system else 'removed'}; conversation reset)")
            continue
        if not message.strip():
            continue
        content = [pending, {"type": "text", "text": message}] if pending else message
        user = {"role": "user", "content": content}
        row = {"messages": [*history, user]} if keeps_history else {"prompt": message}
        try:
            prompt, blob = renderer.encode(row, None)
        except (PromptError, ValueError, UserError) as err:
            say(f"(cannot render that: {err})")
            continue
        limit = max_length(model.config)
        room = sampling.max_new_tokens if limit is None else min(sampling.max_new_tokens, limit - len(prompt))
        if room < 1:
            say(f"(the conversation is {len(prompt)} tokens, the model's limit is {limit}: /reset to go on)")
            continue
        reply = _stream_reply(model, tokenizer, prompt, sampling, room, stops, turn, say, blob)
        turn += 1
        pending = None
        if keeps_history:
            history += [user, {"role": "assistant", "content": reply}]
    return 0


def _tool_chat(session, renderer: Renderer, say) -> int:
    """The conversation as one trajectory, token in and token out as training built it: each message's
    ids appended as the template renders them, each model turn's ids as sampled, tool results between."""
    trajectory, count = None, 0
    say(f"liger chat with tools. {HELP}.")
    while (message := _read_message()) is not None:
        command = message.strip()
        if command == "/exit":
            break
        if command == "/reset" or command.startswith("/system"):
            if command.startswith("/system"):
                renderer.system = command[len("/system") :].strip() or None
            if trajectory is not None:
                session.end([trajectory])
            trajectory = None
            say("(conversation reset)")
            continue
        if not command:
            continue
        user = {"role": "user", "content": message}
        if trajectory is None:
            first = [{"role": "system", "content": renderer.system}] if renderer.system else []
            trajectory = session.start([*first, user], "", {}, 1)
        else:
            added = (
                session.renderer.environment_ids(trajectory.messages, [user])
                if session.per_turn_why is None
                else None
            )
            if added is None:
                trajectory.segments.append(
                    Segment(session.renderer.encode([*trajectory.messages, user], True))
                )
            else:
                trajectory.segments[-1].add(added, False)
            trajectory.messages.append(user)
        trajectory.key, trajectory.finish_reason, count = f"chat{count}", None, count + 1
        before = len(trajectory.messages)
        session.run([trajectory])
        for m in trajectory.messages[before:]:
            if m["role"] == "tool":
                say(f"[{m['name']} -> {m['content']}]")
                continue
            calls = "".join(
                f" [call {c['function']['name']}({c['function']['arguments']})]"
                for c in m.get("tool_calls", [])
            )
            say(f"{m['content']}{calls}")
        if trajectory.finish_reason == "length":
            say("(the conversation reached the model's length or --max-new-tokens: /reset to go on)")
            session.end([trajectory])
            trajectory = None
    return 0


def image_part(path: Path) -> dict:
    """The image part a user message starts with; a ValueError naming the file and what is wrong."""
    from liger_cli.data.images import open_image

    path = Path(path).expanduser().resolve()
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(
            f"{path}: cannot read it ({err.strerror}); give an image file (PNG, JPEG, ...)"
        ) from None
    try:
        open_image(data).load()
    except Exception as err:  # noqa: BLE001 - any PIL failure is the user's file, named
        raise ValueError(f"{path} is not an image PIL can read ({err}); give a PNG, JPEG, ... file") from None
    return {"type": "image", "path": str(path)}


def _next_image(argument: str, images: bool, pending: dict | None, say) -> dict | None:
    """`/image PATH`: the image part for the next message (the one pending when refused)."""
    if not images:
        say("(this model takes no images: /image needs a vision-language run trained on chat data)")
        return pending
    if not argument:
        say("(/image PATH: give an image file, e.g. /image photo.png)")
        return pending
    try:
        part = image_part(Path(argument))
    except ValueError as err:
        say(f"(cannot use that image: {err})")
        return pending
    say(f"(image {argument} goes with your next message)")
    return part


def _stream_reply(model, tokenizer, prompt, sampling, room, stops, turn, say, images=b"") -> str:
    """Generate one reply, printing each new piece of text as its token is chosen."""
    from dataclasses import replace

    ids: list[int] = []
    shown = ""

    def on_token(_row: int, token: int) -> None:
        nonlocal shown
        ids.append(token)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # half of a multi-byte character: wait for the rest
            say(text[len(shown) :], end="")
            shown = text

    say("model> ", end="")
    # Each turn its own sampling key, so a resampled turn differs from the one before.
    generate(model, [prompt], replace(sampling, max_new_tokens=room), stop_ids=stops,
             pad_id=tokenizer.pad_token_id, keys=[turn], on_token=on_token,
             inputs=image_inputs([images], [prompt]))  # fmt: skip
    say()
    return tokenizer.decode([t for t in ids if t not in stops], skip_special_tokens=True)


def _read_message() -> str | None:
    """One message; lines ending in a backslash continue it. None at end of input."""
    lines = []
    prompt = "you> "
    while True:
        try:
            line = input(prompt)
        except EOFError:
            return "\n".join(lines) if lines else None
        if line.endswith("\\"):
            lines.append(line[:-1])
            prompt = "...> "
            continue
        lines.append(line)
        return "\n".join(lines)
