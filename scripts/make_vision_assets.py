"""Build the offline vision assets under recipes/vision/ (a tiny LLaVA-style model, its processor, images, data).

A vision-language recipe must run with no network and no model hub, so the repo ships everything it
needs and this script is how those files were made. It is deterministic (fixed seeds, one thread)
and runs in seconds on 2 CPU cores:

    python scripts/make_vision_assets.py              # everything
    python scripts/make_vision_assets.py --skip-model  # images, data and processor only

The task: a plain background with one shape on it (a circle, a square or a triangle, in red, green,
blue or yellow); the user asks for its colour or its shape, the assistant answers in one word. The
eval images are drawn apart from the train ones (other sizes, places and backgrounds: the same task,
images the model has not seen), so eval measures reading the image, not remembering it.

The model is `LlavaForConditionalGeneration`: a tiny CLIP vision tower, a projector, and a tiny Llama
language model (so liger's Llama kernels apply to it), float32, in safetensors. Its processor is a
`LlavaProcessor` made of `CLIPImageProcessorPil` (no torchvision needed) and a byte-level BPE
tokenizer with an `<image>` token and a chat template that renders content-part lists.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "recipes" / "vision"
SEED = 0
IMAGE_SIZE = 32
PATCH_SIZE = 8  # 4 x 4 patches: each image becomes 16 image tokens
VOCAB_SIZE = 384
IMAGE_TOKEN = "<image>"
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", IMAGE_TOKEN, "<|system|>", "<|user|>", "<|assistant|>"]

# Every turn is "<|role|>\n" + content + "\n", an assistant turn ends with eos; content is a string or
# a list of parts, an image part written as the image token on its own line. Rendering a prefix of the
# messages gives a prefix of the text, which liger_cli.data needs to find the assistant turns.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '" + IMAGE_TOKEN + "\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (235, 210, 40)}
SHAPES = ("circle", "square", "triangle")
QUESTIONS = {
    "colour": ["What colour is the shape?", "Which colour is it?", "Name the colour of the shape."],
    "shape": ["What shape is this?", "Which shape do you see?", "Name the shape."],
}


# ---------------------------------------------------------------- images
def draw(shape: str, colour: str, rng: random.Random):
    """One IMAGE_SIZE x IMAGE_SIZE RGB image: a grey background, the shape at a random size and place."""
    from PIL import Image, ImageDraw

    grey = rng.randint(70, 200)
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (grey, grey, grey))
    pen = ImageDraw.Draw(image)
    size = rng.randint(12, 24)
    x, y = rng.randint(1, IMAGE_SIZE - size - 1), rng.randint(1, IMAGE_SIZE - size - 1)
    box = (x, y, x + size, y + size)
    fill = COLOURS[colour]
    if shape == "circle":
        pen.ellipse(box, fill=fill)
    elif shape == "square":
        pen.rectangle(box, fill=fill)
    else:
        pen.polygon([(x + size // 2, y), (x, y + size), (x + size, y + size)], fill=fill)
    return image


def write_split(name: str, per_kind: int, rng: random.Random) -> int:
    """Draw per_kind images of every (shape, colour), and two rows per image (its colour, its shape)."""
    data = OUT / "data"
    (data / "img").mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in SHAPES:
        for colour in COLOURS:
            for _ in range(per_kind):
                file = f"img/{name}-{len(rows) // 2 + 1:03d}.png"  # names that do not give the answer away
                draw(shape, colour, rng).save(data / file, optimize=True)
                for asked, answer in (("colour", colour), ("shape", shape)):
                    question = rng.choice(QUESTIONS[asked])
                    user = [{"type": "image", "path": file}, {"type": "text", "text": question}]
                    rows.append(
                        {
                            "messages": [
                                {"role": "user", "content": user},
                                {"role": "assistant", "content": answer},
                            ]
                        }
                    )
    rng.shuffle(rows)
    with open(data / f"{name}.jsonl", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {data / f'{name}.jsonl'} ({len(rows)} rows)")
    return len(rows)


# ---------------------------------------------------------------- processor
def corpus(rng: random.Random) -> list[str]:
    """Text for the tokenizer: the questions, the answers and the template's words."""
    words = [*COLOURS, *SHAPES, *(q for qs in QUESTIONS.values() for q in qs)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 6))) for _ in range(2000)] + words


def build_processor(texts: list[str]):
    """A byte-level BPE tokenizer (any text tokenizes) with the special tokens and the chat template,
    and the CLIP image processor, composed into the LlavaProcessor the model's forward expects."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import CLIPImageProcessorPil, LlavaProcessor, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=SPECIAL_TOKENS[4:],
        model_max_length=256,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    images = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    return LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",  # the CLS feature is dropped...
        num_additional_image_tokens=1,  # ...so 16 patches + CLS - CLS = 16 image tokens
        chat_template=CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
    )


# ---------------------------------------------------------------- model
def model_config(tokenizer):
    """CLIP vision tower (2 layers, hidden 64) + projector + the quickstart's Llama shape (2 layers,
    hidden 128, GQA 4/2: scripts/make_quickstart_assets.py), so the same kernels and twin apply."""
    from make_quickstart_assets import model_config as llama_config  # scripts/ is this script's folder
    from transformers import CLIPVisionConfig, LlavaConfig

    text = llama_config(tokenizer)
    vision = CLIPVisionConfig(
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        projection_dim=64,
    )
    return LlavaConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_model(tokenizer):
    import torch
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(SEED)
    model = LlavaForConditionalGeneration(model_config(tokenizer)).to(torch.float32)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters")
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-model", action="store_true", help="images, data and processor only")
    args = parser.parse_args()

    model_dir = OUT / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    write_split("train", per_kind=20, rng=random.Random(SEED + 1))
    write_split("eval", per_kind=5, rng=random.Random(SEED + 2))
    processor = build_processor(corpus(random.Random(SEED)))
    processor.save_pretrained(model_dir)
    print(f"wrote the processor to {model_dir} (vocab {len(processor.tokenizer)})")
    if args.skip_model:
        return
    import torch

    torch.set_num_threads(1)
    build_model(processor.tokenizer).save_pretrained(model_dir)  # config.json + model.safetensors
    print(f"wrote the model to {model_dir}")


if __name__ == "__main__":
    main()
