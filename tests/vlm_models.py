"""Tiny vision-language models for the tests, saved with `save_pretrained` and loaded back through the real
`from_pretrained` path, and synthetic image batches for them: input_ids holding the model's image token as
many times as its vision tower makes features, and matching random pixel inputs."""

from __future__ import annotations

from pathlib import Path

import torch

QUICKSTART_MODEL = Path(__file__).resolve().parents[1] / "recipes" / "quickstart" / "model"
IMAGE_TOKENS = {"llava": 4, "qwen2_vl": 4}
"""Tokens one image becomes: LLaVA, a 28x28 image in 14x14 patches (the CLS feature dropped); Qwen2-VL, a
56x56 image in 4x4 patches of 14, merged 2x2."""


def _tokenizer(extra: list[str]):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(QUICKSTART_MODEL)
    tokenizer.add_special_tokens({"additional_special_tokens": extra})
    return tokenizer


def _text(tokenizer, model_type: str, **extra):
    """The tests' tiny text model sizes (conftest's), as the text config of `model_type`."""
    from conftest import tiny_llama_settings
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**tiny_llama_settings(tokenizer), **extra})


def llava_config(tokenizer):
    from transformers import CLIPVisionConfig, LlavaConfig

    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=28, patch_size=14, projection_dim=32,
    )  # fmt: skip
    return LlavaConfig(
        text_config=_text(tokenizer, "llama"),
        vision_config=vision,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        image_seq_length=IMAGE_TOKENS["llava"],
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )


def qwen2_vl_config(tokenizer):
    from transformers import Qwen2VLConfig

    ids = dict(zip(("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"),
                   tokenizer.convert_tokens_to_ids(QWEN_TOKENS), strict=True))  # fmt: skip
    text = _text(
        tokenizer, "qwen2_vl_text", rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1]}
    )
    vision = {"depth": 2, "embed_dim": 32, "hidden_size": 32, "num_heads": 4, "mlp_ratio": 2, "patch_size": 14,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3}  # fmt: skip
    return Qwen2VLConfig(text_config=text.to_dict(), vision_config=vision, tie_word_embeddings=False, **ids)


QWEN_TOKENS = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
CONFIGS = {"llava": (llava_config, ["<image>"]), "qwen2_vl": (qwen2_vl_config, QWEN_TOKENS)}


def save_tiny_vlm(path: Path, family: str = "llava", seed: int = 0) -> Path:
    """A tiny VLM of `family` (llava, qwen2_vl) with the quickstart tokenizer plus its image tokens."""
    from transformers import AutoModelForImageTextToText

    make, tokens = CONFIGS[family]
    tokenizer = _tokenizer(tokens)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(make(tokenizer))
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def image_inputs(config, images: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Random pixel inputs for `images` images, shaped as the family's processor makes them."""
    if config.model_type == "qwen2_vl":
        v = config.vision_config
        per_patch = v.in_channels * v.temporal_patch_size * v.patch_size**2
        return {
            "pixel_values": torch.randn(images * 16, per_patch, generator=generator),
            "image_grid_thw": torch.tensor([[1, 4, 4]] * images),
        }
    v = config.vision_config
    return {"pixel_values": torch.randn(images, 3, v.image_size, v.image_size, generator=generator)}


def image_batch(config, rows: list[tuple[list[int], list[int]]], seed: int) -> dict[str, torch.Tensor]:
    """A batch of (input_ids, labels) rows, each behind one image (its tokens, never learned), padded on
    the right; pixel inputs from `seed`. Qwen2-VL also gets `mm_token_type_ids` (its processor's output,
    which its M-RoPE positions need); no position_ids: the model computes its own."""
    n = IMAGE_TOKENS[config.model_type]
    pad = config.get_text_config().pad_token_id
    start = [config.vision_start_token_id] if config.model_type == "qwen2_vl" else []
    head = [*start, *[config.image_token_id] * n]
    length = max(len(head) + len(ids) for ids, _ in rows)
    batch = {"input_ids": [], "labels": [], "attention_mask": [], "mm_token_type_ids": []}
    for ids, labels in rows:
        fill = length - len(head) - len(ids)
        batch["input_ids"].append(head + list(ids) + [pad] * fill)
        batch["labels"].append([-100] * len(head) + list(labels) + [-100] * fill)
        batch["attention_mask"].append([1] * (len(head) + len(ids)) + [0] * fill)
        batch["mm_token_type_ids"].append([0] * len(start) + [1] * n + [0] * (len(ids) + fill))
    if config.model_type != "qwen2_vl":
        del batch["mm_token_type_ids"]
    tensors = {k: torch.tensor(v) for k, v in batch.items()}
    return tensors | image_inputs(config, len(rows), torch.Generator().manual_seed(seed))


# A driver for `liger_cli.run.train.run` on image rows until the data stage makes them: the run's own
# loop, with the SFT objective's batches given an image each (`image_batch`). After training on one
# process it writes the trained model's state and the names of its trainable parameters beside the
# run's output. Under torchrun each rank runs it. Arguments: the tests folder, then one or more recipes,
# trained one after the other in this process (one interpreter start for all).
IMAGE_RUN_DRIVER = """
import sys
sys.path.insert(0, sys.argv[1])
from safetensors.torch import save_file
from transformers import AutoConfig
from vlm_models import image_batch
from liger_cli.model.objectives import CausalLM
from liger_cli.plan import build_plan
from liger_cli.recipe import load_recipe
from liger_cli.run import train

class ImageRows(CausalLM):
    def collate(self, examples, pad_id):
        rows = [(list(ex["input_ids"]), list(ex["labels"])) for ex in examples]
        return image_batch(config, rows, seed=sum(map(sum, (ids for ids, _ in rows))))

real_finish = train.finish

def finish(trainer, last):
    if trainer.backend.accelerator.num_processes > 1:  # sharded tensors: the run's own checks only
        return real_finish(trainer, last)
    model = trainer.backend.accelerator.unwrap_model(trainer.model)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    trainable = ",".join(k for k, p in model.named_parameters() if p.requires_grad)
    save_file(state, str(recipe.output.dir / "trained.safetensors"), metadata={"trainable": trainable})
    real_finish(trainer, last)

train.objective_for = lambda recipe: ImageRows()
train.finish = finish
for path in sys.argv[2:]:
    recipe = load_recipe(path)
    config = AutoConfig.from_pretrained(recipe.model.path)
    train.run(recipe, build_plan(recipe))
"""
