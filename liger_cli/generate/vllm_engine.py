"""`rl.engine: vllm`: sampling on a vLLM server, token in and token out, with every weight update pushed.

The same contract as liger's own engine (`engine.py`): prompts go as ids, sampled ids come back and are
never re-tokenized; every stop id; one seed per sequence from (seed, its key), so a completion depends
on the seed, the step, its prompt and its index only; each sampled token's log-prob under the
distribution it was sampled from. vLLM reports that after temperature, top-k and top-p (renormalised
over the kept tokens), so the run's sampling keeps every token (top_p 1, top_k 0: the recipe says so)
and the log-prob is also the whole vocabulary's, the trainer's support.

Each request is one sequence with its own seed; they go concurrently and the server batches them.
Every request of a run names the current policy: a LoRA run's adapter, loaded under a new name at each
update (`policy-<version>`: vLLM serves a reused adapter id's old weights, and keys its prefix cache by
name), so base and adapter requests are never batched together (vLLM's CPU LoRA kernels apply another
slot's adapter to a request without one). Full fine-tuning reloads the weights from a safetensors folder
(`reload_weights`) and resets the prefix cache, which would otherwise serve blocks computed under the old
weights.
"""

from __future__ import annotations

import math
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from liger_cli.errors import RunFailed
from liger_cli.generate.engine import Completion, Sampling, sequence_seed
from liger_cli.generate.vllm_server import request

CONCURRENT = 64
"""Requests in flight at once (the server batches them)."""
FAULTS = "PYTEST_LIGER_VLLM_FAULT"
"""Test hook: skip_update, wrong_adapter, keep_prefix_cache (or kill_server, hang_server:
liger_cli.run.vllm_policy), to show that each is caught at once."""


class VllmEngine:
    def __init__(self, url: str, timeout: float = 600.0):
        self.url, self.timeout = url.rstrip("/"), timeout
        """Seconds one request may take (a hung server is a RunFailed, never a stalled run)."""
        models = self.ask("/v1/models")["data"]
        self.base = next(m for m in models if m.get("parent") is None)
        self.policy = self.base["id"]
        """What every request names: the base model, or the current adapter."""
        self._folders: list[Path] = []

    @property
    def max_model_len(self) -> int:
        return int(self.base.get("max_model_len") or 0)

    def complete(
        self,
        prompts: list[list[int]],
        keys: list,
        sampling: Sampling,
        stop_ids: list[int],
        policy: str | None = None,
    ):
        """One Completion per prompt, in order, sampled by `policy` (default: the current one)."""
        policy = policy or self.policy
        truncated = sampling.top_p < 1 or sampling.top_k > 0

        def one(prompt_and_key) -> Completion:
            prompt, key = prompt_and_key
            payload = {
                "model": policy, "prompt": list(prompt), "max_tokens": sampling.max_new_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k or -1,
                "seed": sequence_seed(sampling.seed, key), "logprobs": 0, "return_token_ids": True,
                "stop_token_ids": list(stop_ids), "skip_special_tokens": False, "ignore_eos": True,
            }  # fmt: skip
            choice = self.ask("/v1/completions", payload)["choices"][0]
            ids = list(choice["token_ids"])
            logprobs = [float(v) for v in choice["logprobs"]["token_logprobs"]]
            stopped = choice["finish_reason"] == "stop" and bool(ids) and ids[-1] in stop_ids
            full = [math.nan] * len(ids) if truncated and not sampling.greedy else logprobs
            return Completion(ids, "stop" if stopped else "length", logprobs, full)

        with ThreadPoolExecutor(min(CONCURRENT, max(1, len(prompts)))) as pool:
            return list(pool.map(one, zip(prompts, keys, strict=True)))

    def prompt_logprobs(self, ids: list[int]) -> list[float]:
        """The served policy's log-prob of each id after the first, given those before it (temperature 1)."""
        payload = {"model": self.policy, "prompt": list(ids), "max_tokens": 1, "temperature": 1.0,
                   "prompt_logprobs": 0, "return_token_ids": True}  # fmt: skip
        found = self.ask("/v1/completions", payload)["choices"][0]["prompt_logprobs"][1:]
        return [float(entry[str(i)]["logprob"]) for i, entry in zip(ids[1:], found, strict=True)]

    # --- the policy it serves ------------------------------------------------------------------------

    def ask(self, path: str, payload: dict | None = None) -> dict:
        return request(self.url, path, payload, self.timeout)

    def load_adapter(self, folder: Path, name: str, keep: bool = False) -> None:
        """Serve the adapter saved in `folder` (a peft adapter) under `name` (new: a reused name would serve
        the old weights), and drop the last one unless `keep` (rl.max_staleness: the caller unloads)."""
        fault = os.environ.get(FAULTS) if self._folders else None
        if fault == "skip_update":  # the new weights never arrive: the last ones served under the new name
            folder = self._folders[-1]
        elif fault == "wrong_adapter":  # another adapter (the first policy's) under the new name
            folder = self._folders[0]
        self.ask("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder.resolve())})
        previous, self.policy = self.policy, name
        if keep:
            self._folders.append(folder)
            return
        if previous != self.base["id"]:
            self.unload(previous)
        self._keep(folder)

    def unload(self, name: str) -> None:
        self.ask("/v1/unload_lora_adapter", {"lora_name": name})

    def load_weights(self, folder: Path) -> None:
        """Serve the full weights saved in `folder` (safetensors, Hugging Face names); the prefix cache is
        reset (its blocks were computed under the old weights)."""
        fault = os.environ.get(FAULTS) if self._folders else None
        if fault == "skip_update":
            return
        self.ask(
            "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(folder.resolve())}}
        )
        if fault != "keep_prefix_cache":
            self.ask("/reset_prefix_cache", {})
        self._keep(folder)

    def _keep(self, folder: Path) -> None:
        """Keep the first and the last update's folders (the first: the wrong-adapter fault's stand-in)."""
        self._folders.append(folder)
        while len(self._folders) > 2:
            shutil.rmtree(self._folders.pop(1), ignore_errors=True)


def check_served(engine: VllmEngine, tokenizer, max_seq_len: int, text_probe: str, messages_probe) -> None:
    """The server must serve this run's tokenizer (a text and, with a chat template, a conversation
    tokenize to the same ids) and hold data.max_seq_len; otherwise a RunFailed before the first step."""
    where = f"the vLLM server at {engine.url} (serving {engine.base['id']})"
    if engine.max_model_len < max_seq_len:
        raise RunFailed(f"{where} holds {engine.max_model_len} positions, fewer than data.max_seq_len "
                        f"{max_seq_len}: start it with --max-model-len {max_seq_len} or more")  # fmt: skip
    model = engine.base["id"]
    served = engine.ask("/tokenize", {"model": model, "prompt": text_probe, "add_special_tokens": False})
    ours = tokenizer(text_probe, add_special_tokens=False)["input_ids"]
    if served["tokens"] != list(ours):
        raise RunFailed(f"{where} tokenizes text differently from this run's tokenizer (another model or "
                        "vocabulary): serve the run's model")  # fmt: skip
    if messages_probe is not None:
        served = engine.ask("/tokenize", {"model": model, "messages": messages_probe,
                                                   "add_generation_prompt": True, "add_special_tokens": False})  # fmt: skip
        text = tokenizer.apply_chat_template(messages_probe, tokenize=False, add_generation_prompt=True)
        if served["tokens"] != list(tokenizer(text, add_special_tokens=False)["input_ids"]):
            raise RunFailed(f"{where} renders a conversation differently from this run's chat template: "
                            "serve the run's model and tokenizer")  # fmt: skip
