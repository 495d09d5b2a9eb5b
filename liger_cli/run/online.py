"""What an online objective (GRPO, distillation) needs of the run: a sampler on the model as the backend wraps it,
reductions over the processes, the prompts checked, every completion written to `rollouts.jsonl`, and
evaluation by reward.

The sampler calls the one generation engine through `Backend.generation` (sharded parameters gathered
once per call; every rank keeps stepping until all are done) with the recipe's `rl` sampling
options. Every rank makes the same number of calls: each samples its own micro-batches' prompts, and
evaluation pads each rank's share of the eval prompts with repeats.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import torch

from liger_cli.data.prompts import prompt_messages
from liger_cli.data.tools import load_tools
from liger_cli.errors import UserError
from liger_cli.generate.engine import Sampling, generate
from liger_cli.generate.episodes import Segment, Trajectory, TurnRenderer, probe, run_episodes
from liger_cli.generate.prompts import Renderer
from liger_cli.generate.tool_pool import ToolPool
from liger_cli.model.objectives.online import ROLLOUTS_FILE


class TransformersEngine:
    """`rl.engine: transformers`: liger's generation engine on the model being trained, as its backend
    wraps it. It samples with the trainer's own weights, so an optimizer step needs no update here."""

    def __init__(self, backend, model, pad_id: int):
        self.backend, self.model, self.pad_id = backend, model, pad_id

    def complete(self, prompts: list[list[int]], keys: list, sampling: Sampling, stop_ids: list[int]):
        """One Completion per prompt (ids in, ids and their log-probs out), keyed for its randomness."""
        with self.backend.generation(self.model) as (module, any_running):
            return generate(
                module, prompts, sampling, stop_ids=stop_ids, pad_id=self.pad_id, keys=keys,
                any_running=any_running, device=self.backend.accelerator.device,
            )  # fmt: skip

    def check_step(self, step: int, stats: dict[str, float]) -> None:
        return None

    def update(self, version: int) -> None:
        return None

    def close(self) -> None:
        return None


class Rollouts:
    """Each optimizer step's micro-batches of an online run: sampled at the step (synchronous), or ahead of it
    in the background (rl.max_staleness > 0: `liger_cli.run.pipeline`); every completion written to
    rollouts.jsonl as its step trains. `kept`: a resumed checkpoint's state of them."""

    def __init__(self, trainer, kept: tuple[dict, dict] | None):
        recipe, data = trainer.recipe, trainer.data
        self.trainer, self.objective, self.split = trainer, trainer.objective, trainer.split
        self.sampler = Sampler(recipe, trainer.backend, trainer.model, data.tokenizer, trainer.step)
        self.ahead = None
        if recipe.rl.max_staleness:
            from liger_cli.run.pipeline import Pipeline

            self.ahead = Pipeline(trainer, self.sampler, self.examples)
        if kept is not None:  # grpo: the completions the next steps reuse, or the batches sampled ahead
            (self.ahead.restore if "pipeline" in kept[1] else self.objective.restore)(*kept)

    def examples(self, data_step: int) -> list[list[dict]]:
        """The prompt rows of a data step, one list per micro-batch."""
        accum, data = self.trainer.recipe.training.grad_accum, self.trainer.data
        return [data.examples(data_step * accum + a) for a in range(accum)]

    def batch(self, step: int) -> list[dict]:
        """The micro-batches of optimizer step `step` (from 0); its completions appended to rollouts.jsonl."""
        split, sampler, objective = self.split, self.sampler, self.objective
        reduce = split.once(sampler.reduce) if split else sampler.reduce  # a split group samples once
        if self.ahead is not None:
            micro = self.ahead.batch(step, reduce)
        else:
            micro = objective.rollout(step, self.examples(objective.data_step(step)), self.trainer.model,
                                      sampler, reduce)  # fmt: skip
        rows = sampler.gather(objective.samples if not split or split.index == 0 else [])
        write_rollouts(self.trainer.recipe.output.dir, rows, self.trainer.backend.accelerator.is_main_process)
        return micro

    def step_done(self, step: int) -> None:
        self.sampler.step_done(step, self.objective.step_stats)

    def drain(self) -> None:
        """Nothing left sampling in the background (before an evaluation uses the engine)."""
        if self.ahead is not None:
            self.ahead.drain()

    def checkpoint_state(self) -> tuple[dict, dict] | None:
        return self.ahead.checkpoint_state() if self.ahead is not None else self.objective.checkpoint_state()

    def close(self) -> None:
        """Stop the background sampler, the tool processes and the engine's server."""
        try:
            if self.ahead is not None:
                self.ahead.close()
        finally:
            self.sampler.close()


class Sampler:
    """trajectories(prompt rows, keys, greedy=False) -> Trajectories, sampled by the run's engine: one model
    turn each, or, with rl.tools or rl.environment, episodes of turns and tool calls
    (liger_cli.generate.episodes). The one interface every online objective reads its rollouts from."""

    def __init__(self, recipe, backend, model, tokenizer, version: int = 0):
        rl = recipe.rl
        self.rl, self.max_seq_len = rl, recipe.data.max_seq_len
        self.backend, self.tokenizer = backend, tokenizer
        if rl.engine == "vllm":  # a server given every weight update (liger_cli.run.vllm_policy)
            from liger_cli.run.vllm_policy import VllmPolicy

            self.engine = VllmPolicy(recipe, backend, model, tokenizer, version)
        else:
            self.engine = TransformersEngine(backend, model, tokenizer.pad_token_id)
        self.sampling = Sampling(rl.max_new_tokens, rl.temperature, rl.top_p, rl.top_k, recipe.training.seed)
        config = getattr(getattr(model, "module", model), "generation_config", None)  # every eos id it names
        self.stop_ids = Renderer(tokenizer, "chat" if tokenizer.chat_template else "text").stop_ids(config)
        self.tools = load_tools(rl)
        self.renderer = TurnRenderer(tokenizer, self.tools.schemas, self.stop_ids) if self.tools else None
        self.per_turn_why = probe(self.renderer) if self.tools else None
        """Why each model turn is its own sample (the template is not append-only), or None."""
        self.pool = (
            ToolPool(self.tools, rl.tool_workers, rl.tool_timeout, rl.tool_memory_mb) if self.tools else None
        )
        """The tool processes (started at the first call, stopped by `close`)."""
        self.tools_s = 0.0
        """Seconds this process spent in tool calls so far."""
        self.version = version
        """The trainer's policy version: optimizer steps taken (a resumed run's: its checkpoint's step)."""
        self.local = False
        """Episodes on this process alone (`using`: an engine that needs no other process to step)."""

    def __call__(
        self, prompts: list[list[int]], keys: list, greedy: bool = False, max_new_tokens: int | None = None
    ):
        sampling = replace(self.sampling, temperature=0) if greedy else self.sampling
        if max_new_tokens is not None:
            sampling = replace(sampling, max_new_tokens=max_new_tokens)
        completions = self.engine.complete(prompts, keys, sampling, self.stop_ids)
        for c in completions:  # the trainer's own weights, unless the engine says which sampled
            c.version = self.version if c.version is None else c.version
        return completions

    def trajectories(self, rows: list[dict], keys: list, greedy: bool = False) -> list[Trajectory]:
        """One trajectory per prompt row (rows repeat for a group), keyed for its randomness."""
        if self.tools is None:
            completions = self([r["prompt_ids"] for r in rows], keys, greedy)
            stops, found = set(self.stop_ids), []
            for row, key, c in zip(rows, keys, completions, strict=True):
                segment = Segment(list(row["prompt_ids"]))
                segment.add(c.ids, True, c.full_logprobs)
                text = self.tokenizer.decode([t for t in c.ids if t not in stops], skip_special_tokens=True)
                prompt = json.loads(row["prompt"])
                asked = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
                messages = [*asked, {"role": "assistant", "content": text}]
                found.append(
                    Trajectory(
                        str(key),
                        messages,
                        [segment],
                        turns=1,
                        finish_reason=c.finish_reason,
                        versions=[c.version],
                    )
                )
            return found
        found = []
        for row, key in zip(rows, keys, strict=True):
            handle = self.pool.open(json.loads(row["fields"]), row["row"] + 1)
            messages = prompt_messages(json.loads(row["prompt"]), self.tools.schemas)
            found.append(Trajectory(str(key), messages, [Segment(list(row["prompt_ids"]))], handle))
        rl = self.rl
        sample = lambda prompts, keys, n: self(prompts, keys, greedy, n)  # noqa: E731
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        stats = run_episodes(
            found, sample, self.any_live, self.renderer, append=self.per_turn_why is None,
            max_turns=rl.max_turns, max_new_tokens=rl.max_new_tokens, max_seq_len=self.max_seq_len,
            tools=self.pool, decode=decode,
        )  # fmt: skip
        for t in found:  # what the reward functions read of an environment
            t.environment = self.pool.state(t.handle)
        self.pool.close([t.handle for t in found])
        self.tools_s += stats.tools_s
        return found

    def step_done(self, step: int, stats: dict[str, float]) -> None:
        """After optimizer step `step` (counted from 1): the engine's sampling of it checked against the
        trainer (`stats`, the rollout's figures), then the new weights pushed to it (the vllm engine)."""
        self.engine.check_step(step - 1, stats)
        self.engine.update(step)
        self.version = step

    def using(self, engine) -> Sampler:
        """This sampler with another engine (rl.max_staleness's background one, `liger_cli.run.pipeline`),
        whose calls involve no other process: its episodes need no collective."""
        other = copy.copy(self)
        other.engine, other.local = engine, True
        return other

    def close(self) -> None:
        """Stop the tool processes and the engine's server."""
        if self.pool is not None:
            self.pool.shutdown()
        self.engine.close()

    @staticmethod
    def text(trajectory: Trajectory) -> str:
        """What reward functions get as the completion: the last model turn's text (its answer; a single
        turn's is its ids decoded without stop and special tokens)."""
        return str(trajectory.messages[-1].get("content") or "")

    def eval_prompts(self, dataset) -> tuple[list[dict], list[bool]]:
        """This process's share of the eval prompts, padded by repeats so every process makes the same
        calls, and which of them are real (not a repeat)."""
        world, rank = self.backend.accelerator.num_processes, self.backend.accelerator.process_index
        n = len(dataset)
        share = -(-n // world)
        mine = [i % n for i in range(rank * share, (rank + 1) * share)]
        return [dataset[i] for i in mine], [rank * share + k < n for k in range(share)]

    def any_live(self, local: bool) -> bool:
        """Whether any process still has a trajectory running."""
        if self.local:
            return local
        return bool(self.reduce(torch.tensor([float(local)]), "max")[0] > 0)

    def reduce(self, values: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """A sum (or max) over the processes, in float64 on the CPU."""
        values = values.double()
        if self.backend.accelerator.num_processes == 1:
            return values
        device = self.backend.accelerator.device
        found = values.to(device)
        kind = torch.distributed.ReduceOp.SUM if op == "sum" else torch.distributed.ReduceOp.MAX
        torch.distributed.all_reduce(found, op=kind)
        return found.cpu()

    def gather(self, items: list) -> list:
        """Every process's items, in rank order (on every process)."""
        world = self.backend.accelerator.num_processes
        if world == 1:
            return items
        parts: list = [None] * world
        torch.distributed.all_gather_object(parts, items)
        return [item for part in parts for item in part]


def check_engine(recipe) -> None:
    """rl.engine vllm without rl.vllm.server starts a server from vLLM's own environment: it must be there
    (a one-line exit 2 saying how to install it, before anything is built or written)."""
    if recipe.rl.engine == "vllm" and recipe.rl.vllm.server is None:
        from liger_cli.generate.vllm_server import vllm_python

        vllm_python()


def check_prompts(recipe, dataset, which: str) -> None:
    """Every prompt leaves rl.max_new_tokens of room within data.max_seq_len (one-line exit 2 naming the row)."""
    if dataset is None:
        return
    room = recipe.data.max_seq_len - recipe.rl.max_new_tokens
    lengths = [len(ids) for ids in dataset["prompt_ids"]]
    for i, n in enumerate(lengths):
        if n > room:
            row = dataset[i]["row"] + 1
            raise UserError(
                f"data.{which} prompt row {row}: {n} tokens, more than data.max_seq_len - rl.max_new_tokens = "
                f"{room}: shorten the prompt, raise data.max_seq_len or lower rl.max_new_tokens"
            )


def write_rollouts(out: Path, rows: list[dict], main: bool) -> None:
    if main:
        with open(out / ROLLOUTS_FILE, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def evaluate_rewards(objective, sampler: Sampler, dataset) -> dict[str, float]:
    """`eval_reward` and `eval_rewards/<function>`: one greedy trajectory per eval prompt, scored."""
    prompts, real = sampler.eval_prompts(dataset)
    trajectories = sampler.trajectories(prompts, [f"eval:{p['row']}" for p in prompts], greedy=True)
    totals, per_function = objective.score(trajectories, prompts, sampler.text)
    keep = torch.tensor(real, dtype=torch.float64)
    sums = [(torch.tensor(totals, dtype=torch.float64) * keep).sum(), keep.sum()]
    for reward in objective.rewards:
        values = per_function[reward.name]
        sums += [sum(v for v, k in zip(values, real, strict=True) if k and v is not None),
                 sum(1.0 for v, k in zip(values, real, strict=True) if k and v is not None)]  # fmt: skip
    total = sampler.reduce(torch.tensor([float(s) for s in sums], dtype=torch.float64)).tolist()
    found = {"eval_reward": total[0] / max(total[1], 1)}
    for k, reward in enumerate(objective.rewards):
        found[f"eval_rewards/{reward.name}"] = total[2 + 2 * k] / max(total[3 + 2 * k], 1)
    return found
