"""A trained reward model (a `training.objective: reward` run), loaded and scoring text: `liger score` and
`rl.rewards: [{model: RUN}]` (GRPO) both call here.

A prompt and a completion are rendered exactly as the reward model's training rendered a pair's side
(`liger_cli.data.preference.encode_pair` with the completion as both answers, truncated the same way
at the run's `data.max_seq_len`): a string prompt with the tokenizer's own prefix, then the completion
and eos; a message-list prompt, or a whole conversation `{"messages": [...]}` ending with the assistant's
turn, through the reward model's own chat template. Rows are scored in batches, right-padded with the
run's pad token (the one its sequence-classification head reads past), under no_grad in eval mode.
"""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from liger_cli.errors import UserError

RECIPE_FILE = "recipe.yaml"


def check_reward_run(path: Path, what: str) -> Path:
    """The final/ folder of a finished reward-model run, found without loading anything; a one-line
    UserError naming `what` (the option that gave the path) and the fix otherwise."""
    from liger_cli.recipe.rl_section import reward_run_final

    try:
        return reward_run_final(path, what)
    except ValueError as err:
        raise UserError(str(err)) from None


class RewardModel:
    """A reward run's model, tokenizer and rendering, in eval mode."""

    def __init__(self, final: Path, device: torch.device | str | None = None):
        from pydantic import ValidationError

        from liger_cli.data.tokenizer import load_tokenizer
        from liger_cli.recipe import Recipe
        from liger_cli.recipe.schema import DistributedSection

        run = final.parent
        try:
            recipe = Recipe.model_validate(
                yaml.safe_load((run / RECIPE_FILE).read_text()), context={"base_dir": run}
            )
        except ValidationError as err:
            raise UserError(
                f"{run / RECIPE_FILE} is not a liger run's recipe: {str(err).splitlines()[0]}"
            ) from None
        self.recipe = recipe.model_copy(update={"distributed": DistributedSection()})  # one process loads it
        self.tokenizer = load_tokenizer(self.recipe)
        self.model = _load(self.recipe, final).to(device or "cpu").eval()
        self.model.requires_grad_(False)
        self.pad_id = self.tokenizer.pad_token_id
        self.max_len = self.recipe.data.max_seq_len
        self.name = str(run)

    def encode(self, prompt, completion: str | None = None) -> list[int]:
        """The ids the reward model scores: a prompt (string or messages) and its completion, or with
        `completion` None a whole conversation (`prompt` a message list ending with the assistant's turn).
        A ValueError says what is wrong with them."""
        from liger_cli.data.files import row_check
        from liger_cli.data.preference import encode_pair, truncate_pair

        def row_of(answer):
            if completion is None:
                return {"chosen": prompt, "rejected": prompt}
            if isinstance(prompt, str):
                return {"prompt": prompt, "chosen": answer, "rejected": answer}
            turn = [{"role": "assistant", "content": answer}]
            return {"prompt": prompt, "chosen": turn, "rejected": turn}

        # an empty completion (a model that stopped at once) is scored too: the row check sees a stand-in
        problem = row_check("preference")(row_of(completion or "."))
        if problem:
            raise ValueError(
                problem.replace('"chosen"', '"messages"' if completion is None else '"completion"')
            )
        row = row_of(completion)
        pair, _ = truncate_pair(encode_pair(row, self.tokenizer), self.max_len, self.tokenizer.bos_token_id)
        return pair.chosen.input_ids

    @torch.no_grad()
    def scores(self, ids: list[list[int]], batch_size: int = 16) -> list[float]:
        """Each sequence's score, in order, `batch_size` at a time."""
        from liger_cli.model.objectives.reward import sequence_scores

        device = next(self.model.parameters()).device
        found: list[float] = []
        for start in range(0, len(ids), batch_size):
            rows = ids[start : start + batch_size]
            length = max(len(r) for r in rows)
            input_ids = torch.tensor([r + [self.pad_id] * (length - len(r)) for r in rows], device=device)
            mask = torch.tensor([[1] * len(r) + [0] * (length - len(r)) for r in rows], device=device)
            found += sequence_scores(self.model, {"input_ids": input_ids, "attention_mask": mask}).tolist()
        return found


def _load(recipe, final: Path):
    """The run's final model as it trained it: the adapter (score head included) on its base built by
    the model stage, or its full sequence-classification model."""
    from liger_cli import process_state
    from liger_cli.model import load_base_model, model_class, model_dtype, read_config

    process_state.quiet_libraries()
    # whole on each rank, never partitioned by a ZeRO-3 run's init context
    with process_state.loading_alone():
        if (final / "adapter_config.json").is_file():
            from peft import PeftModel

            return PeftModel.from_pretrained(load_base_model(recipe), final)
        m = recipe.model
        return model_class(read_config(final, m.trust_remote_code)).from_pretrained(
            final, dtype=model_dtype(recipe), trust_remote_code=m.trust_remote_code
        )
