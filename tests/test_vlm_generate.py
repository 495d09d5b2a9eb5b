"""Image prompts for `liger generate` and `liger chat`, and `liger merge`'s image probe, on a real run of the
shipped tiny LLaVA (recipes/vision.yaml: LoRA on the language model, the projector trained in full).

Greedy completions equal transformers' own `generate` on the processor's inputs, 2 processes write what
one writes, chat's replies are generate's, bad image prompts are one-line exit-2 errors, and the merge
check compares logits on an image batch (a projector changed in the merge fails it)."""

from __future__ import annotations

import base64
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_distributed import child_env, free_port
from test_generate_cli import Terminal, generated, reply
from test_train import liger_here
from typer.testing import CliRunner

from liger_cli import cli

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "recipes" / "vision" / "model"
EVAL = REPO / "recipes" / "vision" / "data"
QUICKSTART = REPO / "recipes" / "quickstart" / "model"
NEW_TOKENS = "6"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """recipes/vision.yaml for 6 steps: a LoRA + projector run of the tiny LLaVA on image rows (no eval,
    no kernels: they do not change what is saved). In this process (test_train.liger_here): the run is not
    what these tests are about, and `liger train`'s real process is other files' tests'."""
    out = tmp_path_factory.mktemp("vlm-run") / "run"
    sets = [f"output.dir={out}", "training.max_steps=6", "training.micro_batch_size=4", "training.warmup_steps=0",
            "training.eval_samples=0", "training.eval_every=null", "data.eval=null", "kernels.check=false",
            *(f"kernels.{k}=false" for k in ("rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"))]  # fmt: skip
    proc = liger_here(
        "train", str(REPO / "recipes" / "vision.yaml"), *(a for s in sets for a in ("--set", s))
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out


def invoke(*args: str) -> tuple[int, str]:
    """A liger command in this process (the model loads once per call, no interpreter start): its exit
    code and output."""
    result = CliRunner().invoke(cli.app, list(args))
    assert "Traceback" not in result.output, result.output[-2000:]
    return result.exit_code, result.output


def one_line_error(*args: str) -> str:
    code, output = invoke(*args)
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, output[-2000:]
    return lines[0]


def user_turn(image: dict | None, question: str) -> dict:
    parts = [image] if image else []
    return {"role": "user", "content": [*parts, {"type": "text", "text": question}]}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    """Image rows (a path relative to the file, a data: URI), a text-only row, a two-turn conversation."""
    folder = tmp_path_factory.mktemp("prompts")
    (folder / "img").mkdir()
    for name in ("eval-040.png", "eval-007.png"):
        shutil.copy(EVAL / "img" / name, folder / "img" / name)
    uri = "data:image/png;base64," + base64.b64encode((EVAL / "img" / "eval-013.png").read_bytes()).decode()
    rows = [
        {"messages": [user_turn({"type": "image", "path": "img/eval-040.png"}, "What shape is this?")]},
        {"prompt": "What colour is the shape?", "id": "text"},
        {"messages": [user_turn({"type": "image", "image": uri}, "What colour is the shape?")]},
        {"messages": [user_turn({"type": "image", "path": "img/eval-007.png"}, "Name the shape."),
                      {"role": "assistant", "content": "circle"}, user_turn(None, "Which colour is it?")]},
    ]  # fmt: skip
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def reference(run: Path, rows: list[dict], base: Path) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy `generate`, one prompt at a time, on the processor's own inputs: the base with
    the run's adapter (and projector) as peft loads it. Each completion's ids and their log-probs."""
    from peft import PeftModel
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(MODEL)
    model = PeftModel.from_pretrained(
        AutoModelForImageTextToText.from_pretrained(MODEL), run / "final"
    ).eval()
    found = []
    for row in rows:
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        images = []
        for message in messages:
            for part in message["content"] if isinstance(message["content"], list) else []:
                if part["type"] == "image":
                    source = part.get("path") or part["image"]
                    data = (
                        base64.b64decode(source.partition(",")[2])
                        if source.startswith("data:")
                        else (base / source).read_bytes()
                    )
                    images.append(Image.open(io.BytesIO(data)))
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = processor(text=[text], images=images or None, add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=int(NEW_TOKENS), do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)  # fmt: skip
        ids = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
        logprobs = [
            torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, ids, strict=True)
        ]
        found.append((ids, logprobs))
    return found


def test_image_prompts_complete_as_transformers_generate_does(
    run: Path, prompts: Path, tmp_path: Path
) -> None:
    """Mixed image and text rows in batches of 3 (so one batch holds both): each completion is transformers'
    own greedy generate on the processor's inputs, its tokens and their log-probs (which a prompt that
    lost its image would change); 2 processes write the same file."""
    one = tmp_path / "one.jsonl"
    options = ["--prompts", str(prompts), "--max-new-tokens", NEW_TOKENS, "--batch-size", "3", "--logprobs"]
    code, output = invoke("generate", str(run), *options, "--out", str(one))
    assert code == 0 and "wrote 4 completions" in output and "format chat" in output, output[-3000:]
    rows = generated(one)
    inputs = [json.loads(line) for line in prompts.read_text().splitlines()]
    assert [{k: r[k] for k in row} for r, row in zip(rows, inputs, strict=True)] == inputs
    for row, (ids, logprobs) in zip(rows, reference(run, inputs, prompts.parent), strict=True):
        assert row["completion_ids"] == ids
        assert row["logprobs"] == pytest.approx(logprobs, abs=1e-4)

    two = tmp_path / "two.jsonl"
    argv = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--main_process_port", str(free_port()), "-m", "liger_cli", "generate", str(run), *options,
            "--out", str(two)]  # fmt: skip
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=300, env=child_env(ACCELERATE_USE_CPU="1")
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "over 2 processes" in proc.stdout
    for mine, other in zip(rows, generated(two), strict=True):
        assert {**mine, "logprobs": None} == {**other, "logprobs": None}
        assert mine["logprobs"] == pytest.approx(other["logprobs"], abs=1e-5)


@pytest.mark.timeout(900)
def test_chat_with_an_image_replies_what_generate_gives(run: Path, prompts: Path, tmp_path: Path) -> None:
    """--image for the first message, /image for a later one: each reply is generate's for the same
    conversation; the images stay in it."""
    image = prompts.parent / "img" / "eval-040.png"
    term = Terminal([sys.executable, "-m", "liger_cli", "chat", str(run), "--max-new-tokens", NEW_TOKENS,
                     "--image", str(image)])  # fmt: skip
    assert "/image PATH" in term.read_until("you> ")
    term.type("What shape is this?")
    first = reply(term)
    term.type("/image " + str(tmp_path / "missing.png"))
    assert "cannot use that image" in term.read_until("missing.png: cannot read it")
    term.type("/image " + str(prompts.parent / "img" / "eval-007.png"))
    term.read_until("goes with your next message)")
    term.type("Which colour is it?")
    second = reply(term)
    term.type("/exit")
    assert term.proc.wait(timeout=30) == 0

    history = [user_turn({"type": "image", "path": str(image)}, "What shape is this?"),
               {"role": "assistant", "content": first},
               user_turn({"type": "image", "path": str(prompts.parent / "img" / "eval-007.png")}, "Which colour is it?")]  # fmt: skip
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"messages": history[:1]}) + "\n" + json.dumps({"messages": history}) + "\n")
    out = tmp_path / "out.jsonl"
    code, output = invoke(
        "generate", str(run), "--prompts", str(rows), "--out", str(out), "--max-new-tokens", NEW_TOKENS
    )
    assert code == 0, output[-3000:]
    assert [first, second] == [r["completion"] for r in generated(out)]


def test_image_prompt_mistakes_are_one_line_and_write_nothing(run: Path, tmp_path: Path) -> None:
    (tmp_path / "notes.png").write_text("not a picture")
    shutil.copy(EVAL / "img" / "eval-040.png", tmp_path / "ok.png")
    text_row = {"prompt": "hello"}
    cases = {
        "missing": (
            "img/none.png",
            'row 2: field "messages[0].content[0]": image img/none.png: file not found',
        ),
        "unreadable": (
            "notes.png",
            'row 2: field "messages[0].content[0]": image notes.png is not an image PIL',
        ),
    }
    out = tmp_path / "out.jsonl"
    for name, (path, expected) in cases.items():
        rows = tmp_path / f"{name}.jsonl"
        bad = {"messages": [user_turn({"type": "image", "path": path}, "What shape is this?")]}
        rows.write_text(json.dumps(text_row) + "\n" + json.dumps(bad) + "\n")
        line = one_line_error("generate", str(run), "--prompts", str(rows), "--out", str(out))
        assert expected in line and f"{name}.jsonl" in line, line
        assert not out.exists()
    rows = tmp_path / "text-model.jsonl"
    rows.write_text(
        json.dumps(text_row)
        + "\n"
        + json.dumps({"messages": [user_turn({"type": "image", "path": "ok.png"}, "Hi")]})
        + "\n"
    )
    line = one_line_error(
        "generate", str(QUICKSTART), "--format", "chat", "--prompts", str(rows), "--out", str(out)
    )
    assert "text-model.jsonl row 2: an image prompt, but model" in line and "is a text-only model" in line, (
        line
    )
    assert not out.exists()
    line = one_line_error("chat", str(QUICKSTART), "--format", "chat", "--image", str(tmp_path / "ok.png"))
    assert "takes no images (a text-only model)" in line, line
    line = one_line_error("chat", str(run), "--image", str(tmp_path / "notes.png"))
    assert "notes.png is not an image PIL can read" in line, line


def test_merge_of_a_vlm_run_checks_image_logits(run: Path, tmp_path: Path, monkeypatch) -> None:
    """The merge passes its check on token ids and on an image batch; a projector weight changed in the
    merged model passes the token probe (no image reaches the projector) and fails the image probe."""
    from peft.tuners.lora import LoraModel

    from liger_cli.merge import merge_adapter
    from liger_cli.run.verify import NotVerified

    merged = tmp_path / "merged"
    code, output = invoke("merge", str(run), str(merged))
    assert code == 0 and "on probe batches of token ids and of images" in output, output[-3000:]
    assert (merged / "processor_config.json").is_file()

    real_merge = LoraModel.merge_and_unload

    def tampered(self, *args, **kwargs):
        model = real_merge(self, *args, **kwargs)
        with torch.no_grad():
            model.model.multi_modal_projector.linear_1.weight.mul_(1.5)
        return model

    monkeypatch.setattr(LoraModel, "merge_and_unload", tampered)
    with pytest.raises(NotVerified, match="on the image probe: largest logit difference"):
        merge_adapter(run, tmp_path / "bad")
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad*"))


def test_image_prompts_on_a_multimodal_rope_model_are_refused_not_misplaced() -> None:
    """Qwen2-VL places its image tokens from the image grid (M-RoPE); the engine's text positions would
    put them wrong silently, so its image prompts are refused (text prompts still generate), and a
    LLaVA-style model, whose positions are plain text positions, is not refused."""
    from transformers import AutoModelForImageTextToText
    from vlm_models import CONFIGS, _tokenizer, image_inputs

    from liger_cli.errors import UserError
    from liger_cli.generate.engine import Sampling, generate, places_its_own_positions

    models = {}
    for family in ("qwen2_vl", "llava"):
        make, tokens = CONFIGS[family]
        torch.manual_seed(0)
        models[family] = AutoModelForImageTextToText.from_config(make(_tokenizer(tokens))).eval()
    qwen = models["qwen2_vl"]
    assert places_its_own_positions(qwen) and not places_its_own_positions(models["llava"])
    image = image_inputs(qwen.config, 1, torch.Generator().manual_seed(0))
    prompt = [[qwen.config.vision_start_token_id] + [qwen.config.image_token_id] * 4 + [5, 6]]
    with pytest.raises(UserError, match="multimodal RoPE"):
        generate(qwen, prompt, Sampling(max_new_tokens=2), pad_id=0, stop_ids=[], inputs=image)
    text = generate(qwen, [[5, 6, 7]], Sampling(max_new_tokens=2), pad_id=0, stop_ids=[])
    assert len(text[0].ids) == 2
