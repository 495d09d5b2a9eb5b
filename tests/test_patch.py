"""patch_model on tiny models of every supported family: patched vs unpatched train to the same losses
and weights, the report says what was replaced, and an unpatched model beside a patched one stays
untouched. Runs the PyTorch paths (CPU); the kernels' own numerics are in test_kernels_*.py.
"""

from __future__ import annotations

import copy

import liger_kernels.patch_loss
import liger_kernels.patch_rms_norm
import liger_kernels.patch_rope
import liger_kernels.patch_swiglu
import pytest
import torch
from liger_kernels import PatchReport, patch_model
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 257

# family -> (config overrides, what the report must say per kernel: a module count or a skip reason)
FAMILIES = {
    "llama": ({}, {"rms_norm": 5, "rope": 2, "swiglu": 2, "fused_linear_cross_entropy": 1}),
    "mistral": ({}, {"rms_norm": 5, "rope": 2, "swiglu": 2, "fused_linear_cross_entropy": 1}),
    "qwen2": ({}, {"rms_norm": 5, "rope": 2, "swiglu": 2, "fused_linear_cross_entropy": 1}),
    # Qwen3 also normalises q and k per head: 2 layers x 2 more RMSNorms.
    "qwen3": ({"head_dim": 16}, {"rms_norm": 9, "rope": 2, "swiglu": 2, "fused_linear_cross_entropy": 1}),
    # Gemma: offset norm (1 + weight), GELU MLP left alone.
    "gemma": (
        {"head_dim": 16},
        {
            "rms_norm": 5,
            "rope": 2,
            "swiglu": "GemmaMLP.act_fn is GELUTanh, not SiLU",
            "fused_linear_cross_entropy": 1,
        },
    ),
    # Gemma2: four norms per layer, and final logit soft-capping, which FLCE cannot reproduce.
    "gemma2": (
        {"head_dim": 16},
        {
            "rms_norm": 9,
            "rope": 2,
            "swiglu": "Gemma2MLP.act_fn is GELUTanh, not SiLU",
            "fused_linear_cross_entropy": "final_logit_softcapping=30.0",
        },
    ),
    # Phi-3: a fused gate_up_proj MLP (gate and up halves of one Linear), proven equal on probes.
    "phi3": ({}, {"rms_norm": 5, "rope": 2, "swiglu": 2, "fused_linear_cross_entropy": 1}),
}


def tiny_model(family: str, tmp_path, **overrides):
    """A tiny model of `family` from a config, saved and reloaded through from_pretrained."""
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    settings.update(FAMILIES[family][0] if family in FAMILIES else {})
    settings.update(overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(family, **settings), attn_implementation="eager"
    )
    model.save_pretrained(tmp_path / family)
    return AutoModelForCausalLM.from_pretrained(
        tmp_path / family, dtype=torch.float32, attn_implementation="eager"
    )


def batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (2, 12), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 9:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[0, :4] = -100  # a prompt
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def train_losses(model, steps=3, **extra):
    """Losses of a few SGD steps (fixed batches). SGD, not Adam: Adam's m / sqrt(v) turns a 1e-9
    difference in a near-zero gradient into a full-size update, so weights after Adam steps compare
    rounding noise, not the math."""
    model.train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    losses = []
    for step in range(steps):
        loss = model(**batch(step), **extra).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def assert_same_training(patched, reference, **extra):
    torch.testing.assert_close(
        train_losses(patched, **extra), train_losses(reference, **extra), rtol=1e-5, atol=1e-5
    )
    for (name, a), (_, b) in zip(patched.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_like_unpatched_and_reports(family, tmp_path):
    reference = tiny_model(family, tmp_path)
    patched = copy.deepcopy(reference)
    report = patch_model(patched)

    for kernel, expected in FAMILIES[family][1].items():
        if isinstance(expected, int):
            assert report.patched.get(kernel) == expected, str(report)
        else:
            assert kernel not in report.patched and expected in report.skipped[kernel], str(report)
    assert "cross_entropy" not in report.patched  # off by default
    assert len(report.lines()) == 5 and str(report) == "\n".join(report.lines())

    assert_same_training(patched, reference)

    # Evaluation still returns logits, equal to the unpatched model's.
    patched.eval()
    reference.eval()
    with torch.no_grad():
        out, want = patched(**batch(9)), reference(**batch(9))
    torch.testing.assert_close(out.logits, want.logits)
    torch.testing.assert_close(out.loss, want.loss)


def test_report_lines_read_well(tmp_path):
    report = patch_model(tiny_model("gemma", tmp_path), cross_entropy=False)
    assert report.lines() == [
        "rms_norm: patched 5 modules (GemmaRMSNorm)",
        "rope: patched 2 modules (GemmaAttention)",
        "swiglu: not patched: GemmaMLP.act_fn is GELUTanh, not SiLU",
        "cross_entropy: off",
        "fused_linear_cross_entropy: patched 1 module (GemmaForCausalLM)",
    ]
    assert isinstance(report, PatchReport)


def counting(monkeypatch):
    """Count calls of each kernel entry point the patched forwards use."""
    calls = {}
    entry_points = {
        "_rms_norm": (liger_kernels.patch_rms_norm, "rms_norm"),
        "apply_rope": (liger_kernels.patch_rope, "apply_rope"),
        "_swiglu": (liger_kernels.patch_swiglu, "swiglu"),
        "_flce": (liger_kernels.patch_loss, "fused_linear_cross_entropy"),
        "_cross_entropy": (liger_kernels.patch_loss, "cross_entropy"),
    }
    for key, (module, name) in entry_points.items():
        original = getattr(module, name)

        def wrapper(*args, _key=key, _original=original, **kwargs):
            calls[_key] = calls.get(_key, 0) + 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)
    return calls


def test_patched_and_unpatched_models_coexist(tmp_path, monkeypatch):
    calls = counting(monkeypatch)
    plain = tiny_model("llama", tmp_path)
    plain.train()
    before = plain(**batch()).loss
    other = copy.deepcopy(plain)
    patch_model(other)
    calls.clear()  # patching probes our kernels on stand-ins; count only what the models run

    after = plain(**batch()).loss
    assert calls == {}  # the unpatched model never reaches our kernels...
    assert after.item() == before.item()  # ...and computes exactly what it did
    other(**batch()).loss.backward()
    assert calls == {"_rms_norm": 5, "apply_rope": 2, "_swiglu": 2, "_flce": 1}
    assert type(plain.model.layers[0].self_attn).forward is type(other.model.layers[0].self_attn).forward


def test_flce_runs_only_when_training_with_labels(tmp_path, monkeypatch):
    calls = counting(monkeypatch)
    model = tiny_model("llama", tmp_path)
    patch_model(model, rms_norm=False, rope=False, swiglu=False)
    model.train()
    assert model(input_ids=batch()["input_ids"]).logits is not None  # no labels: logits
    assert "_flce" not in calls
    out = model(**batch())
    assert out.logits is None and calls["_flce"] == 1
    model.eval()
    assert model(**batch()).logits is not None and calls["_flce"] == 1
    generated = model.generate(batch()["input_ids"][:1, :4], max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, 7)


def test_num_items_in_batch_and_shift_labels_match_transformers(tmp_path):
    reference = tiny_model("qwen2", tmp_path)
    patched = copy.deepcopy(reference)
    patch_model(patched)
    items = torch.tensor(7)
    assert_same_training(patched, reference, num_items_in_batch=items)
    data = batch()
    shift = torch.nn.functional.pad(data["labels"], (0, 1), value=-100)[:, 1:].contiguous()
    shift[1, :3] = -100
    for model in (patched, reference):
        model.train()
    got = patched(**data, shift_labels=shift).loss
    want = reference(**data, shift_labels=shift).loss
    torch.testing.assert_close(got, want)


def test_non_fused_cross_entropy_option(tmp_path, monkeypatch):
    calls = counting(monkeypatch)
    reference = tiny_model("mistral", tmp_path)
    patched = copy.deepcopy(reference)
    report = patch_model(patched, cross_entropy=True, fused_linear_cross_entropy=False)
    assert report.patched["cross_entropy"] == 1 and "fused_linear_cross_entropy" not in report.patched
    assert_same_training(patched, reference, num_items_in_batch=torch.tensor(9))
    assert calls["_cross_entropy"] == 3 and "_flce" not in calls


def test_activation_checkpointing_recompute(tmp_path):
    reference = tiny_model("llama", tmp_path)
    patched = copy.deepcopy(reference)
    patch_model(patched)
    for model in (patched, reference):
        model.activation_checkpointing_enable({"use_reentrant": False})
        model.config.use_cache = False
    assert_same_training(patched, reference)


def lora(model, targets):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, init_lora_weights=False)
    return get_peft_model(model, config)


@pytest.mark.parametrize("order", ["patch_after_peft", "patch_before_peft"])
def test_lora_models_train_like_unpatched(tmp_path, order):
    targets = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
    reference = lora(tiny_model("llama", tmp_path), targets)
    if order == "patch_after_peft":
        patched = copy.deepcopy(reference)
        report = patch_model(patched)
    else:
        base = tiny_model("llama", tmp_path)
        report = patch_model(base)
        patched = lora(base, targets)
    assert report.patched == {"rms_norm": 5, "rope": 2, "swiglu": 2, "fused_linear_cross_entropy": 1}
    assert_same_training(patched, reference)
    lora_b = [n for n, p in patched.named_parameters() if "lora_B" in n and "gate_proj" in n]
    assert lora_b, "the LoRA adapters on the patched MLP exist and were compared"


def test_lora_on_lm_head_is_never_silently_dropped(tmp_path):
    # Patched after peft: FLCE is left off, and the report says why; training stays exact.
    reference = lora(tiny_model("llama", tmp_path), ["q_proj", "lm_head"])
    patched = copy.deepcopy(reference)
    report = patch_model(patched)
    assert "fused_linear_cross_entropy" not in report.patched
    assert "lm_head carries an adapter" in report.skipped["fused_linear_cross_entropy"]
    assert_same_training(patched, reference)

    # Patched before peft puts an adapter on lm_head: the fused path refuses at the first step.
    base = tiny_model("llama", tmp_path)
    patch_model(base)
    late = lora(base, ["lm_head"])
    late.train()
    with pytest.raises(ValueError, match="adapter"):
        late(**batch())


def test_patching_twice_is_harmless(tmp_path):
    reference = tiny_model("llama", tmp_path)
    patched = copy.deepcopy(reference)
    first = patch_model(patched)
    second = patch_model(patched)
    assert first.patched == second.patched
    assert_same_training(patched, reference)


def test_meta_device_model_gets_a_report():
    config = AutoConfig.for_model("llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    report = patch_model(model)
    assert report.patched == {"rms_norm": 5, "rope": 2, "swiglu": 2, "fused_linear_cross_entropy": 1}
