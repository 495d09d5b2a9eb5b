"""Causal-LM model types of the installed transformers, built tiny from their own config classes: each
kernel is patched and gives the unpatched loss and gradients, or is left alone with a reason. Never
silently wrong, never a crash.

The test sweeps one type per code path of patch_model (every "patched" and every "left alone" reason
of docs/kernel-coverage.md, found by the test below) plus the known special ones (the MoE router losses,
the common families), through scripts/kernel_coverage.py in 2 worker processes. The full sweep of every
type, with the coverage targets and the committed table compared, is a script:
`python scripts/kernel_coverage.py --check --compare-docs` (about 70 s on 2 cores; scripts/compat.sh
runs it with --check on the newest releases)."""

from __future__ import annotations

import json
import re
import sys

import pytest
import warm_python
from conftest import REPO

FOUR = ("rms_norm", "rope", "swiglu", "fused_linear_cross_entropy")
MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")
# Known special ones first (the MoE router losses, families users train), then one type for each
# patched / left-alone reason of the table that those do not show already.
SAMPLE = (
    *("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gpt_oss", "glm", *MOE),
    *("bart", "deepseek_v4", "modernbert-decoder", "gpt_neox_japanese", "bailing_hybrid", "beam"),
    *("llama4", "opt", "xlstm"),
    # Paths no reason names: the fused-loss probe's stand-in for the logits divided (granite's logit
    # scaling), cast and asked for the head's attributes (mamba), asked its shape (inkling_text); a rope
    # wrapper that calls the family's own (gpt_neox).
    *("granite", "mamba", "gpt_neox", "inkling_text"),
    *("dbrx", "reformer"),  # cannot be built tiny: a TinyModelError and another exception
)
DOCS = REPO / "docs" / "kernel-coverage.md"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "rows.json"
    result = warm_python.run(
        [REPO / "scripts" / "kernel_coverage.py", "--json", out, "--no-markdown", "--only", ",".join(SAMPLE)],
        timeout=1500,
    )
    assert out.exists(), result.stderr[-2000:]
    return result, json.loads(out.read_text())


def test_each_code_path_is_exact_or_left_alone(sweep):
    result, rows = sweep
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert [r["type"] for r in rows] == list(SAMPLE)  # all of them, once
    assert set(SAMPLE) <= set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    wrong = {r["type"]: r["wrong"] for r in rows if r.get("wrong")}
    crashed = {
        r["type"]: r.get("crashed") or r.get("crash") for r in rows if r.get("crashed") or r.get("crash")
    }
    assert wrong == {}, f"silently wrong: {wrong}"
    assert crashed == {}, f"crashed: {crashed}"
    assert result.returncode == 0, result.stdout[-2000:]

    assert [r["type"] for r in rows if not r["built"]] == ["dbrx", "reformer"]
    for r in rows:
        if not r["built"]:
            assert r["reason"], r  # a type that cannot be built tiny is listed with why
            continue
        for kernel in FOUR:  # each kernel: patched (and compared above), or left alone with a reason
            line = next(line for line in r["report"] if line.startswith(kernel + ":"))
            assert kernel in r["patched"] or ": not patched: " in line, (r["type"], line)


def test_moe_router_losses_and_the_common_families(sweep):
    _, rows = sweep
    for moe in MOE:
        row = next(r for r in rows if r["type"] == moe)
        assert row.get("router_loss") and all(k in row["patched"] for k in FOUR), row
    for family in ("llama", "mistral", "qwen2", "qwen3", "phi3"):
        row = next(r for r in rows if r["type"] == family)
        assert all(k in row["patched"] for k in FOUR), row


def _table(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """The committed table's rows by type: built ones, and the ones that cannot be built tiny."""
    head, _, tail = text.partition("## Types that cannot be built tiny")

    def rows(part: str) -> dict[str, str]:
        lines = [ln for ln in part.splitlines() if ln.startswith("| ") and not ln.startswith("| type")]
        return {ln.split(" | ")[0][2:]: ln for ln in lines}

    return rows(head), rows(tail)


def _reasons(line: str) -> set[str]:
    """A table row's code paths: each kernel's cell, and each left-alone reason with names made generic."""
    cells = [c.strip() for c in line.strip("|").split("|")]
    paths = {f"{kernel}={cell}" for kernel, cell in zip((*FOUR, "cross_entropy"), cells[2:7], strict=True)}
    for reason in filter(None, cells[7].split("; ")):
        reason = re.sub(r"transformers\.models\.\S+\.apply_rotary_pos_emb", "M.apply_rotary_pos_emb", reason)
        reason = re.sub(r"\((final_logit_softcapping|the forward)[^)]*\)", "(...)", reason)
        paths.add(re.sub(r"\d+", "N", re.sub(r"\b[A-Za-z]*[A-Z][A-Za-z0-9]*\b", "C", reason)))
    return paths


def test_the_committed_table_is_current_and_the_sample_covers_its_code_paths(sweep):
    """The table (docs/kernel-coverage.md, the full sweep's output) is for this transformers, lists every
    causal-LM type once, meets the coverage targets; each swept type's row is the committed one, and the
    swept types show every code path the table has."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    sys.path.insert(0, str(REPO / "scripts"))
    from kernel_coverage import markdown

    _, rows = sweep
    committed = DOCS.read_text()
    stale = "docs/kernel-coverage.md is stale: run python scripts/kernel_coverage.py"
    assert f"with transformers {transformers.__version__}:" in committed, stale
    built, unbuilt = _table(committed)
    assert sorted([*built, *unbuilt]) == sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), stale
    full = [t for t, line in built.items() if line.split(" | ")[2:6] == ["yes"] * 4]
    counts = f"**{len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)} types, {len(built)} built tiny, {len(full)} with all four"
    assert counts in committed and "fused loss patched; 0 silently wrong or crashing.**" in committed, stale
    assert len(built) >= 150 and len(full) >= 45, (len(built), len(full))

    ours_built, ours_unbuilt = _table(markdown(rows))
    assert {t: built[t] for t in ours_built} == ours_built, stale
    assert {t: unbuilt[t] for t in ours_unbuilt} == ours_unbuilt, stale
    every_path = set().union(*map(_reasons, built.values()))
    ours = set().union(*map(_reasons, ours_built.values()))
    assert every_path - ours == set(), f"add a type with these code paths to SAMPLE: {every_path - ours}"


def test_every_causal_lm_config_shrinks_within_its_caps():
    """shrink_config on every causal-LM type's own config class (no model built: about 4 s for all of
    them, both depths): the class is kept, no capped size grows past its cap, no depth grows, and every
    special token id of the text config lands inside its shrunk vocabulary. The build and the kernels of
    one type per code path are the sweep above; every type built is `scripts/kernel_coverage.py`."""
    import warnings

    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from liger_cli.twin import shrink_rules as rules
    from liger_cli.twin.shrink import shrink_config, stored, sub_configs

    grown, outside, shrunk = [], [], 0
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = AutoConfig.for_model(model_type)
        except Exception:  # noqa: BLE001 - a config class that needs arguments: the full sweep lists it
            continue
        for rounds in (1, 2):
            tiny = shrink_config(config, rounds=rounds)
            shrunk += 1
            assert type(tiny) is type(config), model_type
            for old, new in zip(sub_configs(config), sub_configs(tiny), strict=True):
                for name, cap in [*rules.CAP.items(), ("num_hidden_layers", 0)]:
                    was, now = stored(old, name), stored(new, name)
                    sizes = all(isinstance(v, int) and not isinstance(v, bool) for v in (was, now))
                    if sizes and now > max(cap, 0) and now > was:
                        grown.append((model_type, rounds, name, was, now))
            try:
                text = tiny.get_text_config(decoder=True)
            except (ValueError, AttributeError):
                text = tiny
            vocab = stored(text, "vocab_size")
            for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
                value = stored(text, name)
                if isinstance(vocab, int) and isinstance(value, int) and not 0 <= value < vocab:
                    outside.append((model_type, name, value, vocab))
    assert shrunk > 300, shrunk  # about 188 types, each at both depths
    assert grown == [], grown
    assert outside == [], outside
