"""`liger chat`: talk to a trained model in the terminal, loaded and prompted as `liger generate` does.

The reply is printed token by token as the engine chooses it. A line that ends with a backslash
continues on the next line (for an `instruction` run the first line is the instruction, the rest
its input). Commands: `/reset` forgets the conversation, `/system TEXT` sets a system message (and
starts over; `/system` alone removes it), `/exit` (or end of input) leaves. Runs trained on chat
data keep the conversation; `text` and `instruction` runs have no turns, so each message is
answered on its own (the banner says so).
"""

from __future__ import annotations

import sys
from pathlib import Path

from liger_cli.generate.engine import Sampling, generate
from liger_cli.generate.load import chat_or_text, find_target, load_model, load_tokenizer_for
from liger_cli.generate.prompts import PromptError, Renderer, max_length

HELP = "/reset forgets the conversation, /system TEXT sets a system message, /exit leaves"


def chat_command(
    run_or_model: Path, adapter: Path | None, sampling: Sampling, kernels: bool, fmt: str | None,
    system: str | None, out=sys.stdout,
) -> int:  # fmt: skip
    import torch

    target = find_target(run_or_model, adapter, fmt)
    tokenizer = load_tokenizer_for(target)
    renderer = Renderer(tokenizer, chat_or_text(target, tokenizer), system)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(target, device)
    if kernels:
        from liger_cli.serve.kernels import patch_proved_kernels

        patch_proved_kernels(model, target, lambda line: (out.write(line + "\n"), out.flush()))
    stops = renderer.stop_ids(getattr(model, "generation_config", None))
    keeps_history = renderer.format in ("chat", "preference")
    say = lambda text="", end="\n": (out.write(text + end), out.flush())  # noqa: E731
    say(f"liger chat: {target.describe} (format {renderer.format}"
        f"{'' if keeps_history else ', each message answered on its own'}). {HELP}.")  # fmt: skip
    history: list[dict] = []
    turn = 0
    while (message := _read_message()) is not None:
        if message.strip() == "/exit":
            break
        if message.strip() == "/reset":
            history = []
            say("(conversation reset)")
            continue
        if message.startswith("/system"):
            renderer.system = message[len("/system") :].strip() or None
            history = []
            say(f"(system message {'set' if renderer.system else 'removed'}; conversation reset)")
            continue
        if not message.strip():
            continue
        user = {"role": "user", "content": message}
        row = {"messages": [*history, user]} if keeps_history else {"prompt": message}
        try:
            prompt = renderer.ids(row)
        except (PromptError, ValueError) as err:
            say(f"(cannot render that: {err})")
            continue
        limit = max_length(model.config)
        room = sampling.max_new_tokens if limit is None else min(sampling.max_new_tokens, limit - len(prompt))
        if room < 1:
            say(f"(the conversation is {len(prompt)} tokens, the model's limit is {limit}: /reset to go on)")
            continue
        reply = _stream_reply(model, tokenizer, prompt, sampling, room, stops, turn, say)
        turn += 1
        if keeps_history:
            history += [user, {"role": "assistant", "content": reply}]
    return 0


def _stream_reply(model, tokenizer, prompt, sampling, room, stops, turn, say) -> str:
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
             pad_id=tokenizer.pad_token_id, keys=[turn], on_token=on_token)  # fmt: skip
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
