"""What an objective adds to the memory plan: the sequences per example, its reference, sampling's
KV cache (GRPO, distill) and the teacher (distill)."""

from __future__ import annotations

from liger_cli.recipe import Recipe


def rows_per_example(recipe: Recipe) -> int:
    """Sequences in one forward per example: 2 for a preference pair, G completions for GRPO; 2 for KTO,
    counted as its nearest neighbour DPO (the completion with gradients, and its mismatched sequence in
    the step's no-grad pass before it; a bound: that pass keeps no activations)."""
    objective = recipe.training.objective
    if objective in ("grpo", "distill"):
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

    if recipe.training.objective not in ("grpo", "distill"):
        return 0
    config = read_config(recipe.model.path or recipe.model.config, recipe.model.trust_remote_code)
    text = getattr(config, "get_text_config", lambda: config)()
    layers, heads = getattr(text, "num_hidden_layers", 0), getattr(text, "num_attention_heads", 0)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else 0)
    rows = recipe.training.micro_batch_size * recipe.rl.num_generations
    return 2 * layers * kv_heads * head_dim * rows * recipe.data.max_seq_len * model_dtype(recipe).itemsize


def teacher_bytes(recipe: Recipe, device: str) -> int:
    """distill: the teacher's weights as it loads them (its dtype, or 4 bits; under FSDP-2 a share of its
    decoder layers and one layer gathered at a time, else all of it on every process), and
    its final hidden states for the step's micro-batches of completions at data.max_seq_len (held from
    sampling to each one's loss); 0 for the other objectives."""
    if recipe.training.objective != "distill":
        return 0
    import torch

    from liger_cli.model import meta_model_from_config
    from liger_cli.model.quantize import four_bit_sizes
    from liger_cli.model.teacher import teacher_dtype
    from liger_cli.recipe.rl_section import teacher_quantize

    dtype = teacher_dtype(recipe, torch.device(device))
    meta = meta_model_from_config(recipe.distill.teacher, dtype=dtype)
    four_bit = four_bit_sizes(meta, double=True) if teacher_quantize(recipe) != "none" else {}
    # (bytes that shard, bytes whole on each process): a 4-bit weight's packed bytes, then its statistics
    parts = lambda p: four_bit[id(p)] if id(p) in four_bit else (p.numel() * dtype.itemsize, 0)  # noqa: E731
    weights = sum(sum(parts(p)) for p in meta.parameters())
    d = recipe.distributed
    world = d.num_processes * d.num_machines
    if d.frozen_model_kept_whole() is None:  # its decoder layers sharded (Backend.shard_frozen)
        from liger_cli.plan.wrap import resolve_wrap_classes

        classes = set(resolve_wrap_classes(meta, None, env={}).classes)
        layers = [
            sum(parts(p)[0] for p in m.parameters()) for m in meta.modules() if type(m).__name__ in classes
        ]
        weights += -sum(layers) + -(-sum(layers) // world) + max(layers, default=0)  # + one gathered layer
    width = meta.config.get_text_config().hidden_size
    t = recipe.training
    rows = t.micro_batch_size * t.grad_accum * recipe.rl.num_generations
    return weights + rows * recipe.data.max_seq_len * width * dtype.itemsize
