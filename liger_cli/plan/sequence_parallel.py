"""What `distributed.sequence_parallel` needs of the model, decided on its config before any weight
loads: the split (`liger_cli.run.sequence_parallel`) attends over the whole sequence with 1/N of the
heads and a mask it builds (causal, packed documents, padding), so every layer must be plain causal
attention over heads that divide by N."""

from __future__ import annotations


def unsplittable(config, degree: int) -> str | None:
    """Why this model's attention cannot be split over `degree` processes, or None."""
    text = config.get_text_config()
    if text is not config:
        return "a vision-language model is not split (its image tokens attend as the family decides)"
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    if heads % degree or kv % degree:
        return f"its {heads} attention heads and {kv} key-value heads must both be divisible by {degree}"
    window = getattr(text, "sliding_window", None) if getattr(text, "use_sliding_window", True) else None
    if set(getattr(text, "layer_types", None) or ["full_attention"]) != {"full_attention"} or window:
        return "its layers use sliding-window or chunked attention, which the split's mask does not reproduce"
    if getattr(text, "attention_dropout", 0.0):
        return "attention dropout would draw a different mask on each process of a split"
    return None


def split_note(config, degree: int, world: int) -> str:
    """The Plan's note on the split."""
    heads = config.get_text_config().num_attention_heads
    return (
        f"sequence parallel: each sequence split over {degree} processes ({world // degree} data-parallel "
        f"group(s)); attention over the whole sequence with {heads // degree} of {heads} heads on each"
    )


def split_limit(recipe) -> int:
    """The largest split (2, 4 or 8) the run could take, for the memory plan's suggestions: an objective
    the split serves under fsdp2 or ZeRO-3, attention it serves, heads divisible; 1 when none."""
    from liger_cli.model import read_config
    from liger_cli.recipe.distributed_section import SPLIT_OBJECTIVES

    d, attention = recipe.distributed, recipe.model.attn_implementation
    sharded = d.backend == "fsdp2" or (d.backend == "deepspeed" and d.zero_stage == 3)
    if (
        not sharded
        or recipe.training.objective not in SPLIT_OBJECTIVES
        or attention not in (None, "sdpa", "eager")
    ):
        return 1
    config = read_config(recipe.model.path or recipe.model.config, recipe.model.trust_remote_code)
    return max([k for k in (2, 4, 8) if unsplittable(config, k) is None], default=1)
