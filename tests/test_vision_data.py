"""Chat rows with images: the processor's tokens and pixels, labels, errors, the cache and `liger data`.

Everything runs on the shipped tiny LLaVA (recipes/vision/model, scripts/make_vision_assets.py): its
LlavaProcessor expands each `<image>` into 16 image tokens and gives pixel_values [images, 3, 32, 32].
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from liger_cli import cli
from liger_cli.data import collate, prepare_data
from liger_cli.data.encode import IGNORE_INDEX
from liger_cli.errors import UserError

MODEL = Path(__file__).resolve().parents[1] / "recipes" / "vision" / "model"
QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart" / "model"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def processor():
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(MODEL)


def png(colour, size=(32, 32), shape=None) -> bytes:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, (128, 128, 128))
    ImageDraw.Draw(image).rectangle((4, 4, 20, 20), fill=colour)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def image_row(parts_before: list[dict], answer: str, question: str = "What colour is the shape?") -> dict:
    user = [*parts_before, {"type": "text", "text": question}]
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def write_data(folder: Path, rows: list[dict], name: str = "train.jsonl") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def config(train: Path, **overrides):
    settings = dict(train=train, eval=None, eval_fraction=None, format="chat", max_seq_len=128, packing=False)
    settings["cache"] = False
    return SimpleNamespace(**(settings | overrides))


@pytest.fixture
def two_images(tmp_path) -> Path:
    """Two image rows (a red one by path, a blue one by path in a subfolder) and a text-only row."""
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "red.png").write_bytes(png((220, 40, 40)))
    (tmp_path / "img" / "blue.png").write_bytes(png((40, 70, 220)))
    text = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]}
    rows = [
        image_row([{"type": "image", "path": "img/red.png"}], "red"),
        text,
        image_row([{"type": "image", "path": "img/blue.png"}], "blue"),
    ]
    return write_data(tmp_path, rows)


def rendered_reference(processor, row: dict, images: list[bytes]):
    """What the model's own processor makes of the row: its chat template, then text + images."""
    from PIL import Image

    text = processor.apply_chat_template(row["messages"], tokenize=False)
    pictures = [Image.open(io.BytesIO(data)) for data in images]
    return processor(text=[text], images=pictures, add_special_tokens=False, return_tensors="pt")


def test_ids_labels_and_pixels_are_the_processors(two_images, tokenizer, processor):
    import torch

    train, _ = prepare_data(config(two_images), tokenizer, seed=0)
    ex = train.examples
    assert ex["row"] == [0, 1, 2]
    rows = [json.loads(line) for line in two_images.read_text().splitlines()]
    for k, colour in ((0, "red"), (2, "blue")):
        data = (two_images.parent / "img" / f"{colour}.png").read_bytes()
        reference = rendered_reference(processor, rows[k], [data])
        ids, labels = ex[k]["input_ids"], ex[k]["labels"]
        assert ids == reference["input_ids"][0].tolist()  # image tokens expanded as the processor does
        image_id = processor.image_token_id
        assert ex[k]["image_tokens"] == [ids.count(image_id)] == [16]
        assert ex[k]["image_starts"] == [ids.index(image_id)]
        learned = [t for t, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX]
        assert tokenizer.decode(learned) == f"{colour}</s>\n"  # the assistant's text and its turn end only
        assert all(label == IGNORE_INDEX for t, label in zip(ids, labels, strict=True) if t == image_id)
    # The text-only row beside them is encoded exactly as a text source encodes it.
    from liger_cli.data.chat import encode_chat

    text = encode_chat(rows[1], tokenizer)
    assert (ex[1]["input_ids"], ex[1]["labels"], ex[1]["image_tokens"]) == (text.input_ids, text.labels, [])

    batch = collate([train.dataset[k] for k in range(3)], tokenizer.pad_token_id)
    images = [(two_images.parent / "img" / f"{c}.png").read_bytes() for c in ("red", "blue")]
    expected = processor.image_processor([rendered_image(d) for d in images], return_tensors="pt")
    # no position_ids: the model places its own (M-RoPE models from the image grid)
    assert set(batch) == {"input_ids", "labels", "attention_mask", "pixel_values"}
    assert batch["pixel_values"].shape == (2, 3, 32, 32)
    assert torch.equal(batch["pixel_values"], expected["pixel_values"])


def rendered_image(data: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(data))


def test_the_model_takes_the_batch(two_images, tokenizer):
    """The collated batch is the forward's keywords: the loss is finite and counts the learned tokens."""
    import torch
    from transformers import AutoModelForImageTextToText

    train, _ = prepare_data(config(two_images), tokenizer, seed=0)
    batch = collate([train.dataset[k] for k in range(3)], tokenizer.pad_token_id)
    model = AutoModelForImageTextToText.from_pretrained(MODEL)
    loss = model(**batch).loss
    assert torch.isfinite(loss)


def test_data_uri_and_relative_path_give_the_same_example(tmp_path, tokenizer):
    data = png((40, 170, 60))
    (tmp_path / "g.png").write_bytes(data)
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    rows = [
        image_row([{"type": "image", "path": "../g.png"}], "green"),  # relative to d/
        image_row([{"type": "image", "image": uri}], "green"),
        image_row([{"type": "image", "path": str(tmp_path / "g.png")}], "green"),  # absolute
    ]
    train, _ = prepare_data(config(write_data(tmp_path / "d", rows)), tokenizer, seed=0)
    first = train.examples[0]
    for k in (1, 2):
        other = train.examples[k]
        assert (other["input_ids"], other["labels"], other["images"]) == (
            first["input_ids"],
            first["labels"],
            first["images"],
        )
    assert train.examples["image_files"] == [
        [str((tmp_path / "g.png").resolve())],
        [""],
        [str(tmp_path / "g.png")],
    ]


def test_batch_images_joins_along_dim_0_as_the_processor_does():
    """The generic rule on a Qwen2-VL image processor (flattened patches + image_grid_thw): each row's
    tensors joined along dim 0 equal the processor's output for all the images at once."""
    import numpy as np
    import torch
    from safetensors.numpy import save
    from transformers import Qwen2VLImageProcessor

    from liger_cli.data.images import batch_images

    proc = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112)
    images = [rendered_image(png((200, 0, 0), (56, 56))), rendered_image(png((0, 0, 200), (112, 56)))]
    rows = [proc([image], return_tensors="np") for image in images]
    blobs = [save({k: np.ascontiguousarray(v) for k, v in row.items()}) for row in rows]
    together = proc(images, return_tensors="pt")
    joined = batch_images([blobs[0], b"", blobs[1]], [5, 5, 5], 5)
    assert joined["pixel_values"].shape[0] == int(together["image_grid_thw"].prod(-1).sum())
    assert torch.equal(joined["pixel_values"], together["pixel_values"])
    assert torch.equal(joined["image_grid_thw"], together["image_grid_thw"])


def test_align_where_the_expansion_adds_tokens_around_the_image():
    """A Gemma-3-like expansion (the placeholder becomes newline, start, image tokens, end, newline):
    the labels carry over, the image's tokens and its start are found."""
    from liger_cli.data.image_rows import align

    image, start, end, nl = 9, 7, 8, 5
    plain = [1, 2, start, 3, 4, 6]
    labels = [-100, -100, -100, -100, 4, 6]
    expanded = [1, 2, nl, start, image, image, image, end, nl, 3, 4, 6]
    out, starts, counts, _ = align(plain, labels, expanded, image, 1)
    assert (starts, counts) == ([4], [3])
    assert out == [-100] * 10 + [4, 6]


def cli_recipe(tmp_path: Path, train: Path, **data) -> Path:
    recipe = tmp_path / "recipe.yaml"
    extra = "".join(f"\n  {k}: {v}" for k, v in data.items())
    recipe.write_text(
        f"model: {{path: {MODEL}, dtype: float32}}\n"
        f"data:\n  train: {train}\n  format: chat\n  max_seq_len: 64\n  packing: false\n  cache: false{extra}\n"
        f"output: {{dir: {tmp_path / 'out'}}}\n"
    )
    return recipe


def test_liger_data_reports_images(two_images, tmp_path):
    result = CliRunner().invoke(cli.app, ["data", str(cli_recipe(tmp_path, two_images)), "--show", "1"])
    assert result.exit_code == 0, result.output
    assert "images: 2 in 2 of 3 examples, 32 image tokens" in result.output
    assert "tokens per image: min 16, median 16, max 16" in result.output
    assert "first token of each image: min 3, median 3, max 3" in result.output
    assert (
        f"image 1: {(two_images.parent / 'img' / 'red.png').resolve()}, tokens 3-18 (16 tokens)"
        in result.output
    )
    # The image's 16 tokens shown as one mark where they sit; the answer learned.
    shown = "<s><|user|>\n<image 1: 16 tokens>\nWhat colour is the shape?\n<|assistant|>\n[[red</s>\n]]"
    assert shown in result.output


@pytest.mark.parametrize("broken", ["missing", "unreadable"])
def test_a_bad_image_is_exit_2_naming_row_and_file(tmp_path, broken):
    (tmp_path / "ok.png").write_bytes(png((1, 2, 3)))
    if broken == "unreadable":
        (tmp_path / "bad.png").write_bytes(b"not a png at all")
    rows = [
        image_row([{"type": "image", "path": "ok.png"}], "x"),
        image_row([{"type": "image", "path": "bad.png"}], "y"),
    ]
    train = write_data(tmp_path, rows)
    result = CliRunner().invoke(cli.app, ["data", str(cli_recipe(tmp_path, train))])
    assert result.exit_code == 2, result.output
    line = result.output.strip().splitlines()[-1]
    assert f"{train} row 2" in line and 'field "messages[0].content[0]": image bad.png' in line
    assert ("file not found" if broken == "missing" else "is not an image PIL can read") in line
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


def test_packing_and_a_model_without_processor_are_refused(two_images, tmp_path):
    from transformers import AutoTokenizer

    result = CliRunner().invoke(
        cli.app, ["data", str(cli_recipe(tmp_path, two_images)), "--set", "data.packing=true"]
    )
    assert result.exit_code == 2
    assert "packing does not apply to rows with images" in result.output
    with pytest.raises(
        UserError, match=rf"rows with images need the model's processor, and {QUICKSTART} has none"
    ):
        prepare_data(config(two_images), AutoTokenizer.from_pretrained(QUICKSTART), seed=0)


def test_a_bad_part_is_named(tmp_path, tokenizer):
    rows = [image_row([{"type": "image", "url": "https://example.com/a.png"}], "x")]
    with pytest.raises(
        UserError, match=r'row 1: field "messages\[0\]\.content\[0\]": image parts with "url"'
    ):
        prepare_data(config(write_data(tmp_path, rows)), tokenizer, seed=0)


def test_the_cache_is_keyed_on_image_bytes(two_images, tokenizer, processor, tmp_path):
    import torch

    from liger_cli.data.images import image_key

    cfg = config(two_images, cache=True, cache_dir=tmp_path / "cache")
    red = two_images.parent / "img" / "red.png"
    key = image_key([str(red.resolve())], tokenizer)
    first, _ = prepare_data(cfg, tokenizer, seed=0)
    again, _ = prepare_data(cfg, tokenizer, seed=0)
    assert first.cache.startswith("built") and again.cache.startswith("hit")
    assert again.examples["images"] == first.examples["images"]

    red.write_bytes(png((200, 200, 0)))  # same name, other bytes
    assert image_key([str(red.resolve())], tokenizer) != key
    changed, _ = prepare_data(cfg, tokenizer, seed=0)
    assert changed.cache.startswith("built")
    batch = collate([changed.dataset[0]], tokenizer.pad_token_id)
    expected = processor.image_processor([rendered_image(red.read_bytes())], return_tensors="pt")[
        "pixel_values"
    ]
    assert torch.equal(batch["pixel_values"], expected)


def test_images_outside_the_image_path_are_refused(tokenizer):
    """Preference pairs, prompts and a stream never render an image placeholder without its pixels."""
    from liger_cli.data.build import encoder
    from liger_cli.data.files import row_check

    user = image_row([{"type": "image", "path": "a.png"}], "x")["messages"][:1]
    answer = [{"role": "assistant", "content": "x"}]
    pair = {"prompt": user, "chosen": answer, "rejected": [{"role": "assistant", "content": "y"}]}
    assert (
        row_check("preference")(pair) == 'field "prompt[0].content[0]": images are read in format chat only'
    )
    assert (
        row_check("prompt")({"prompt": user})
        == 'field "prompt[0].content[0]": images are read in format chat only'
    )
    found = encoder("chat", config(Path("x.jsonl")))([{"messages": user + answer}], tokenizer)
    assert isinstance(found[0], ValueError) and "rows with images cannot be streamed" in str(found[0])


def test_a_mixture_of_image_and_text_sources(two_images, tokenizer, tmp_path):
    """A text-only source mixed with one of images: its examples get no images and stay as they were."""
    text_rows = [
        {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]}
    ]
    text_file = write_data(tmp_path / "text", text_rows)
    alone, _ = prepare_data(config(text_file), tokenizer, seed=0)
    cfg = config([{"path": two_images, "weight": 1}, {"path": text_file, "weight": 1}])
    mixed, _ = prepare_data(cfg, tokenizer, seed=0)
    from_text = [k for k, source in enumerate(mixed.source_of) if source == 1]
    assert from_text and all(mixed.examples[k]["images"] == b"" for k in from_text)
    assert mixed.examples[from_text[0]]["input_ids"] == alone.examples[0]["input_ids"]
    batch = collate([mixed.dataset[k] for k in range(len(mixed.dataset))], tokenizer.pad_token_id)
    assert batch["pixel_values"].shape[0] == sum(len(x) for x in mixed.examples["image_tokens"])


def test_truncation_that_cuts_an_image_drops_the_row(two_images, tokenizer):
    """A learned answer before the cut, an image across it: the row goes (the model needs every image
    token it is given); cut after the image, it stays."""
    from liger_cli.data.build import CUT_IMAGE

    first = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]
    later = image_row([{"type": "image", "path": "img/red.png"}], "red")["messages"]
    data = write_data(two_images.parent, [{"messages": first + later}, {"messages": first}], "long.jsonl")
    whole, _ = prepare_data(config(data), tokenizer, seed=0)
    start = whole.examples[0]["image_starts"][0]
    cut, _ = prepare_data(config(data, max_seq_len=start + 8), tokenizer, seed=0)
    assert cut.dropped == {CUT_IMAGE: 1} and cut.examples["row"] == [1]
    kept, _ = prepare_data(config(data, max_seq_len=start + 16), tokenizer, seed=0)
    assert kept.dropped == {} and kept.truncated == 1 and kept.examples["row"] == [0, 1]


def test_a_processor_without_chat_template_is_named(two_images, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    from liger_cli.data.images import remember_model

    model = tmp_path / "model"
    shutil.copytree(MODEL, model)
    template = (model / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").unlink()
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = template  # the text side has one, the processor none
    remember_model(tokenizer, model, False)
    with pytest.raises(UserError, match=rf"the processor at {model} has no chat template"):
        prepare_data(config(two_images), tokenizer, seed=0)


def test_two_images_in_one_row_keep_their_order(two_images, tokenizer, processor):
    import torch

    red, blue = (two_images.parent / "img" / f"{c}.png" for c in ("red", "blue"))
    parts = [{"type": "image", "path": "img/red.png"}, {"type": "text", "text": "and"}]
    row = image_row([*parts, {"type": "image", "path": "img/blue.png"}], "red blue", "Which colours?")
    train, _ = prepare_data(config(write_data(two_images.parent, [row], "two.jsonl")), tokenizer, seed=0)
    ex = train.examples[0]
    reference = rendered_reference(processor, row, [red.read_bytes(), blue.read_bytes()])
    ids = reference["input_ids"][0].tolist()
    assert ex["input_ids"] == ids and ex["image_tokens"] == [16, 16]
    second = ids.index(processor.image_token_id, ex["image_starts"][0] + 16)
    assert ex["image_starts"] == [ids.index(processor.image_token_id), second]
    batch = collate([train.dataset[0]], tokenizer.pad_token_id)
    assert torch.equal(batch["pixel_values"], reference["pixel_values"])


def test_image_rows_use_the_processors_template(two_images):
    """A tokenizer whose own template differs (many VLMs keep theirs only in the processor): image rows
    are rendered by the processor's, rows without images by the tokenizer's, as before."""
    from transformers import AutoProcessor, AutoTokenizer

    from liger_cli.data.chat import encode_chat

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    processor = AutoProcessor.from_pretrained(MODEL)
    tokenizer.chat_template = processor.chat_template.replace("|>\n'", "|>\n\n'")
    assert tokenizer.chat_template != processor.chat_template
    train, _ = prepare_data(config(two_images), tokenizer, seed=0)
    rows = [json.loads(line) for line in two_images.read_text().splitlines()]
    red = (two_images.parent / "img" / "red.png").read_bytes()
    assert (
        train.examples[0]["input_ids"]
        == rendered_reference(processor, rows[0], [red])["input_ids"][0].tolist()
    )
    assert train.examples[1]["input_ids"] == encode_chat(rows[1], tokenizer).input_ids


def test_flat_values_follows_a_selection():
    """The report's column operation: a selection's lists joined in its order, as row by row would."""
    import datasets

    from liger_cli.data.columns import flat_values

    table = datasets.Dataset.from_dict({"image_tokens": [[16], [], [4, 9], [25], [1, 2, 3]]})
    picked = table.select([3, 0, 4, 2, 1], keep_in_memory=True)
    assert flat_values(picked, "image_tokens").tolist() == [25, 16, 1, 2, 3, 4, 9]
    assert flat_values(table, "image_tokens").tolist() == [16, 4, 9, 25, 1, 2, 3]


@pytest.fixture(scope="module")
def gemma_style(tmp_path_factory) -> Path:
    """A Gemma3Processor (Pil image processor, no torchvision) over a tiny tokenizer: the text holds a
    `<start_of_image>` placeholder per image, which the processor expands into a newline block, the
    placeholder, 4 `<image_soft_token>`s and `<end_of_image>`; the config names the soft token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor, PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>", "<start_of_image>", "<image_soft_token>", "<end_of_image>"]
    specials += ["<|user|>", "<|assistant|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["What colour is the shape? red green blue"] * 10, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        **dict(bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"),
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "image_token": "<image_soft_token>",
            "eoi_token": "<end_of_image>",
        },
    )
    template = (MODEL / "chat_template.jinja").read_text().replace("<image>", "<start_of_image>")
    images = Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    folder = tmp_path_factory.mktemp("gemma_style")
    Gemma3Processor(
        image_processor=images, tokenizer=tokenizer, chat_template=template, image_seq_length=4
    ).save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"image_token_id": tokenizer.image_token_id}))
    return folder


def test_an_expansion_that_adds_text_around_the_image(gemma_style, two_images):
    """Gemma 3's expansion is not a repeat of the placeholder: the diff path carries the labels over
    and counts each image's soft tokens, exactly as the processor writes them."""
    import torch
    from transformers import AutoProcessor, AutoTokenizer

    tokenizer, processor = (
        AutoTokenizer.from_pretrained(gemma_style),
        AutoProcessor.from_pretrained(gemma_style),
    )
    train, _ = prepare_data(config(two_images), tokenizer, seed=0)
    rows = [json.loads(line) for line in two_images.read_text().splitlines()]
    red = (two_images.parent / "img" / "red.png").read_bytes()
    reference = rendered_reference(processor, rows[0], [red])
    ids, labels = train.examples[0]["input_ids"], train.examples[0]["labels"]
    soft = tokenizer.image_token_id
    assert ids == reference["input_ids"][0].tolist() and ids.count(soft) == 4
    assert train.examples[0]["image_tokens"] == [4] and train.examples[0]["image_starts"] == [ids.index(soft)]
    learned = [t for t, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX]
    assert tokenizer.decode(learned) == "red</s>\n"
    batch = collate([train.dataset[0], train.dataset[1]], tokenizer.pad_token_id)
    assert torch.equal(batch["pixel_values"][:1], reference["pixel_values"])
    # Gemma 3's token_type_ids (which tokens are image tokens) come along, padded like input_ids: the
    # processor's own for the image row, 0 for padding.
    n = len(ids)
    types = torch.as_tensor(reference["token_type_ids"][0])
    assert batch["token_type_ids"].shape == batch["input_ids"].shape
    assert torch.equal(batch["token_type_ids"][0, :n], types) and types.sum() == 4
    assert not batch["token_type_ids"][0, n:].any() and "position_ids" not in batch
