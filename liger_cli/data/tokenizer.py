"""The recipe's tokenizer: `model.tokenizer`, or the model's own folder; a pad token when it has none."""

from __future__ import annotations

from liger_cli.data.images import remember_model
from liger_cli.errors import UserError
from liger_cli.recipe import Recipe


def load_tokenizer(recipe: Recipe):
    from transformers import AutoTokenizer

    source = recipe.model.tokenizer or recipe.model.path
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=recipe.model.trust_remote_code)
    except (OSError, ValueError) as err:
        raise UserError(
            f"cannot load a tokenizer from {source}: {err}; set model.tokenizer to a tokenizer folder"
        ) from None
    remember_model(tokenizer, recipe.model.path, recipe.model.trust_remote_code)  # images' processor
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
