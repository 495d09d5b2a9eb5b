"""Every causal-LM model type of the installed transformers, built tiny from its own config class: each
kernel is patched and gives the unpatched loss and gradients, or is left alone with a reason. Never
silently wrong, never a crash. The sweep runs in 2 worker processes (scripts/kernel_coverage.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO

FOUR = ("rms_norm", "rope", "swiglu", "fused_linear_cross_entropy")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "rows.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "kernel_coverage.py"), "--json", str(out), "--no-markdown"],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert out.exists(), result.stderr[-2000:]
    return result, json.loads(out.read_text())


def test_every_causal_lm_type_is_exact_or_left_alone(sweep):
    result, rows = sweep
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert [r["type"] for r in rows] == sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)  # all of them, once
    wrong = {r["type"]: r["wrong"] for r in rows if r.get("wrong")}
    crashed = {
        r["type"]: r.get("crashed") or r.get("crash") for r in rows if r.get("crashed") or r.get("crash")
    }
    assert wrong == {}, f"silently wrong: {wrong}"
    assert crashed == {}, f"crashed: {crashed}"
    assert result.returncode == 0, result.stdout[-2000:]

    built = [r for r in rows if r["built"]]
    assert len(built) >= 150, f"only {len(built)} types built tiny"
    for r in rows:
        if not r["built"]:
            assert r["reason"], r  # a type that cannot be built tiny is listed with why
            continue
        for kernel in FOUR:  # each kernel: patched (and compared above), or left alone with a reason
            line = next(line for line in r["report"] if line.startswith(kernel + ":"))
            assert kernel in r["patched"] or ": not patched: " in line, (r["type"], line)


def test_coverage_target_and_moe_router_losses(sweep):
    _, rows = sweep
    full = [r["type"] for r in rows if r["built"] and all(k in r["patched"] for k in FOUR)]
    assert len(full) >= 45, full
    for moe in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"):
        row = next(r for r in rows if r["type"] == moe)
        assert row.get("router_loss") and all(k in row["patched"] for k in FOUR), row


def test_the_coverage_table_in_docs_is_the_generated_one(sweep):
    sys.path.insert(0, str(REPO / "scripts"))
    from kernel_coverage import markdown

    _, rows = sweep
    committed = (REPO / "docs" / "kernel-coverage.md").read_text()
    assert markdown(rows) == committed, (
        "docs/kernel-coverage.md is stale: run python scripts/kernel_coverage.py"
    )
