"""Nothing lost: a run that fails its checks leaves the output folder as it was; liger only ever
replaces or resumes into folders it made, and only merge folders it made.

One run is a real process; the refusals and the merges run in this process (`liger_here`, its exit code
and one-line error as the command gives them); refusals as real processes are tests/test_user_errors.py's
and test_recipe.py's, a real `liger merge` is test_train.py's."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from test_train import QUICK_DATA, liger, liger_here, recipe_text


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` with the sha256 of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def one_line_error(proc) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, proc.stderr[-2000:]
    return lines[0]


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir: Path, tmp_path_factory) -> Path:
    """A finished 2-step run with overwrite: true, trained over an old run's folder (liger's marker and
    a stale file in it): the overwrite replaces the old run once the new one starts."""
    root = tmp_path_factory.mktemp("finished")
    recipe = root / "r.yaml"
    out = root / "out"
    recipe.write_text(
        recipe_text(
            tiny_model_dir,
            out,
            training="{max_steps: 2, micro_batch_size: 4, lr: 5.0e-3, seed: 3}",
            output=f"{{dir: {out}, overwrite: true}}",
            logging="{every: 1}",
        )
    )
    out.mkdir()
    (out / ".liger-run").touch()  # what every run folder carries from its start
    (out / "stale.txt").write_text("from the old run")
    proc = liger("train", str(recipe))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "final" / "adapter_model.safetensors").is_file()
    return recipe


def test_overwrite_with_a_bad_data_row_keeps_the_previous_run(finished_run: Path, tmp_path: Path) -> None:
    out = finished_run.parent / "out"
    before = snapshot(out)
    bad = tmp_path / "train.jsonl"
    rows = (QUICK_DATA / "train.jsonl").read_text().splitlines()
    bad.write_text("\n".join([*rows[:5], json.dumps({"instruction": "hi"}), *rows[5:]]) + "\n")
    proc = liger_here("train", str(finished_run), "--set", f"data.train={bad}")
    line = one_line_error(proc)
    assert "train.jsonl" in line, line
    assert snapshot(out) == before  # the final adapter included, byte for byte


def test_overwrite_replaces_the_old_run_once_the_new_one_starts(finished_run: Path) -> None:
    out = finished_run.parent / "out"
    assert not (out / "stale.txt").exists() and (out / "final" / "adapter_model.safetensors").is_file()


def test_overwrite_refuses_a_folder_the_run_reads_from(finished_run: Path, tmp_path: Path) -> None:
    out = finished_run.parent / "out"
    before = snapshot(out)
    inside = out / "data.jsonl"
    inside.write_text((QUICK_DATA / "train.jsonl").read_text())
    try:
        line = one_line_error(liger_here("train", str(finished_run), "--set", f"data.train={inside}"))
        assert "reads" in line and "inside" in line
    finally:
        inside.unlink()
    assert snapshot(out) == before


def test_resume_path_never_writes_into_a_foreign_folder(finished_run: Path, tmp_path: Path) -> None:
    foreign = tmp_path / "precious"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("do not touch")
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text('{"step": 1}')
    proc = liger_here(
        "train", str(finished_run), "--set", f"output.dir={foreign}", "--set", f"output.resume={checkpoint}"
    )
    line = one_line_error(proc)
    assert "not a liger run folder" in line
    assert sorted(p.name for p in foreign.iterdir()) == ["thesis.tex"]  # no marker planted


def test_merge_replaces_only_a_merge_folder_it_made(finished_run: Path, tmp_path: Path) -> None:
    run = finished_run.parent / "out"
    run_before = snapshot(run)
    merged = tmp_path / "merged"
    sibling = tmp_path / "merged.tmp"  # a folder liger did not make, where it once wrote its temporary
    sibling.mkdir()
    (sibling / "keep.txt").write_text("mine")
    first = liger_here("merge", str(run), str(merged))
    assert first.returncode == 0, first.stderr[-2000:]
    assert (merged / "model.safetensors").is_file() and (merged / ".liger-merge").is_file()
    assert (sibling / "keep.txt").read_text() == "mine"
    again = liger_here("merge", str(run), str(merged), "--overwrite")
    assert again.returncode == 0, again.stderr[-2000:]
    assert (merged / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged", "merged.tmp"]  # no temporary left

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("do not delete")
    line = one_line_error(liger_here("merge", str(run), str(foreign), "--overwrite"))
    assert "did not write it" in line
    assert (foreign / "notes.txt").read_text() == "do not delete"
    for target in (run, run.parent, run.parent.parent):
        line = one_line_error(liger_here("merge", str(run), str(target), "--overwrite"))
        assert "run folder or a parent of it" in line
    assert snapshot(run) == run_before
