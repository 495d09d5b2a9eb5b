"""Rebuild recipes/agent/: the prompts (keys of the made-up table in recipes/agent/tools.py) and the SFT
warm start the agent recipe begins from (`model/`: the quickstart model trained on whole tool conversations for a few
steps, so it calls the tool and copies its result on some held-out prompts and RL has room to grow).

    python scripts/make_agent_assets.py [--steps N]

Keys: 150 for the SFT conversations, 100 for the RL prompts, 50 held out for evaluation (never trained on).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
AGENT = REPO / "recipes/agent"
QUESTION = "What is the code for {key}?"


def load_tools():
    spec = importlib.util.spec_from_file_location("agent_tools", AGENT / "tools.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_data() -> None:
    from transformers.utils import get_json_schema

    tools = load_tools()
    keys = list(tools.TABLE)
    sft, train, held = keys[:150], keys[150:250], keys[250:]
    schema = [get_json_schema(tools.lookup)]
    with open(AGENT / "sft.jsonl", "w") as f:
        for key in sft:
            call = {"type": "function", "function": {"name": "lookup", "arguments": {"key": key}}}
            messages = [
                {"role": "user", "content": QUESTION.format(key=key)},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "lookup", "content": tools.TABLE[key]},
                {"role": "assistant", "content": tools.TABLE[key]},
            ]
            f.write(json.dumps({"messages": messages, "tools": schema}) + "\n")
    for name, part in (("train", train), ("eval", held)):
        with open(AGENT / f"{name}.jsonl", "w") as f:
            for key in part:
                f.write(json.dumps({"prompt": QUESTION.format(key=key), "answer": tools.TABLE[key]}) + "\n")


def train_warm_start(steps: int) -> None:
    """recipes/agent/model: the quickstart model fully fine-tuned on the SFT conversations (the tool-call
    tokens were never trained in the base model, which an adapter alone learns slowly), with the agent
    tokenizer and its tools-capable chat template."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sft"
        argv = [sys.executable, "-m", "liger_cli", "train", str(AGENT / "sft.yaml")]
        subprocess.run(
            [*argv, "--set", f"training.max_steps={steps}", "--set", f"output.dir={out}"], check=True
        )
        target = AGENT / "model"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(out / "final", target)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    write_data()
    train_warm_start(args.steps)
