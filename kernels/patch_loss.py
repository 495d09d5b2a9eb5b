"""The loss kernels in a causal LM: cross-entropy, and fused linear cross-entropy inside the model's own
forward.

Fused linear cross-entropy (FLCE) never builds the `[tokens, vocab]` logits. It does not replace the
causal-LM forward with a copy of our own: the model's own forward runs, so everything it does between
the decoder and the loss (a hidden-state multiplier, slicing, a router auxiliary loss added after the
loss) happens exactly as written. Only two calls are intercepted while training with labels:

- `self.lm_head(h)` returns `DeferredLogits(h)`, a stand-in that holds the head's input instead of
  logits, and allows nothing but being passed on (and reading its shape, or `.float()`);
- `self.loss_function(logits, labels, ...)`, given that stand-in, computes our fused loss from `h` and
  `lm_head.weight`: the same math as transformers' `ForCausalLMLoss`, labels shifted the same way.

A forward that does anything else with the logits (soft-capping, scaling, its own loss) touches the
stand-in, which raises: such a model is found at patch time by a probe (a stub decoder, no weights
used) and left unpatched with the reason; at run time the same guard makes it an error, never a silent
change of the loss. The loss runs inside the causal-LM module's forward, where FSDP has gathered
`lm_head.weight`.
"""

from __future__ import annotations

import inspect
import types

import torch
from torch import nn

from . import _probe
from .cross_entropy import cross_entropy
from .fused_linear_cross_entropy import fused_linear_cross_entropy

# Config attributes of logit transforms the fused loss cannot express: named in the reason when set
# (the probe below finds every other transform; a plain scale by a number is reproduced exactly).
LOGIT_TRANSFORMS = ("final_logit_softcapping",)


class LogitsTransformed(TypeError):
    """The model's forward used the logits for more than handing them to its loss function."""


class DeferredLogits:
    """What `lm_head` returns during a fused forward: its input, not `[tokens, vocab]` logits.

    Multiplying or dividing the logits by a number is allowed and exact: `(h @ W.T) * s` is
    `(h * s) @ W.T`, so the factor moves onto the hidden state (a head with a bias refuses it).
    """

    def __init__(self, hidden: torch.Tensor, lm_head: nn.Module):
        self.hidden = hidden
        self.lm_head = lm_head

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.hidden.shape[:-1], self.lm_head.out_features))

    @property
    def dtype(self) -> torch.dtype:
        return self.hidden.dtype

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def float(self) -> DeferredLogits:
        return self  # the fused loss computes in fp32 anyway

    def _scaled(self, factor) -> DeferredLogits:
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or self.lm_head.bias is not None:
            raise LogitsTransformed(f"the forward combines the logits with {type(factor).__name__}")
        return DeferredLogits(self.hidden * factor, self.lm_head)

    def __mul__(self, factor):
        return self._scaled(factor)

    __rmul__ = __mul__

    def __truediv__(self, divisor):
        if isinstance(divisor, (int, float)) and not isinstance(divisor, bool) and divisor != 0:
            return self._scaled(1.0 / divisor)
        raise LogitsTransformed(f"the forward divides the logits by {type(divisor).__name__}")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise LogitsTransformed(f"the forward uses logits.{name} before its loss")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise LogitsTransformed(f"the forward applies {getattr(func, '__name__', func)} to the logits")

    def _refuse(self, *args):
        raise LogitsTransformed("the forward does arithmetic on or indexes the logits before its loss")

    __add__ = __radd__ = __sub__ = __rsub__ = __rtruediv__ = __pow__ = __neg__ = __getitem__ = _refuse


def _shifted_labels(labels, shift_labels, ignore_index):
    """transformers' ForCausalLMLoss shift: token t predicts label t+1; the last position is ignored."""
    if shift_labels is not None:
        return shift_labels
    return nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _divide_by_items(loss, num_items_in_batch):
    if num_items_in_batch is None:
        return loss
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def causal_lm_cross_entropy(
    logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs
):
    """transformers' ForCausalLMLoss with our cross-entropy kernel (same signature, same numbers)."""
    targets = _shifted_labels(labels, shift_labels, ignore_index).reshape(-1).to(logits.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = cross_entropy(logits.reshape(-1, vocab_size), targets, ignore_index, reduction)
    return _divide_by_items(loss, num_items_in_batch)


def sequence_logprobs_loss(
    logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs
):
    """A loss_function for the preference objectives: per row, the summed log-probability of its learned
    tokens and their count, stacked as [2, rows] (fp32), same shift as ForCausalLMLoss.

    Given lm_head's deferred input (our fused loss patched in), it never builds the logits
    (`fused_linear_logprob`); given real logits, it takes their log-softmax.
    """
    from .fused_linear_logprob import fused_linear_logprob
    from .fused_linear_logprob import shift_labels as shift

    if isinstance(logits, DeferredLogits):
        hidden, head = logits.hidden, logits.lm_head
        targets = shift_labels if shift_labels is not None else shift(labels, ignore_index)
        logp, count = fused_linear_logprob(
            hidden, head.weight, targets.to(hidden.device), head.bias, ignore_index=ignore_index, shift=False
        )
    else:
        targets = (shift_labels if shift_labels is not None else shift(labels, ignore_index)).to(
            logits.device
        )
        learned = targets != ignore_index
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        picked = logprobs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        logp, count = (picked * learned).sum(-1), learned.sum(-1)
    return torch.stack([logp, count.to(logp.dtype)])


sequence_logprobs_loss.liger_logprobs = True  # log-probs, not a loss: wanted in eval mode too


def token_logprobs_loss(temperature: float = 1.0):
    """A loss_function for online RL: per position, the log-probability of the next label under
    log_softmax(logits / temperature), and whether it is learned, stacked as [2, rows, T] (fp32), same
    shift as ForCausalLMLoss. Fused (never the logits) when handed lm_head's deferred input."""
    from .fused_linear_logprob import fused_linear_token_logprob
    from .fused_linear_logprob import shift_labels as shift

    def loss_function(
        logits,
        labels,
        vocab_size=None,
        num_items_in_batch=None,
        ignore_index=-100,
        shift_labels=None,
        **kwargs,
    ):
        if isinstance(logits, DeferredLogits):
            hidden, head = logits.hidden, logits.lm_head
            targets = shift_labels if shift_labels is not None else shift(labels, ignore_index)
            logp, learned = fused_linear_token_logprob(
                hidden, head.weight, targets.to(hidden.device), head.bias, ignore_index=ignore_index, shift=False,
                temperature=temperature,
            )  # fmt: skip
        else:
            targets = (shift_labels if shift_labels is not None else shift(labels, ignore_index)).to(
                logits.device
            )
            learned = targets != ignore_index
            logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
            logp = logprobs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * learned
        return torch.stack([logp, learned.to(logp.dtype)])

    loss_function.liger_logprobs = True
    return loss_function


def _loss_function_refusal(causal_lm: nn.Module) -> str | None:
    """Why the model's loss is not transformers' ForCausalLMLoss (the math our losses reproduce)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    name = type(causal_lm).__name__
    forward = getattr(inspect.unwrap(type(causal_lm).forward), "__code__", None)
    if forward is None or "loss_function" not in forward.co_names:
        return f"{name}.forward does not compute its loss through loss_function"
    current = causal_lm.loss_function
    if current not in (ForCausalLMLoss, causal_lm_cross_entropy):
        return f"{name}'s loss_function is {getattr(current, '__name__', current)}, not ForCausalLMLoss"
    return None


def patch_cross_entropy(causal_lm: nn.Module):
    """True, or the reason the model's loss is not ForCausalLMLoss."""
    if refusal := _loss_function_refusal(causal_lm):
        return refusal
    causal_lm.loss_function = causal_lm_cross_entropy  # an instance attribute (transformers' setter)
    return True


# --- fused linear cross-entropy ------------------------------------------------------------------


def lm_head_refusal(lm_head: nn.Module) -> str | None:
    """Why the fused loss cannot read this lm_head's weight and bias as the whole head, or None.

    The fused loss computes `F.linear(h, lm_head.weight, lm_head.bias)` and never calls the head. That
    is the head only when it holds no other parameter (one it holds would get no gradient) and its
    forward is nn.Linear's, or proven equal to it on probes. An nn.Linear subclass is not enough:
    FSDP-2's FSDPLinear is one, and so is a head that scales its logits by a learned vector.
    """
    name = type(lm_head).__name__
    if hasattr(lm_head, "base_layer"):
        return (
            f"lm_head carries an adapter ({type(lm_head).__module__}.{name}); the fused loss "
            "reads lm_head.weight directly and would train without the adapter's gradient"
        )
    if not isinstance(lm_head, nn.Linear):
        return f"lm_head is a {name}, not a plain nn.Linear"
    own = [n for n, _ in lm_head.named_parameters() if n not in ("weight", "bias")]
    if own:
        return (
            f"lm_head is a {name} with parameters of its own ({', '.join(own)}); the fused loss reads "
            "only its weight and bias, and would train without their gradient"
        )
    if type(lm_head).forward is not nn.Linear.forward and not _forward_is_linear(lm_head):
        return f"{name}.forward is not F.linear(h, weight, bias) on probes"
    return None


def _forward_is_linear(lm_head: nn.Linear) -> bool:
    """Whether the head's own forward, run on a small stand-in, is F.linear(h, weight, bias)."""
    twin = _probe.stand_in(lm_head)
    small = _probe.small_linear(8, 6, lm_head.bias is not None, seed=0)
    twin.weight, twin.bias = small.weight, small.bias
    twin.in_features, twin.out_features = 8, 6
    g = _probe.generator(1)
    inputs = [(torch.randn(2, 3, 8, generator=g) * scale,) for scale in _probe.SCALES]

    def theirs(training, h):
        twin.train(training)
        return type(lm_head).forward(twin, h)

    def linear(training, h):
        return nn.functional.linear(h, twin.weight, twin.bias)

    return _probe.agrees(theirs, linear, inputs)


class _DeferringHead:
    """Stands in for lm_head during a fused forward: called, it defers; read, it is lm_head."""

    def __init__(self, lm_head: nn.Module):
        self.lm_head = lm_head

    def __call__(self, hidden: torch.Tensor, *args, **kwargs) -> DeferredLogits:
        if args or kwargs:
            raise LogitsTransformed("the forward calls lm_head with more than the hidden states")
        return DeferredLogits(hidden, self.lm_head)

    def __getattr__(self, name: str):
        return getattr(self.lm_head, name)


class _Intercepted:
    """Inside this context, `causal_lm.lm_head(h)` defers its logits and `loss_function` fuses the loss.

    The interceptor sits in the instance's `__dict__`, which attribute lookup reads before
    `nn.Module.__getattr__`: the module tree, state dict and FSDP wrapping never see it.
    """

    def __init__(self, causal_lm: nn.Module, loss=None):
        self.causal_lm = causal_lm
        self.loss = loss or _fused_loss(causal_lm.loss_function)

    def __enter__(self):
        lm_head = self.causal_lm._modules["lm_head"]
        refusal = lm_head_refusal(lm_head)  # an adapter added after patching must not be dropped
        if refusal:
            raise ValueError(
                f"fused linear cross-entropy: {refusal}. Patch without fused_linear_cross_entropy."
            )
        self.saved = self.causal_lm.__dict__.get("_loss_function", None)
        self.causal_lm.__dict__["lm_head"] = _DeferringHead(lm_head)
        self.causal_lm.__dict__["_loss_function"] = self.loss
        return self

    def __exit__(self, *exc):
        del self.causal_lm.__dict__["lm_head"]
        if self.saved is None:
            del self.causal_lm.__dict__["_loss_function"]
        else:
            self.causal_lm.__dict__["_loss_function"] = self.saved


def _fused_loss(original_loss):
    """A loss_function that fuses when handed DeferredLogits and otherwise is the original one."""
    if getattr(original_loss, "liger_logprobs", False):
        return original_loss  # it takes DeferredLogits itself

    def loss_function(
        logits,
        labels,
        vocab_size=None,
        num_items_in_batch=None,
        ignore_index=-100,
        shift_labels=None,
        **kwargs,
    ):
        if not isinstance(logits, DeferredLogits):
            return original_loss(
                logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs
            )
        hidden, head = logits.hidden, logits.lm_head
        targets = _shifted_labels(labels, shift_labels, ignore_index).to(hidden.device)
        if targets.numel() != hidden.shape[:-1].numel():
            raise ValueError(
                f"fused linear cross-entropy: {tuple(hidden.shape[:-1])} positions reach lm_head but the "
                f"labels have {tuple(targets.shape)}; train with logits_to_keep=0"
            )
        reduction = "mean" if num_items_in_batch is None else "sum"
        loss = fused_linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]),
            head.weight,
            targets.reshape(-1),
            head.bias,
            ignore_index,
            reduction,
        )
        return _divide_by_items(loss, num_items_in_batch)

    return loss_function


def _head_refusal(causal_lm: nn.Module) -> str | None:
    """Why the model's forward cannot take the fused loss, or None.

    After the cheap checks, a probe runs the class forward with the decoder replaced by a stub that
    returns a small hidden state (on the head's device: meta works) and with lm_head and
    loss_function intercepted: it must hand lm_head's deferred output straight to loss_function.
    """
    name = type(causal_lm).__name__
    decoder_name = getattr(causal_lm, "base_model_prefix", "")
    decoder = getattr(causal_lm, decoder_name, None) if decoder_name else None
    lm_head = causal_lm._modules.get("lm_head")
    if lm_head is None or not isinstance(decoder, nn.Module) or decoder is causal_lm:
        return f"{name} is not a causal LM with a decoder and an lm_head"
    if refusal := _loss_function_refusal(causal_lm):
        return refusal
    config = getattr(causal_lm, "config", None)
    text_config = getattr(config, "get_text_config", lambda: config)()  # a VLM's text settings
    for attribute in LOGIT_TRANSFORMS:
        value = getattr(config, attribute, None)
        value = getattr(text_config, attribute, None) if value is None else value
        if value is not None:
            return (
                f"{name} transforms its logits ({attribute}={value}), which the fused loss does not reproduce"
            )
    refusal = lm_head_refusal(lm_head)
    if refusal:
        return refusal
    return _probe_head(causal_lm, decoder_name, lm_head)


class _StubOutput(dict):
    """A decoder output holding only `last_hidden_state`; every other field reads as None."""

    def __getattr__(self, name):
        return self.get(name)

    def __getitem__(self, key):
        return self["last_hidden_state"] if key == 0 else dict.get(self, key)

    def to_tuple(self):
        return (self["last_hidden_state"],)


def _probe_head(causal_lm: nn.Module, decoder_name: str, lm_head: nn.Module) -> str | None:
    name = type(causal_lm).__name__
    weight = lm_head.weight
    hidden = torch.zeros(1, 4, lm_head.in_features, device=weight.device, dtype=weight.dtype)
    calls = []

    def recorder(logits, labels, *args, **kwargs):
        calls.append(isinstance(logits, DeferredLogits))
        return hidden.sum() * 0.0  # a scalar on the right device for whatever the forward adds to it

    class StubDecoder:
        """Called, returns the stub output; any attribute (a multiplier, a config) is the decoder's."""

        def __call__(self, *args, **kwargs):
            return _StubOutput(last_hidden_state=hidden)

        def __getattr__(self, name):
            return getattr(decoder, name)

    decoder = getattr(causal_lm, decoder_name)
    stub_decoder = StubDecoder()

    ids = torch.zeros(1, 4, dtype=torch.long, device=weight.device)
    kwargs = {"input_ids": ids, "labels": ids}
    if "output_router_logits" in inspect.signature(type(causal_lm).forward).parameters:
        kwargs["output_router_logits"] = False  # the stub has no router; the real forward keeps its own
    training = causal_lm.training
    causal_lm.__dict__[decoder_name] = stub_decoder
    try:
        causal_lm.train(True)
        with _Intercepted(causal_lm, loss=recorder), torch.no_grad(), torch.random.fork_rng(devices=[]):
            type(causal_lm).forward(causal_lm, **kwargs)
    except LogitsTransformed as err:
        return f"{name} does more with its logits than the loss ({err}): the fused loss would drop it"
    except Exception as err:
        first = str(err).strip().splitlines()[0][:120] if str(err).strip() else type(err).__name__
        return f"{name}.forward could not be probed with a stub decoder ({type(err).__name__}: {first})"
    finally:
        del causal_lm.__dict__[decoder_name]
        causal_lm.train(training)
    if calls != [True]:
        return f"{name}.forward does not hand lm_head's output straight to loss_function"
    return None


def patch_fused_linear_cross_entropy(causal_lm: nn.Module):
    """True, or the reason the fused loss cannot reproduce this model's loss."""
    if refusal := _head_refusal(causal_lm):
        return refusal

    def forward(self, *args, **kwargs):
        logprobs = getattr(self.loss_function, "liger_logprobs", False)  # no logits needed, in eval mode too
        if not ((self.training or logprobs) and kwargs.get("labels") is not None):
            return type(self).forward(self, *args, **kwargs)  # eval and generation get real logits
        with _Intercepted(self):
            output = type(self).forward(self, *args, **kwargs)
        if isinstance(output, tuple):
            return type(output)(None if isinstance(v, DeferredLogits) else v for v in output)
        if isinstance(getattr(output, "logits", None), DeferredLogits):
            output.logits = None  # never let the stand-in escape
        return output

    causal_lm.forward = types.MethodType(forward, causal_lm)
    return True
