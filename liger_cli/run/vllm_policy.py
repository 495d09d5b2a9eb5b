"""The run's side of `rl.engine: vllm`: the server (its own, or rl.vllm.server's), checked before the first
step, and the policy it serves kept equal to the one being trained.

The main process starts the run's own server (127.0.0.1, a free port; it dies with the run) and tells
the others its URL. Before the first step, and after every optimizer step, the policy is pushed: every
process gathers the trained weights the backend's way (`backend.full_state_dict`: FSDP and ZeRO-3 shards
too), the main process saves them (a LoRA run: its adapter in peft's format, served under a new name;
full fine-tuning: the whole model as safetensors, a tied lm_head written out, reloaded in place and the
prefix cache reset) and the server loads them; then every process names the new policy in its requests.
Proof that it worked costs nothing: GRPO compares every sampled token's log-prob with the trainer's
(`sampler/abs_logp_diff`, logged each step); past `rl.vllm.max_logp_diff` the run stops (`check_step`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import uuid
from pathlib import Path

import torch

from liger_cli.errors import RunFailed
from liger_cli.generate.vllm_engine import FAULTS, VllmEngine, check_served
from liger_cli.generate.vllm_server import free_port, server_command, server_env, start, wait_healthy
from liger_cli.recipe.vllm_section import vllm_server_options

FOLDER = ".vllm"
"""In the run's output folder: the server's log and the last pushed policies (removed at the end)."""
PROBE = "Hello world: 12 + 30 = 42."
"""The text whose ids the server must tokenize as the run does, and then score as the trainer does."""
DEFAULT_BOUND = {torch.float32: 1e-3}
"""rl.vllm.max_logp_diff's default by the model's dtype; 5e-2 for the others (not measured: no GPU yet)."""


class VllmPolicy:
    """The engine behind the run's Sampler when rl.engine is vllm (`complete`), and its updates."""

    def __init__(self, recipe, backend, model, tokenizer, version: int = 0):
        self.backend, self.model = backend, model
        accelerator = backend.accelerator
        self.main = accelerator.is_main_process
        self.folder = recipe.output.dir / FOLDER
        self.adapter = recipe.adapter.type != "none"
        self.server = None
        self.keep_versions = False
        """rl.max_staleness: earlier policies stay served until `release` (their batches are still sampling)."""
        self.kept: list[int] = []
        self.version = version
        url, timeout = recipe.rl.vllm.server, recipe.rl.vllm.timeout
        if url is None and self.main:  # the run's own server
            self.folder.mkdir(parents=True, exist_ok=True)
            options = vllm_server_options(recipe)
            command = server_command(
                port=free_port(), gpu_memory_utilization=recipe.rl.vllm.gpu_memory_utilization, **options
            )
            self.server = start(command, self.folder / "server.log", server_env())
            url = self.server.url
        elif self.main:  # another's, perhaps still starting on its node (`liger launch --vllm-serve`)
            wait_healthy(url, timeout)
        tag = f"liger-{uuid.uuid4().hex[:8]}"  # this run's adapter names: another run's are not ours
        if accelerator.num_processes > 1:
            found = [url, tag]
            torch.distributed.broadcast_object_list(found, src=0)
            url, tag = found
        dtype = next(p for p in model.parameters()).dtype
        self.bound = recipe.rl.vllm.max_logp_diff or DEFAULT_BOUND.get(dtype, 5e-2)
        try:  # a server refused is left as found (its own stopped, another's without our adapter)
            self.engine, self.tag = VllmEngine(url, timeout), tag
            if self.main:
                probe = [{"role": "user", "content": "What is 2 + 2?"}] if tokenizer.chat_template else None
                check_served(self.engine, tokenizer, recipe.data.max_seq_len, PROBE, probe)
            self.update(version)
            self.check_policy(tokenizer(PROBE, add_special_tokens=False)["input_ids"])
        except BaseException:
            self.close()
            raise

    def complete(self, prompts, keys, sampling, stop_ids):
        return self.engine.complete(prompts, keys, sampling, stop_ids)

    def update(self, version: int) -> None:
        """Push the trained weights as policy `version` (every process: the gather is collective)."""
        fault = os.environ.get(FAULTS) if version == 2 else None  # the test hooks: between steps 1 and 2,
        if fault == "kill_server" and self.server is not None:  # the run's own server dies
            self.server.stop()
        elif fault == "hang_server":  # or the server hangs: it takes every request and never answers
            self._hole = socket.create_server(("127.0.0.1", 0))
            self.engine.url = f"http://127.0.0.1:{self._hole.getsockname()[1]}"
        state = self.backend.full_state_dict(self.model)
        accelerator = self.backend.accelerator
        if self.main:
            where = self.folder / f"policy-{version}"
            shutil.rmtree(where, ignore_errors=True)
            if self.adapter:
                self.backend.model_to_save(self.model).save_pretrained(
                    where, state_dict=state, safe_serialization=True
                )
                self.engine.load_adapter(where, self.name(version), keep=self.keep_versions)
                if self.keep_versions:
                    self.kept.append(version)
            else:
                _save_weights(state, where)
                self.engine.load_weights(where)
        accelerator.wait_for_everyone()
        if self.adapter:  # every process names the new adapter in its requests
            self.engine.policy = self.name(version)
        self.version = version

    def name(self, version: int) -> str:
        """The served name of policy `version` (a LoRA run's)."""
        return f"{self.tag}-{version}"

    def release(self, oldest: int) -> None:
        """rl.max_staleness: the policies before `oldest` are no longer asked for: unloaded, folders removed."""
        if not (self.main and self.keep_versions):
            return
        for version in [v for v in self.kept if v < oldest]:
            self.engine.unload(self.name(version))
            shutil.rmtree(self.folder / f"policy-{version}", ignore_errors=True)
            self.kept.remove(version)

    def check_policy(self, text_ids: list[int]) -> None:
        """Before the first step, the served policy is the trainer's: its log-probs of a fixed sequence (a
        text, the vocabulary's last id, the text again) agree within the bound. Another model with the same
        tokenizer, or a smaller vocabulary, is refused here (every process raises the same RunFailed)."""
        vocab = self.backend.accelerator.unwrap_model(self.model).config.vocab_size
        ids = [*text_ids, vocab - 1, *text_ids]
        with self.backend.generation(self.model) as (module, _), torch.no_grad():
            was_training = module.training
            module.eval()  # no dropout: the policy as it samples
            device = self.backend.accelerator.device
            logits = module(input_ids=torch.tensor([ids], device=device)).logits[0, :-1].double().cpu()
            module.train(was_training)
        ours = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        error = None
        if self.main:
            where = f"the vLLM server at {self.engine.url} (serving {self.engine.base['id']})"
            try:
                served = torch.tensor(self.engine.prompt_logprobs(ids), dtype=torch.float64)
                diff = (served - ours).abs().mean().item()
                if diff > self.bound:
                    error = (f"{where} computes other log-probs than the model being trained (mean |diff| "
                             f"{diff:.3g} over a probe of {len(ids)} tokens, bound {self.bound:g}): serve the "
                             "run's model")  # fmt: skip
            except RunFailed as err:
                if "out of vocabulary" not in str(err):
                    raise
                error = (f"{where} has a smaller vocabulary than the model being trained ({vocab} tokens: it "
                         f"refuses id {vocab - 1}): serve the run's model")  # fmt: skip
        found = [error]
        if self.backend.accelerator.num_processes > 1:
            torch.distributed.broadcast_object_list(found, src=0)
        if found[0] is not None:
            raise RunFailed(found[0])

    def check_step(self, step: int, stats: dict[str, float]) -> None:
        """A step whose sampled tokens the trainer scores far from the sampler: the engine serves another
        policy (an update lost, the wrong adapter, a stale cache): stop, the last checkpoint kept."""
        diff = stats.get("sampler/abs_logp_diff")
        if diff is not None and diff > self.bound:
            raise RunFailed(
                f"stale vLLM engine at step {step + 1}: its log-probs differ from the trainer's by {diff:.3g} on "
                f"average (bound {self.bound:g}, rl.vllm.max_logp_diff): it does not serve the policy being "
                "trained; the last checkpoint is kept"
            )

    def close(self) -> None:
        """Stop the run's own server; on another's, unload the run's adapter (best effort: it may be down)."""
        engine = getattr(self, "engine", None)
        if self.server is not None:
            self.server.stop()
        elif self.main and self.adapter and engine is not None and engine.policy != engine.base["id"]:
            for version in {*self.kept, self.version}:
                with contextlib.suppress(RunFailed):
                    self.engine.unload(self.name(version))
        if self.main:
            shutil.rmtree(self.folder, ignore_errors=True)


def _save_weights(state: dict, where: Path) -> None:
    """The full model's weights as one safetensors file with Hugging Face names, lm_head written out even
    when it is tied to the embeddings (vLLM's reload keeps an lm_head it is not given)."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
    if "lm_head.weight" not in tensors:  # tied: the embeddings are the head
        embedding = next(k for k in tensors if k.endswith("embed_tokens.weight"))
        tensors["lm_head.weight"] = tensors[embedding].clone()
    where.mkdir(parents=True)
    save_file(tensors, str(where / "model.safetensors"), metadata={"format": "pt"})
