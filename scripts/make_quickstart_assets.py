"""Build the offline quickstart assets under recipes/quickstart/ (tokenizer, base model, data).

The quickstart must run with no network and no model hub, so the repo ships everything it needs and
this script is how those files were made. It is deterministic (fixed seeds, one thread) and runs in
well under a minute on 2 CPU cores:

    python scripts/make_quickstart_assets.py            # everything
    python scripts/make_quickstart_assets.py --skip-model  # data + tokenizer only

The task: turn a number (0-999) into English words, and English words back into digits. The base
model is briefly pre-trained on generic text that uses both number words and digits but never pairs
them, so it knows the vocabulary and the counting order but not the mapping; fine-tuning teaches the
mapping, which is deterministic, so the eval loss can fall a long way (and the change is visible in
what the model generates, not only in the loss).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "recipes" / "quickstart"
SEED = 0
VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]

# A simple chat template: every turn is "<|role|>\ncontent\n"; an assistant turn ends with eos so the
# model learns to stop. Rendering a prefix of the messages gives a prefix of the tokens, which is what
# liger_cli.data needs to find the assistant spans.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen".split()
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def number_words(n: int) -> str:
    """English words for 0 <= n <= 999, e.g. 347 -> 'three hundred forty-seven'."""
    if n < 20:
        return ONES[n]
    if n < 100:
        tens, ones = divmod(n, 10)
        return TENS[tens] + ("-" + ONES[ones] if ones else "")
    hundreds, rest = divmod(n, 100)
    return ONES[hundreds] + " hundred" + (" " + number_words(rest) if rest else "")


# ---------------------------------------------------------------- generic "pre-training" text
SUBJECTS = (
    "the farmer|the teacher|my sister|our neighbour|the old man|a young girl|the baker|the driver|"
    "the doctor|a small child|the captain|his brother|her mother|the student|the painter|the king"
).split("|")
VERBS = (
    "found|bought|carried|painted|counted|sold|planted|cleaned|lost|collected|washed|packed|moved|"
    "ordered|borrowed|kept"
).split("|")
ADJECTIVES = (
    "red|green|blue|small|large|old|new|heavy|bright|quiet|wooden|round|yellow|soft|clean|warm".split("|")
)
NOUNS = (
    "apples|boxes|books|chairs|stones|flowers|letters|bottles|coins|shirts|candles|baskets|tables|"
    "lamps|cups|pencils|keys|plates|ropes|buckets"
).split("|")
PLACES = (
    "in the garden|at the market|near the river|in the kitchen|on the hill|at the station|in the library|"
    "behind the house|by the lake|in the village|at the school|on the farm"
).split("|")
TIMES = (
    "yesterday|this morning|last week|on monday|after lunch|before dinner|every day|in the spring|at night|"
    "on sunday|in the evening|last year"
).split("|")
FILLERS = [
    "it was a long day, and everyone was tired.",
    "the weather was cold, but the sky was clear.",
    "nobody knew where the road would lead.",
    "she opened the window and listened to the rain.",
    "they walked home slowly and talked about the future.",
    "the shop was closed, so he waited outside.",
    "we should write a letter to the council about the bridge.",
    "the children laughed when the dog jumped into the water.",
]


def generic_sentence(rng: random.Random) -> str:
    """One generic English sentence; a number appears as words or as digits, never both."""
    n = rng.randint(2, 999)
    count = number_words(n) if rng.random() < 0.5 else str(n)
    kind = rng.randrange(4)
    subject, verb, adj = rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(ADJECTIVES)
    noun, place, time = rng.choice(NOUNS), rng.choice(PLACES), rng.choice(TIMES)
    if kind == 0:
        return f"{time}, {subject} {verb} {count} {adj} {noun} {place}."
    if kind == 1:
        return f"{subject} {verb} {count} {noun} {place} {time}."
    if kind == 2:
        return f"there were {count} {adj} {noun} {place}."
    return rng.choice(FILLERS)


def counting_line(rng: random.Random) -> str:
    """A short run of consecutive numbers, all in words or all in digits."""
    start = rng.randint(0, 990)
    run = range(start, min(start + rng.randint(3, 8), 1000))
    as_words = rng.random() < 0.5
    return ", ".join(number_words(i) if as_words else str(i) for i in run) + "."


def pretraining_corpus(rng: random.Random, lines: int) -> list[str]:
    """Generic text for the tokenizer and the base model: sentences, counting runs, a few chats."""
    out = []
    for _ in range(lines):
        r = rng.random()
        if r < 0.55:
            out.append(" ".join(generic_sentence(rng) for _ in range(rng.randint(1, 3))))
        else:
            out.append(counting_line(rng))
    return out


# ---------------------------------------------------------------- the fine-tuning task
INSTRUCTIONS = {
    "words": [
        "Write the number in words.",
        "Spell out this number.",
        "How do you say this number in English?",
    ],
    "digits": ["Write the number in digits.", "Convert these words to a number.", "What number is this?"],
}


def quickstart_rows(rng: random.Random, numbers: list[int], copies: int) -> list[dict]:
    """Instruction-format rows, both directions, with varied instruction wording."""
    rows = []
    for _ in range(copies):
        for n in numbers:
            direction = rng.choice(["words", "digits"])
            instruction = rng.choice(INSTRUCTIONS[direction])
            words = number_words(n)
            if direction == "words":
                rows.append({"instruction": instruction, "input": str(n), "output": words})
            else:
                rows.append({"instruction": instruction, "input": words, "output": str(n)})
    rng.shuffle(rows)
    return rows


def write_data(rng: random.Random) -> None:
    """train.jsonl / eval.jsonl: eval numbers are held out of training, so eval measures the mapping."""
    numbers = list(range(1000))
    rng.shuffle(numbers)
    eval_numbers, train_numbers = sorted(numbers[:100]), sorted(numbers[100:])
    data = OUT / "data"
    data.mkdir(parents=True, exist_ok=True)
    for name, rows in [
        ("train.jsonl", quickstart_rows(rng, train_numbers, copies=3)),
        ("eval.jsonl", quickstart_rows(rng, eval_numbers, copies=1)),
    ]:
        with open(data / name, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"wrote {data / name} ({len(rows)} rows)")


# ---------------------------------------------------------------- tokenizer
def train_tokenizer(corpus: list[str]):
    """A byte-level BPE (no unknown tokens for any input) with digits split one per token.

    Single digits keep numbers compositional, which is what the task needs; byte-level means any
    text other engineers or users feed it still tokenizes. Saved as a transformers fast tokenizer
    with bos/eos/pad/unk and the chat template above.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=SPECIAL_TOKENS[4:],
        add_bos_token=True,
        add_eos_token=False,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def instruction_texts(rng: random.Random, n: int) -> list[str]:
    """Template text so BPE learns the prompt words too (no number pairs: numbers vary separately)."""
    texts = []
    for _ in range(n):
        direction = rng.choice(["words", "digits"])
        texts.append(
            f"### Instruction:\n{rng.choice(INSTRUCTIONS[direction])}\n\n### Input:\n\n### Response:\n"
        )
    return texts


# ---------------------------------------------------------------- base model
def model_config(tokenizer):
    """A small Llama: 2 layers, hidden 128, grouped-query attention (4 heads, 2 key/value heads)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=352,  # ~2.75x hidden, a multiple of 32
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def pretrain(tokenizer, corpus: list[str], steps: int, seq_len: int = 64, batch_size: int = 32):
    """Full-parameter training on the generic corpus, so the quickstart fine-tunes a real base model.

    Lines are joined into one token stream (bos ... eos per line) and cut into equal windows;
    window order is shuffled with a fixed seed.
    """
    import torch
    from transformers import AutoModelForCausalLM, get_scheduler

    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(model_config(tokenizer), dtype=torch.float32)
    stream: list[int] = []
    for line in corpus:
        stream += tokenizer(line)["input_ids"] + [tokenizer.eos_token_id]
    windows = torch.tensor(stream[: len(stream) // seq_len * seq_len]).view(-1, seq_len)
    print(f"pre-training on {len(windows)} windows of {seq_len} tokens")
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(SEED))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = get_scheduler("cosine", optimizer, num_warmup_steps=20, num_training_steps=steps)
    model.train()
    for step in range(steps):
        idx = order[(torch.arange(batch_size) + step * batch_size) % len(windows)]
        batch = windows[idx]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step % 50 == 0 or step == steps - 1:
            print(f"pre-train step {step:4d} loss {loss.item():.3f}")
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-model", action="store_true", help="only data and tokenizer")
    parser.add_argument("--pretrain-steps", type=int, default=300, help="base model training steps")
    args = parser.parse_args()

    rng = random.Random(SEED)
    model_dir = OUT / "model"
    model_dir.mkdir(parents=True, exist_ok=True)

    write_data(random.Random(SEED + 1))
    corpus = pretraining_corpus(rng, 6000)
    tokenizer = train_tokenizer(corpus + instruction_texts(rng, 200))
    tokenizer.save_pretrained(model_dir)
    print(f"wrote tokenizer to {model_dir} (vocab {len(tokenizer)})")
    if args.skip_model:
        return
    import torch

    torch.set_num_threads(2)  # same thread count as CI, so the weights are reproducible there
    model = pretrain(tokenizer, corpus, steps=args.pretrain_steps)
    model.save_pretrained(model_dir)  # config.json + generation_config.json + model.safetensors
    print(f"wrote base model to {model_dir}")


if __name__ == "__main__":
    main()
