"""The run's data, set up before the model: the tokenizer, the train and eval datasets (tokenized once
per machine through the cache, `shared_data.py`) or the train stream (`data.streaming`), and which
examples this rank takes at each micro-batch. Every row is checked here, before anything is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from liger_cli.data import build_datasets
from liger_cli.data.batches import StepBatches, image_filler, total_steps, with_filler
from liger_cli.data.build import build_eval_dataset
from liger_cli.data.stream import StreamBatches, encoded_stream
from liger_cli.data.tokenizer import load_tokenizer
from liger_cli.data.tools import tool_schemas
from liger_cli.errors import UserError
from liger_cli.recipe import Recipe
from liger_cli.run.shared_data import build_once


@dataclass
class Data:
    tokenizer: object
    train: object
    """The train Dataset; None when streaming (`batches` reads the stream)."""
    eval: object | None
    batches: StepBatches | StreamBatches
    total_steps: int
    filler: dict | None = None
    """An image row with nothing to learn, added to a text-only micro-batch of a multi-process run on
    image data (`batches.with_filler`); None otherwise."""

    def examples(self, g: int) -> list[dict]:
        """This rank's examples of the run's micro-batch g."""
        if isinstance(self.batches, StreamBatches):
            return self.batches.examples(g)
        return with_filler([self.train[i] for i in self.batches.indices(g)], self.filler)

    def position(self) -> dict:
        """What a checkpoint records of where the data is besides the step number (the stream's place)."""
        return {"stream": self.batches.position()} if isinstance(self.batches, StreamBatches) else {}


def load_data(recipe: Recipe, accelerator) -> Data:
    """Tokenizer and datasets, all checked before the model is built; this rank's batches."""
    t = recipe.training
    tokenizer = load_tokenizer(recipe)
    if recipe.data.streaming:
        return load_stream(recipe, accelerator, tokenizer)
    tools = tool_schemas(recipe.rl)  # prompts describe the tools a multi-turn run's model may call
    train_ds, eval_ds = build_once(
        accelerator, recipe.data, lambda: build_datasets(recipe.data, tokenizer, t.seed, tools)
    )
    world, rank = data_shares(accelerator, recipe.distributed.sequence_parallel)
    batches = StepBatches(len(train_ds), t.micro_batch_size, world, rank, t.seed)
    if batches.micro_per_epoch == 0:
        raise UserError(
            f"data.train has {len(train_ds)} usable examples, fewer than one global micro-batch "
            f"({t.micro_batch_size} x {world} data-parallel processes): lower training.micro_batch_size"
        )
    steps = total_steps(t, batches)
    if recipe.rl is not None and not t.max_steps:  # epochs of prompts: each batch serves num_iterations steps
        steps *= recipe.rl.num_iterations
    filler = (image_filler(train_ds) or image_filler(eval_ds)) if accelerator.num_processes > 1 else None
    return Data(tokenizer, train_ds, eval_ds, batches, steps, filler)


def data_shares(accelerator, split_degree: int = 1) -> tuple[int, int]:
    """(how many micro-batches a step's global batch is cut into per accumulation step, which one this
    process takes): one per process, or one per sequence-parallel group of `split_degree` processes,
    which share it (training, evaluation and the reference table alike)."""
    return accelerator.num_processes // split_degree, accelerator.process_index // split_degree


def load_stream(recipe: Recipe, accelerator, tokenizer) -> Data:
    """`data.streaming`: the eval data built whole (it is small), the train data a stream (`stream.py`)
    whose first rows are read now, so that a bad first row fails before the model is built."""
    t, d = recipe.training, recipe.data
    eval_ds = build_once(accelerator, d, lambda: build_eval_dataset(d, tokenizer, t.seed))
    source = d.entries()[0]
    fmt = source.format or d.format

    def open_stream(position: dict):
        return encoded_stream(source.path, fmt, d, tokenizer, position)

    next(iter(open_stream(StreamBatches.START)), None)
    world, rank = data_shares(accelerator, recipe.distributed.sequence_parallel)
    return Data(
        tokenizer, None, eval_ds, StreamBatches(open_stream, t.micro_batch_size, world, rank), t.max_steps
    )
