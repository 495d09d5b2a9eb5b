"""Our kernels in vision-language models: image-text-to-text families of the installed transformers,
each one's tiny twin fed a batch with an image (`liger_cli.twin.vision_batch`). For each family the kernel
check decides; then a fresh twin patched with what it kept must give the unpatched logits, loss and every
gradient, and carry our kernels only inside its language model and on its head. Or the kernels are off
with a reason. Never patched-but-different.

The test checks one family for each path through the check (`CODE_PATHS`) and the families the docs name;
`python scripts/vlm_sweep.py` (run by scripts/compat.sh) checks every family the same way."""

from __future__ import annotations

import json
import time
import warnings

import pytest
import torch
from torch import nn

from liger_cli.twin.kernel_check import check_kernels, disagreement, train_step

ALL = dict(rms_norm=True, rope=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True)
LOGITS_RTOL = 1e-4


def _families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def patched_outside(model: nn.Module) -> list[str]:
    """Modules carrying one of our kernels that are neither in the language model nor the model itself
    (its head): read from the instance, independently of patch_model's report."""
    decoder = model.get_decoder()
    inside = {id(m) for m in decoder.modules()} | {id(model)}
    marked = [
        name
        for name, m in model.named_modules()
        if ("forward" in vars(m) or "_apply_gate" in vars(m) or "_liger_kernel" in vars(m))
    ]
    return [name for name in marked if id(model.get_submodule(name)) not in inside]


def compare_with(config, kernels: dict[str, bool]) -> dict:
    """A fresh twin unpatched and one patched with `kernels`: logits (eval), loss and gradients (train)."""
    from liger_kernels import patch_model

    from liger_cli.model.vision import is_vision_language
    from liger_cli.twin.tiny import tiny_batch, tiny_causal_lm
    from liger_cli.twin.vision_batch import tiny_image_batch

    plain, patched = tiny_causal_lm(config), tiny_causal_lm(config)
    report = patch_model(patched, **kernels)
    batch = tiny_image_batch(plain) if is_vision_language(config) else tiny_batch(plain)
    unlabelled = {k: v for k, v in batch.items() if k != "labels"}
    logits = []
    for model in (plain, patched):
        model.eval()
        with torch.no_grad():
            logits.append(model(**unlabelled).logits)
    error = (logits[1] - logits[0]).abs().max().item()
    scale = logits[0].abs().max().item()
    why = disagreement(train_step(patched, batch), train_step(plain, batch))
    if error > LOGITS_RTOL * max(scale, 1.0):
        why = f"logits differ by {error:.2e}"
    return {"why": why, "outside": patched_outside(patched), "patched": sorted(report.patched)}


def check_family(family: str) -> dict:
    """One small batch on the family's twin: every kernel patched at once against none. Where that
    differs or the twin cannot be built, fed an image or trained, the kernel check (the Plan's own path)
    must switch off what differs, or everything with the reason, and what it keeps must then be exact."""
    from transformers import AutoConfig
    from transformers.utils import logging

    from liger_cli.model.vision import is_vision_language
    from liger_cli.twin.tiny import twin_session

    logging.set_verbosity_error()
    with twin_session(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config = AutoConfig.for_model(family)
        except Exception as err:  # noqa: BLE001 - listed with why
            return {"checked": False, "reason": f"no default config: {err}", "vlm": False}
        row = {"vlm": is_vision_language(config), "off": {}}
        try:
            row |= {"checked": True, **compare_with(config, ALL)}
            if row["why"] is None:
                return row
        except Exception:  # noqa: BLE001 - the kernel check says why below
            pass
        check = check_kernels(config, ALL)
        row["off"] = check.switched_off
        if check.not_run:
            return row | {"checked": False, "reason": check.not_run}
        row |= {"checked": True, "lines": check.lines()}
        try:
            row |= compare_with(config, check.kernels)
        except Exception as err:  # noqa: BLE001 - a crash of the patched twin is a failure below
            row["crash"] = f"{type(err).__name__}: {str(err)[:160]}"
    return row


# One family for each path through the check (what the full sweep, scripts/vlm_sweep.py, found on
# transformers 5.23), and the families the docs name. What each shows is asserted below, so a family
# that leaves its path is noticed.
CODE_PATHS = {
    "llava": "proven directly: all four kernels in a Llama language model",
    "mistral3": "proven directly: all four, a Pixtral tower",
    "gemma3": "proven: RMSNorm (1 + weight), RoPE, the fused loss; its GELU MLP stays",
    "paligemma": "proven: as Gemma 3, the projector one linear",
    "mistral_large4": "proven: RMSNorm and SwiGLU; the fused loss left to the model",
    "fuyu": "its config is not a VLM's: a text batch, RoPE and the fused loss proven",
    "mllama": "off: no get_image_features (cross-attention)",
    "blip-2": "off: the config names no image token id",
    "llava_next": "off: no pixel input the twin accepts (tiled images)",
    "qwen2_vl": "off: the twin does not train on its image batch (default M-RoPE sections)",
    "janus": "off: the shrunk twin is still over the size limit",
    "fast_vlm": "off: no twin without timm",
    "evolla": "off: not buildable as an image-text class, and not a VLM config (nothing to switch off)",
}


def sweep_of(families: list[str]) -> dict[str, dict]:
    """`check_family` of each family, in 2 processes (this machine's cores), each one thread."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        return dict(zip(families, pool.map(check_family, families), strict=True))


def every_family_wrong(sweep: dict[str, dict], every: bool = True) -> list[str]:
    """What is wrong in a sweep (scripts/vlm_sweep.py): a kernel patched but different, a crash, a kernel
    outside the language model and head, a family off without a reason or a VLM off with a kernel still
    on; of every family (`every`), also the families docs/kernels.md names as proven."""
    checked = {f: r for f, r in sweep.items() if r["checked"]}
    problems = [f"{f}: patched but different: {r['why']}" for f, r in checked.items() if r.get("why")]
    problems += [f"{f}: crashed: {r['crash']}" for f, r in checked.items() if r.get("crash")]
    problems += [f"{f}: kernels outside the language model: {r['outside']}" for f, r in checked.items() if r.get("outside")]  # fmt: skip
    for family, row in sweep.items():
        if not row["checked"] and not row["reason"]:
            problems.append(f"{family}: off without a reason")
        if not row["checked"] and row["vlm"] and not all(row["off"].get(k) for k in ALL if ALL[k]):
            problems.append(f"{family}: its twin proves nothing, yet a kernel is on: {row}")
    if every:
        proven = {f: r["patched"] for f, r in checked.items() if r.get("patched")}
        if list(sweep) != _families():
            problems.append("not every family of the mapping, once")
        if not {"llava", "gemma3", "paligemma", "mistral3"} <= set(proven):
            problems.append(f"llava, gemma3, paligemma, mistral3 not all proven: {sorted(proven)}")
    return problems


def summary(sweep: dict[str, dict], seconds: float) -> str:
    checked = {f: r for f, r in sweep.items() if r["checked"]}
    proven = {f: r["patched"] for f, r in checked.items() if r.get("patched")}
    off = {f: r["reason"] for f, r in sweep.items() if not r["checked"]}
    wrong = {f: r["why"] for f, r in checked.items() if r.get("why")}
    return (
        f"{len(sweep)} families in {seconds} s: {len(checked)} checked with an image, "
        f"{len(proven)} with kernels patched in the language model, {len(off)} left off, "
        f"{len(wrong)} wrong\nproven: {json.dumps(proven)}\noff: {json.dumps(off, indent=1)}"
    )


@pytest.fixture(scope="module")
def sweep() -> dict[str, dict]:
    start = time.perf_counter()
    rows = sweep_of(sorted(CODE_PATHS))
    print("\n" + summary(rows, round(time.perf_counter() - start, 1)))
    return rows


def test_each_code_path_is_exact_in_its_language_model_or_left_off(sweep):
    assert set(CODE_PATHS) <= set(_families())  # each still a family of the installed transformers
    assert list(sweep) == sorted(CODE_PATHS)
    assert every_family_wrong(sweep, every=False) == []
    checked = {f: r for f, r in sweep.items() if r["checked"]}
    proven = {f: r["patched"] for f, r in checked.items() if r.get("patched")}
    assert {"llava", "gemma3", "paligemma", "mistral3"} <= set(proven), proven
    assert set(proven["llava"]) == {"rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"}
    # Each family still takes the path it stands for.
    four = ["fused_linear_cross_entropy", "rms_norm", "rope", "swiglu"]
    assert proven == {"llava": four, "mistral3": four, "gemma3": four[:3], "paligemma": four[:3],
                      "mistral_large4": ["rms_norm", "swiglu"], "fuyu": [four[0], "rope"]}, proven  # fmt: skip
    assert not sweep["fuyu"]["vlm"] and all(sweep[f]["vlm"] for f in proven if f != "fuyu")
    off = {f: r["reason"] for f, r in sweep.items() if not r["checked"]}
    assert "has no get_image_features" in off["mllama"]
    assert "names no image token id" in off["blip-2"]
    assert "no pixel input the model accepts" in off["llava_next"]
    assert off["qwen2_vl"].startswith("the twin does not train on its image batch")
    assert "the shrunk model still has" in off["janus"]
    assert "timm" in off["fast_vlm"]
    assert "cannot build a tiny twin" in off["evolla"] and not sweep["evolla"]["vlm"]


# --- one family at a time --------------------------------------------------------------------------------
def vlm_config(family: str, **text):
    """The family's default config; Qwen-VL's with the M-RoPE sections a published checkpoint names
    (its modeling code's default sections fit the full head size only)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(family)
    if family.startswith("qwen2"):
        config.text_config.rope_parameters["mrope_section"] = [16, 24, 24]
    for key, value in text.items():
        setattr(config.text_config, key, value)
    return config


def test_the_twin_of_a_vlm_is_tiny_and_its_batch_carries_the_image():
    from liger_cli.twin.tiny import tiny_causal_lm
    from liger_cli.twin.vision_batch import image_token_id, tiny_image_batch

    twin = tiny_causal_lm(vlm_config("qwen2_5_vl"))
    assert type(twin).__name__ == "Qwen2_5_VLForConditionalGeneration"
    vision = twin.config.vision_config
    assert vision.depth == 2 and vision.fullatt_block_indexes == [1]  # a window block, then a full one
    assert vision.out_hidden_size == twin.config.text_config.hidden_size == 64
    assert sum(p.numel() for p in twin.parameters()) < 1_000_000
    batch = tiny_image_batch(twin)
    image = batch["input_ids"] == image_token_id(twin.config)
    with torch.no_grad():
        features = twin.get_image_features(
            pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"]
        ).pooler_output
    assert image.sum() == sum(f.shape[0] for f in features) > 0  # one image per row, the model's count
    assert batch["image_grid_thw"].shape == (2, 3) and torch.equal(batch["mm_token_type_ids"], image.long())
    assert (batch["labels"][image] == -100).all() and (batch["labels"] != -100).any()
    specials = {twin.config.vision_start_token_id, twin.config.video_token_id}
    assert not any(int(i) in specials for i in batch["input_ids"].flatten())
    assert torch.isfinite(twin(**batch).loss)


def test_llava_with_llama_proves_every_kernel_in_its_language_model():
    check = check_kernels(vlm_config("llava"), ALL)
    assert check.not_run is None and check.switched_off == {}
    assert check.kernels == ALL
    lines = "\n".join(check.lines())
    assert "scope: patched inside the language model (model.language_model, LlamaModel)" in lines
    for kernel, count in (("rms_norm", 5), ("rope", 2), ("swiglu", 2)):
        assert f"{kernel}: patched {count} modules (Llama" in "\n".join(check.twin_report)


def test_qwen2_vl_m_rope_is_computed_as_before_and_its_application_proven():
    """Qwen2-VL's rotary module makes cos/sin from the 3-D positions of the image batch (never patched);
    its attention applies them with a rotate_half apply_rotary_pos_emb, which the twin proves equal."""
    check = check_kernels(vlm_config("qwen2_vl"), ALL)
    assert check.not_run is None and check.switched_off == {}
    report = "\n".join(check.twin_report)
    assert "rope: patched 2 modules (Qwen2VLAttention)" in report
    assert "compute their cos/sin as before" in report


def test_patch_model_leaves_a_vision_tower_alone_that_it_could_patch():
    """Qwen2.5-VL's vision blocks hold RMSNorms and SwiGLU MLPs: patched throughout they would take our
    kernels; patch_model puts them in the language model and on the head only."""
    from liger_kernels import patch_model
    from liger_kernels.patch_rms_norm import patch_rms_norm
    from liger_kernels.patch_swiglu import patch_swiglu_mlp

    from liger_cli.twin.tiny import tiny_causal_lm

    config = vlm_config("qwen2_5_vl")
    loose = tiny_causal_lm(config).model.visual  # what the module-level patchers would take there
    norms = sum(patch_rms_norm(m, {}) is True for m in loose.modules())
    assert norms == 5  # 2 blocks x 2 norms, and the merger's
    assert sum(patch_swiglu_mlp(m, {}) is True for m in loose.modules()) == 2
    twin = tiny_causal_lm(config)
    tower = twin.model.visual
    report = patch_model(twin, **ALL)
    assert patched_outside(twin) == []
    assert not any("forward" in vars(m) for m in tower.modules())
    assert report.patched == {"rms_norm": 5, "rope": 2, "swiglu": 2, "fused_linear_cross_entropy": 1}
    assert "fused_linear_cross_entropy" in vars(twin)["_liger_kernels"]
    assert compare_with(config, ALL) == {"why": None, "outside": [], "patched": sorted(report.patched)}


def test_a_rotary_function_we_do_not_compute_is_left_alone_and_named():
    from liger_kernels import patch_model

    class MropeAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Linear(8, 8)

        def forward(self, x, cos, sin):
            return apply_multimodal_rotary_pos_emb(self.q_proj(x), cos, sin, [1, 1, 2])

    report = patch_model(MropeAttention(), rms_norm=False, swiglu=False, fused_linear_cross_entropy=False)
    assert report.patched == {}
    assert report.skipped["rope"] == (
        "MropeAttention calls apply_multimodal_rotary_pos_emb, which we do not compute: left as it is"
    )


def apply_multimodal_rotary_pos_emb(x, cos, sin, sections):  # the test's stand-in, never run
    return x


def test_a_vlm_without_an_image_batch_keeps_every_kernel_off(monkeypatch):
    import liger_cli.twin.vision_batch as vision_batch

    def refuse(model, images, seed=0):
        raise vision_batch.ImageBatchError("no pixel input the model accepts (test)")

    monkeypatch.setattr(vision_batch, "image_inputs", refuse)
    check = check_kernels(vlm_config("llava"), ALL)
    assert check.kernels == dict.fromkeys(ALL, False)
    assert check.lines() == [
        "kernel check: not run (no image batch: no pixel input the model accepts (test)): "
        "rms_norm, rope, swiglu, fused_linear_cross_entropy off"
    ]


def test_a_soft_capped_language_head_keeps_its_own_loss():
    """Gemma 3's soft-capping lives in its text config: the fused loss cannot reproduce it."""
    from liger_kernels import patch_model

    from liger_cli.twin.tiny import tiny_causal_lm

    twin = tiny_causal_lm(vlm_config("gemma3", final_logit_softcapping=30.0))
    report = patch_model(twin, **ALL)
    assert report.skipped["fused_linear_cross_entropy"] == (
        "Gemma3ForConditionalGeneration transforms its logits (final_logit_softcapping=30.0), "
        "which the fused loss does not reproduce"
    )
    assert report.patched["rms_norm"] > 0 and patched_outside(twin) == []
