"""What an objective adds to the memory plan: the sequences per example, its reference, and
sampling's KV cache (GRPO)."""

from __future__ import annotations

from liger_cli.recipe import Recipe


def rows_per_example(recipe: Recipe) -> int:
    """Sequences in one forward per example: 2 for a preference pair, G completions for GRPO; 2 for KTO,
    counted as its nearest neighbour DPO (the completion with gradients, and its mismatched sequence in
    the step's no-grad pass before it; a bound: that pass keeps no activations)."""
    objective = recipe.training.objective
    if objective == "grpo":
        return recipe.rl.num_generations if recipe.rl else 1
    return 1 if objective == "sft" else 2


def reference(recipe: Recipe) -> str | None:
    """DPO's and KTO's: "pass" (the adapter off, no_grad) or "table" (precomputed, full fine-tuning); GRPO's with
    beta > 0: "pass", or "copy" with full fine-tuning (the starting weights, stored like the parameters)."""
    full = recipe.adapter.type == "none"
    if recipe.training.objective in ("dpo", "kto"):
        return "table" if full else "pass"
    if recipe.training.objective == "grpo" and recipe.rl is not None and recipe.rl.beta > 0:
        return "copy" if full else "pass"
    return None


def kv_cache_bytes(recipe: Recipe) -> int:
    """GRPO: keys and values of every layer for a micro-batch's completions at data.max_seq_len, in the
    model's dtype (0 for the other objectives)."""
    from liger_cli.model import model_dtype, read_config

    if recipe.training.objective != "grpo":
        return 0
    config = read_config(recipe.model.path or recipe.model.config, recipe.model.trust_remote_code)
    text = getattr(config, "get_text_config", lambda: config)()
    layers, heads = getattr(text, "num_hidden_layers", 0), getattr(text, "num_attention_heads", 0)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else 0)
    rows = recipe.training.micro_batch_size * recipe.rl.num_generations
    return 2 * layers * kv_heads * head_dim * rows * recipe.data.max_seq_len * model_dtype(recipe).itemsize
