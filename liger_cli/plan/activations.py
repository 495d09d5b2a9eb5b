"""What one micro-batch's forward keeps for backward, measured on the meta device.

The model is run as the run will run it (adapter, our kernels) on a batch of meta tensors, under
`saved_tensors_hooks`: every tensor autograd saves is counted once (views of one tensor count as
their base), parameters not at all. Nothing is allocated, so a 70B model answers in seconds.

Two things a meta forward cannot do are stood in for:
- data-dependent checks (`mask.all()`, packed-sequence detection) read no data: a meta scalar reads
  as True, i.e. "no padding, no packing", which is what a full training batch is;
- scaled-dot-product attention on meta would take the math path and keep the [T, T] scores; the
  fused kernels a run uses (flash / memory-efficient, on a CPU too) keep q, k, v, the output and one
  fp32 log-sum-exp per query, so the stand-in counts exactly those.

A model whose forward still cannot run on meta (e.g. data-dependent routing) gets no measurement:
the caller says so instead of guessing.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(frozen=True)
class Activations:
    """Bytes saved for backward by one micro-batch (batch x seq_len tokens)."""

    total: int
    per_layer: tuple[int, ...]
    """Saved inside each decoder layer (the FSDP wrap class instances), in order."""
    layer_input: int
    """One layer's input (hidden states): what checkpointing keeps per layer."""

    @property
    def outside_layers(self) -> int:
        return self.total - sum(self.per_layer)

    def checkpointed(self) -> int:
        """Kept with every layer checkpointed: each layer's input, plus the largest layer's own
        activations while it is recomputed in backward."""
        if not self.per_layer:
            return self.total
        return self.outside_layers + len(self.per_layer) * self.layer_input + max(self.per_layer)


class _MetaScalarsAreTrue(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return True if args[0].dtype == torch.bool else 1
        return func(*args, **(kwargs or {}))


class _Saved:
    """Bytes of distinct non-parameter tensors, with a running total layers can read."""

    def __init__(self, model: nn.Module):
        self.params = {id(p) for p in model.parameters()}
        self.kept: dict[int, torch.Tensor] = {}  # holding them keeps ids unique
        self.bytes = 0

    def note(self, t: torch.Tensor) -> None:
        base = t._base if t._base is not None else t
        if id(base) in self.params or id(t) in self.params or id(base) in self.kept:
            return
        self.kept[id(base)] = base
        self.bytes += base.numel() * base.element_size()


@contextmanager
def _fused_attention(saved: _Saved):
    """F.scaled_dot_product_attention as a fused kernel keeps it: q, k, v, out, fp32 log-sum-exp."""
    real = torch.nn.functional.scaled_dot_product_attention

    def stand_in(q, k, v, *args, **kwargs):
        out = q.mul(0.0)  # connected to q for autograd, saves nothing itself
        if v.shape[-1] != q.shape[-1]:
            out = out[..., : v.shape[-1]].contiguous()
        for t in (q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32)):
            saved.note(t)
        return out

    torch.nn.functional.scaled_dot_product_attention = stand_in
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = real


def measure_activations(
    model: nn.Module, layers: list[nn.Module], batch: int, seq_len: int, meta_batch: dict | None = None
) -> Activations:
    """Run one training-mode forward of the meta `model` on [batch, seq_len] tokens, without labels
    (the loss and its logits are the loss component's), and count what autograd keeps. `meta_batch`: the
    meta batch when it is more than token ids (a VLM's pictures: `image_inputs.meta_image_batch`)."""
    saved = _Saved(model)
    per_layer = [0] * len(layers)
    inputs: list[int] = []

    def before(index):
        def hook(module, args, kwargs):
            hidden = args[0] if args else next(iter(kwargs.values()))
            inputs.append(hidden.numel() * hidden.element_size())
            per_layer[index] -= saved.bytes

        return hook

    def after(index):
        def hook(module, args, kwargs, output):
            per_layer[index] += saved.bytes

        return hook

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(before(i), with_kwargs=True))
        handles.append(layer.register_forward_hook(after(i), with_kwargs=True))
    meta_batch = meta_batch or {"input_ids": torch.zeros(batch, seq_len, dtype=torch.long, device="meta")}
    was_training = model.training
    model.train()
    try:
        with (
            _MetaScalarsAreTrue(),
            _fused_attention(saved),
            torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.note(t), t)[1], lambda t: t),
        ):
            model(**meta_batch, attention_mask=torch.ones_like(meta_batch["input_ids"]))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return Activations(total=saved.bytes, per_layer=tuple(per_layer), layer_input=max(inputs, default=0))
