"""`training.eval_samples`: at each evaluation, greedy completions of the first N eval prompts, one
JSONL row each in `samples.jsonl` (step, prompt, completion, reference), and one of them in the log.

A prompt is exactly what training put before the answer: an eval example's tokens up to its first
learned label (the chosen side of a preference pair), so what is sampled is what the model was
trained to continue; the reference is the first learned answer. The generation engine runs on the
model as the backend wraps it (`Backend.generation`: sharded parameters gathered once per call);
every rank completes its share of the prompts, padded so that all make the same calls, and the main
process writes. Greedy decoding with the engine's own generators leaves the run's random state alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from liger_cli.data.encode import IGNORE_INDEX
from liger_cli.data.images import IMAGE_STARTS, IMAGES_COLUMN
from liger_cli.generate.engine import Sampling, generate, places_its_own_positions
from liger_cli.generate.load import run_format
from liger_cli.generate.prompts import Renderer, image_inputs
from liger_cli.recipe import Recipe

SAMPLES_FILE = "samples.jsonl"
MAX_NEW_TOKENS = 256


@dataclass
class Samples:
    prompts: list[list[int]]
    references: list[list[int]]
    tokenizer: object
    stop_ids: list[int]
    max_new_tokens: int
    out: Path
    images: list[bytes]
    """Each prompt's image tensors (b"" for none): a vision-language model sees the eval image."""

    @classmethod
    def of_run(cls, recipe: Recipe, eval_dataset, tokenizer, model) -> Samples | None:
        n = min(recipe.training.eval_samples, len(eval_dataset) if eval_dataset is not None else 0)
        if n == 0:
            return None
        rows = [eval_dataset[i] for i in range(n)]
        prefix = "chosen_" if "chosen_input_ids" in rows[0] else ""
        split = [prompt_and_answer(r[f"{prefix}input_ids"], r[f"{prefix}labels"]) for r in rows]
        # a row whose images all sit in its prompt (a later turn's image would not match the cut prompt)
        images = [r.get(IMAGES_COLUMN) or b"" for r in rows]
        own_positions = places_its_own_positions(
            model
        )  # image prompts would get wrong positions: text rows only
        keep = [i for i, r in enumerate(rows)
                if not images[i] or (not own_positions and max(r[IMAGE_STARTS]) < len(split[i][0]))]  # fmt: skip
        if not keep:
            return None
        split, images = [split[i] for i in keep], [images[i] for i in keep]
        prompts, references = [p for p, _ in split], [a for _, a in split]
        stops = Renderer(tokenizer, run_format(recipe)).stop_ids(getattr(model, "generation_config", None))
        room = recipe.data.max_seq_len - max(len(p) for p in prompts)
        return cls(
            prompts,
            references,
            tokenizer,
            stops,
            max(1, min(MAX_NEW_TOKENS, room)),
            recipe.output.dir,
            images,
        )

    def write(self, backend, model, step: int, say) -> dict[str, float]:
        """Every rank calls this; the main process appends the rows and prints the first. Returns
        `eval_sample_match` (every rank): the share of completions equal to their reference answer
        (greedy; whitespace at the ends ignored)."""
        accelerator = backend.accelerator
        world, rank = accelerator.num_processes, accelerator.process_index
        share = -(-len(self.prompts) // world)
        mine = [i % len(self.prompts) for i in range(rank * share, (rank + 1) * share)]  # padded by repeats
        prompts = [self.prompts[i] for i in mine]
        blobs = [self.images[i] for i in mine]
        inputs = image_inputs(blobs, prompts)
        with backend.generation(model) as (module, any_running):
            found = generate(
                module, prompts, Sampling(self.max_new_tokens, temperature=0),
                stop_ids=self.stop_ids, pad_id=self.tokenizer.pad_token_id, keys=mine,
                any_running=any_running, device=accelerator.device, inputs=inputs,
            )  # fmt: skip
        done = dict(zip(mine, found, strict=True))
        if world > 1:
            import torch.distributed as dist

            parts: list = [None] * world
            dist.all_gather_object(parts, done)
            done = {i: c for part in parts for i, c in part.items()}
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        rows = []
        for i, prompt in enumerate(self.prompts):
            ids = [t for t in done[i].ids if t not in self.stop_ids]
            rows.append({"step": step, "prompt": decode(prompt), "completion": decode(ids),
                         "reference": decode(self.references[i]), "finish_reason": done[i].finish_reason})  # fmt: skip
        match = sum(r["completion"].strip() == r["reference"].strip() for r in rows) / len(rows)
        if not accelerator.is_main_process:
            return {"eval_sample_match": match}
        with open(self.out / SAMPLES_FILE, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        first = rows[0]
        say(f"sample at step {step}: {first['prompt'][-60:]!r} -> {first['completion']!r} "
            f"(reference {first['reference']!r}; all {len(rows)} in {SAMPLES_FILE}, {match:.0%} match)")  # fmt: skip
        return {"eval_sample_match": match}


def prompt_and_answer(input_ids, labels) -> tuple[list[int], list[int]]:
    """The tokens before the first learned label, and the first run of learned labels."""
    input_ids, labels = list(input_ids), list(labels)
    first = next((t for t, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))
    end = next((t for t in range(first, len(labels)) if labels[t] == IGNORE_INDEX), len(labels))
    return input_ids[:first], input_ids[first:end]
