"""What locating assistant turns costs: `encode_chat` (one rendering per turn, the reference) and
`encode_chats` (one rendering per row where the template allows it, what `liger data` and `liger train`
run) against rendering + tokenizing once.

    python bench/chat_masking.py [--rows 500]

For each template family of tests/test_chat_templates.py, encodes the same conversations (a system
prompt and three user/assistant exchanges, with reasoning on every assistant turn) with
`liger_cli.data.chat.encode_chat`, and, as the baseline measured in the same run, with one
`apply_chat_template(tokenize=True)` per conversation (what any chat pipeline has to do at least).
Prints seconds per 1,000 conversations and the ratio. Prefix-stable templates render each turn's
prefix twice more; Qwen3-style ones (earlier turns render differently) also render edited copies.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_chat_templates import family_tokenizer  # noqa: E402

from liger_cli.data.chat import encode_chat  # noqa: E402
from liger_cli.data.chat_batch import encode_chats  # noqa: E402


def conversations(n: int) -> list[dict]:
    rows = []
    for k in range(n):
        messages = [{"role": "system", "content": "Write numbers in words."}]
        for j in range(3):
            number = 100 + 7 * k + j
            messages.append({"role": "user", "content": f"What is {number} in words?"})
            messages.append(
                {
                    "role": "assistant",
                    "reasoning_content": f"{number} has three digits.",
                    "content": f"n{number}",
                }
            )
        rows.append({"messages": messages})
    return rows


def seconds(fn, rows) -> float:
    start = time.perf_counter()
    for row in rows:
        fn(row)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=500)
    rows = conversations(parser.parse_args().rows)
    print(
        f"{'family':<8} {'baseline s/1k':>14} {'encode_chat s/1k':>17} {'ratio':>6} {'encode_chats s/1k':>18} {'ratio':>6}"
    )
    for family in ("chatml", "qwen3", "llama3", "gemma", "mistral", "marked"):
        tok = family_tokenizer(family)
        base = seconds(lambda r, t=tok: t.apply_chat_template(r["messages"], tokenize=True), rows)
        ours = seconds(lambda r, t=tok: encode_chat(r, t), rows)
        start = time.perf_counter()
        encode_chats(rows, tok)
        batched = time.perf_counter() - start
        scale = 1000 / len(rows)
        print(f"{family:<8} {base * scale:>14.2f} {ours * scale:>17.2f} {ours / base:>6.1f} "
              f"{batched * scale:>18.2f} {batched / base:>6.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
