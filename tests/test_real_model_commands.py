"""Every command on the real model (SmolLM2-135M-Instruct, the `real_model` fixture: a 49,152-token vocabulary,
tied embeddings, 9/3 heads, a ChatML template with a default system message, pad == eos == <|im_end|>).

Train once, assert many: one module fixture trains, in this process (`liger_here`), a 3-step LoRA SFT on
chat rows and a 2-step reward model; `data`, `generate`, `chat`, `merge`, `score`, `inspect-wrap` and
`export` (f16 and q8_0, of the base model and of the SFT run, verified in llama.cpp, once with --ollama)
read them. Every number is checked against transformers and peft directly, on ids rendered here by the
tokenizer's own chat template.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from conftest import causal_lm
from test_train import liger_here

pytestmark = pytest.mark.timeout(1800)
CHAT = Path(__file__).resolve().parents[1] / "recipes" / "chat" / "train.jsonl"
EOS = 2  # <|im_end|>: eos, pad and the end of every turn
EVAL = [
    [{"role": "user", "content": "25"}, {"role": "assistant", "content": "twenty-five"}],
    [{"role": "system", "content": "Write numbers in words."}, {"role": "user", "content": "430"},
     {"role": "assistant", "content": "four hundred thirty"}],
]  # fmt: skip
PAIRS = [("12", "twelve", "twenty-one"), ("7", "seven", "eight"), ("905", "nine hundred five", "nine hundred fifty"),
         ("61", "sixty-one", "sixteen")]  # fmt: skip
MAX_NEW = 12


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(real_model: Path, tmp_path_factory) -> dict:
    """A 3-step LoRA SFT on 4 chat rows (2 eval rows, 2 eval samples) and a 2-step LoRA reward model on 4
    pairs whose prompts are messages, both on the real model."""
    import yaml

    root = tmp_path_factory.mktemp("real-commands")
    train = jsonl(root / "train.jsonl", [json.loads(line) for line in CHAT.read_text().splitlines()[:4]])
    evals = jsonl(root / "eval.jsonl", [{"messages": m} for m in EVAL])
    pairs = jsonl(root / "pairs.jsonl", [
        {"prompt": [{"role": "user", "content": n}], "chosen": [{"role": "assistant", "content": good}],
         "rejected": [{"role": "assistant", "content": bad}]} for n, good, bad in PAIRS])  # fmt: skip
    common = {"logging": {"every": 1, "tensorboard": False}}
    sft = {"model": {"path": str(real_model)}, "adapter": {"type": "lora", "r": 8, "alpha": 16},
           "data": {"train": str(train), "eval": str(evals), "format": "chat", "max_seq_len": 96},
           "training": {"max_steps": 3, "micro_batch_size": 2, "lr": 2.0e-3, "seed": 3, "eval_every": 3,
                        "eval_samples": 2},
           "output": {"dir": str(root / "sft"), "overwrite": True}, **common}  # fmt: skip
    reward = {"model": {"path": str(real_model)}, "adapter": {"type": "lora", "r": 4, "alpha": 8},
              "data": {"train": str(pairs), "format": "preference", "max_seq_len": 64},
              "training": {"objective": "reward", "max_steps": 2, "micro_batch_size": 2, "lr": 5.0e-3, "seed": 3},
              "output": {"dir": str(root / "rm"), "overwrite": True}, **common}  # fmt: skip
    found = {"root": root, "sft": root / "sft", "rm": root / "rm", "recipe": root / "sft.yaml"}
    for name, recipe in (("sft", sft), ("rm", reward)):
        (root / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
        proc = liger_here("train", str(root / f"{name}.yaml"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "final model verified" in proc.stdout, proc.stdout[-2000:]
    return found


# --- independent references: transformers and peft, ids rendered by the tokenizer's own template -----------
def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


@torch.no_grad()
def greedy(model, ids: list[int], max_new_tokens: int = MAX_NEW) -> list[int]:
    """transformers' own greedy generation: the new ids, up to <|im_end|> (kept) or the limit."""
    out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=EOS, pad_token_id=EOS)  # fmt: skip
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def adapter_model(runs, real_model: Path):
    """The SFT run as peft loads it: its adapter on the base."""
    return causal_lm(real_model, runs["sft"] / "final")


@pytest.fixture(scope="module")
def answers(adapter_model, tokenizer) -> list[list[int]]:
    """peft's greedy answers to questions(), ids rendered by the chat template."""
    return [greedy(adapter_model, prompt_ids(tokenizer, m)) for m in questions()]


def questions() -> list[list[dict]]:
    """The eval rows' prompts and one probe of the export's."""
    return [m[:-1] for m in EVAL] + [[{"role": "user", "content": "What is 12 + 30?"}]]


def test_data_renders_each_row_with_the_chat_template_and_learns_the_assistant_turns(
    runs, tokenizer, tmp_path
):
    """`liger data`: the ids are the tokenizer's own chat template's (its default system message added
    where a row has none), and the learned tokens are exactly each assistant turn's text, <|im_end|>, "\\n"."""
    out = tmp_path / "examples.jsonl"
    proc = liger_here("data", str(runs["recipe"]), "--show", "1", "--jsonl", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "examples: 4 rows, 4 kept, 0 truncated, 0 dropped" in proc.stdout, proc.stdout
    assert "<|im_start|>assistant\n[[twelve<|im_end|>\n]]<|im_start|>user\n340<|im_end|>" in proc.stdout
    rows = [json.loads(line) for line in CHAT.read_text().splitlines()[:4]]
    examples = [x for x in read_jsonl(out) if x["split"] == "train"]
    assert [x["row"] for x in examples] == [1, 2, 3, 4]
    for row, example in zip(rows, examples, strict=True):
        ids = list(tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=False))
        assert example["input_ids"] == ids
        learned = [t for t, label in zip(ids, example["labels"], strict=True) if label != -100]
        assert all(label in (-100, t) for t, label in zip(ids, example["labels"], strict=True))
        want = [t for m in row["messages"] if m["role"] == "assistant"
                for t in tokenizer(m["content"] + "<|im_end|>\n", add_special_tokens=False)["input_ids"]]  # fmt: skip
        assert learned == want
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.decode(examples[1]["input_ids"])


def test_generate_is_peft_greedy_on_the_chat_template_prompt(runs, answers, tokenizer, tmp_path):
    """`liger generate` on the run: each completion is transformers' greedy generation with peft's adapter
    model on the chat template's prompt ids, ending at <|im_end|> (finish "stop") or at the limit; the eval
    prompts' equal the run's own eval samples."""
    prompts = jsonl(tmp_path / "prompts.jsonl", [{"messages": m, "id": k} for k, m in enumerate(questions())])
    out = tmp_path / "out.jsonl"
    proc = liger_here("generate", str(runs["sft"]), "--prompts", str(prompts), "--out", str(out),
                      "--max-new-tokens", str(MAX_NEW), "--logprobs")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"wrote 3 completions to {out}" in proc.stdout and "format chat" in proc.stdout
    rows = read_jsonl(out)
    for row, messages, want in zip(rows, questions(), answers, strict=True):
        assert row["completion_ids"] == want, (messages, tokenizer.decode(want))
        reason = "stop" if want[-1] == EOS else "length"
        assert row["finish_reason"] == reason and len(row["logprobs"]) == len(want)
        assert row["completion"] == tokenizer.decode(
            want[:-1] if reason == "stop" else want, skip_special_tokens=True
        )
    samples = [r for r in read_jsonl(runs["sft"] / "samples.jsonl") if r["step"] == 3]  # training's own
    assert [r["completion"] for r in samples] == [r["completion"] for r in rows[:2]]
    assert rows[1]["completion"] == "four hundred thirty"  # learned in 3 steps (the untrained model explains)


def test_chat_keeps_the_conversation_and_answers_as_peft_does(runs, adapter_model, tokenizer, monkeypatch):
    """`liger chat` (its function, stdin given): two messages, the second answered on the whole
    conversation (the first reply in it), each reply transformers' greedy one with peft's adapter model."""
    from liger_cli.generate.engine import Sampling
    from liger_cli.serve.chat import chat_command

    monkeypatch.setattr("sys.stdin", io.StringIO("25\n430\n"))
    said = io.StringIO()
    assert chat_command(runs["sft"], None, Sampling(MAX_NEW, 0.0), False, None, None, out=said) == 0
    text = said.getvalue()
    assert "(format chat)" in text, text
    replies = [line[len("model> ") :] for line in text.splitlines() if line.startswith("model> ")]
    history: list[dict] = []
    for message, reply in zip(("25", "430"), replies, strict=True):
        history.append({"role": "user", "content": message})
        want = greedy(adapter_model, prompt_ids(tokenizer, history))
        assert reply == tokenizer.decode([t for t in want if t != EOS], skip_special_tokens=True).rstrip("\n")
        history.append({"role": "assistant", "content": reply})


def test_merge_writes_a_model_whose_logits_are_peft_s(runs, adapter_model, real_model, tokenizer, tmp_path):
    """`liger merge`: the merged folder, loaded by transformers, gives peft's adapter model's logits; the
    embeddings stay tied (the LoRA never touches them) and the tokenizer and chat template travel along."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "merged"
    proc = liger_here("merge", str(runs["sft"]), str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "merge verified" in proc.stdout, proc.stdout
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert merged.config.tie_word_embeddings and merged.lm_head.weight is merged.model.embed_tokens.weight
    with safe_open(str(real_model / "model.safetensors"), "pt") as base:
        torch.testing.assert_close(
            merged.model.embed_tokens.weight, base.get_tensor("model.embed_tokens.weight")
        )
    assert AutoTokenizer.from_pretrained(out).chat_template == tokenizer.chat_template
    ids = torch.tensor([prompt_ids(tokenizer, questions()[1]) + tokenizer("four hundred")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(
            merged(input_ids=ids).logits, adapter_model(input_ids=ids).logits, rtol=0, atol=2e-3
        )


def test_score_is_transformers_sequence_classifier_with_the_adapter(runs, real_model, tokenizer, tmp_path):
    """`liger score` on the reward run: each score is AutoModelForSequenceClassification's (the adapter and
    its score head loaded by peft) on the chat template's ids of prompt + answer. Its pad is <|im_end|>,
    every turn's end: the score is read at the last token that is not one, the "\\n" after the answer."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    rows = [{"prompt": [{"role": "user", "content": n}], "completion": side} for n, good, bad in PAIRS[:2]
            for side in (good, bad)]  # fmt: skip
    rows.append({"messages": [{"role": "user", "content": "30"}, {"role": "assistant", "content": "thirty"}]})
    out = tmp_path / "scored.jsonl"
    proc = liger_here("score", str(runs["rm"]), "--prompts", str(jsonl(tmp_path / "rows.jsonl", rows)), "--out",
                      str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    scored = read_jsonl(out)
    assert [{k: v for k, v in r.items() if k != "score"} for r in scored] == rows
    base = AutoModelForSequenceClassification.from_pretrained(real_model, num_labels=1, pad_token_id=EOS,
                                                              dtype=torch.float32)  # fmt: skip
    model = PeftModel.from_pretrained(base, runs["rm"] / "final").eval()
    conversations = [r["messages"] if "messages" in r else
                     [*r["prompt"], {"role": "assistant", "content": r["completion"]}] for r in rows]  # fmt: skip
    with torch.no_grad():
        want = [float(model(input_ids=torch.tensor([list(tokenizer.apply_chat_template(
            c, tokenize=True, return_dict=False))])).logits[0, 0]) for c in conversations]  # fmt: skip
    assert [r["score"] for r in scored] == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert len({round(s, 4) for s in want}) == len(want)  # five different texts, five different scores


def test_inspect_wrap_counts_the_real_model_with_its_tied_embeddings(real_model):
    """`liger inspect-wrap MODEL --lora --json`: every parameter counted once (the tied head shares the
    embeddings), 30 decoder layers as units, LoRA trainable inside them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    proc = liger_here("inspect-wrap", str(real_model), "--lora", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(real_model))
    assert data["total_params"] - data["trainable_params"] == sum(p.numel() for p in model.parameters())
    assert data["model_type"] == "llama" and data["wrap_classes"] == ["LlamaDecoderLayer"]
    layers = [u for u in data["units"] if u["class"] == "LlamaDecoderLayer"]
    assert len(layers) == 30 and all(0 < u["trainable_params"] < u["params"] for u in layers)
    assert data["tied_embeddings"] is True and data["lm_head_unit"] == data["embed_unit"]


# --- export: f16 and q8_0 of the base model and of the SFT run ---------------------------------------------
def llama_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int = MAX_NEW) -> list[list[int]]:
    from liger_cli.export.runtime import Runtime

    loaded = Runtime(path, max(len(p) for p in prompts) + max_new_tokens + 1)
    try:
        return [loaded.generate_greedy(p, max_new_tokens) for p in prompts]
    finally:
        loaded.close()


def exported(source: Path, out: Path, quant: str, *more: str) -> tuple[str, dict]:
    proc = liger_here("export", str(source), "--format", "gguf", "--out", str(out), "--quant", quant, *more)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "verified in llama.cpp:" in proc.stdout and "pre-tokenizer gpt-2" in proc.stdout, proc.stdout
    record = json.loads((out / "export.json").read_text())
    assert record["template"] == "same" and record["quant"] == quant and record["positions"] > 0
    # llama.cpp ends on <|im_end|> as liger does, and also on two tokens it marks by their text: SmolLM2's
    # <|endoftext|> and <reponame> (a fill-in-the-middle token to llama.cpp); no probe completion holds them
    assert record["stops"] == [EOS] and record["extra_stops"] == [0, 4], record
    assert "also on 0 '<|endoftext|>', 4 '<reponame>', which it marks end-of-generation" in proc.stdout
    return proc.stdout, record


def gguf_fields(path: Path) -> dict:
    import gguf

    reader = gguf.GGUFReader(path)
    names = ("general.architecture", "general.file_type", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.pre",
             "tokenizer.chat_template", "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
             "llama.attention.head_count",
             "llama.attention.head_count_kv", "llama.rope.freq_base")  # fmt: skip
    return {n: reader.fields[n].contents() for n in names if n in reader.fields}


def test_export_of_the_base_model_f16_is_transformers_greedy_in_llama_cpp(real_model, tokenizer, tmp_path):
    """`liger export MODEL --quant f16`: verified (the report's stops: <|im_end|>, and the two llama.cpp adds);
    the file says what the model is, and llama.cpp's own greedy loop on it is transformers' greedy loop."""
    out = tmp_path / "f16"
    _, record = exported(real_model, out, "f16")
    assert 0 < record["largest_logprob_diff"] < 0.2 and record["prompts"] == 2, record
    path = out / "SmolLM2-135M-Instruct-f16.gguf"
    fields = gguf_fields(path)
    assert fields["general.architecture"] == "llama" and fields["tokenizer.ggml.eos_token_id"] == EOS
    assert fields["tokenizer.chat_template"] == tokenizer.chat_template
    assert (fields["llama.attention.head_count"], fields["llama.attention.head_count_kv"]) == (9, 3)
    assert fields["llama.rope.freq_base"] == pytest.approx(1e5)
    assert (fields["tokenizer.ggml.unknown_token_id"], fields["tokenizer.ggml.padding_token_id"]) == (0, EOS)
    prompts = [prompt_ids(tokenizer, m) for m in questions()]
    model = causal_lm(real_model)
    assert llama_greedy(path, prompts) == [greedy(model, p) for p in prompts]


def test_export_of_the_base_model_q8_0_meets_the_agreement_floor(real_model, tmp_path):
    """q8_0 by llama.cpp's quantizer: every 2-D weight q8_0, greedy agreement over a floor. Measured 90.3%
    (28 of 31 positions; the 3 others near ties of the model's own, top-2 gaps 0.012-0.09): q8_0's default
    floor of 0.9 is one flipped near tie away on another CPU's SIMD code, so the test sets 0.8."""
    import gguf

    out = tmp_path / "q8"
    _, record = exported(real_model, out, "q8_0", "--min-agreement", "0.8")
    path = out / "SmolLM2-135M-Instruct-q8_0.gguf"
    assert int(gguf_fields(path)["general.file_type"]) == gguf.LlamaFileType.MOSTLY_Q8_0
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert {types[n] for n in types if not n.endswith("norm.weight")} == {"Q8_0"}, types
    assert record["agreement"] >= 0.8 and 0 < record["mean_kl"] < 0.05, record


def test_export_of_the_lora_run_f16_is_peft_greedy_in_llama_cpp(runs, answers, tokenizer, tmp_path):
    """`liger export RUN --quant f16`: the adapter merged and verified on the run's eval prompts and the
    probes; llama.cpp's greedy loop on the file is peft's adapter model's, the learned answer included."""
    out = tmp_path / "f16"
    stdout, record = exported(runs["sft"], out, "f16")
    assert "merge verified" in stdout and record["prompts"] == 4, record
    assert 0 < record["largest_logprob_diff"] < 0.2 and record["agreement"] == 1.0, record
    prompts = [prompt_ids(tokenizer, m) for m in questions()]
    found = llama_greedy(out / "sft-f16.gguf", prompts)
    assert found == answers
    assert tokenizer.decode(found[1], skip_special_tokens=True) == "four hundred thirty"


def test_export_of_the_lora_run_q8_0_with_a_modelfile(runs, tmp_path):
    """q8_0 of the run with --ollama: the Modelfile names the file and stops at <|im_end|>, and leaves the
    chat template to the one stored in the GGUF."""
    out = tmp_path / "q8"
    _, record = exported(runs["sft"], out, "q8_0", "--ollama")
    assert record["agreement"] >= 0.8 and 0 < record["mean_kl"] < 0.05, record
    assert sorted(p.name for p in out.iterdir()) == [
        ".liger-export",
        "Modelfile",
        "export.json",
        "sft-q8_0.gguf",
    ]
    modelfile = (out / "Modelfile").read_text()
    assert modelfile.startswith('FROM ./sft-q8_0.gguf\nPARAMETER stop "<|im_end|>"\n'), modelfile
    assert (
        "TEMPLATE" not in modelfile.replace("No TEMPLATE", "")
        and "chat template stored in the GGUF" in modelfile
    )


def test_the_plain_types_bound_grows_with_how_unlikely_the_token_is():
    """What the LoRA run's f16 export needs (0.056 at a token of log p -32, where f16 weights alone move it
    0.035; docs/export.md): f16's 0.05 holds down to log p -10 and grows as |log p| / 10 below it."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from liger_cli.export.verify import ExportMismatch, Report, check_next_tokens

    logits = torch.tensor([0.0, -3.0, -12.0, -32.0]).repeat(1, 2, 1)
    want = torch.log_softmax(logits[0].double(), -1)

    class Model(SimpleNamespace):
        def __call__(self, input_ids):
            return SimpleNamespace(logits=logits)

    class Llama:
        def __init__(self, token: int, by: float):
            self.got = want.clone()
            self.got[:, token] += by

        def log_probs(self, ids):
            return self.got

        def piece(self, token):
            return str(token)

    model = Model(config=LlamaConfig())
    for token, by, passes in (
        (1, 0.049, True),
        (1, 0.06, False),
        (3, 0.06, True),
        (3, 0.15, True),
        (3, 0.17, False),
    ):
        report = Report()
        try:
            check_next_tokens(Llama(token, by), model, [[5]], [[0]], "f16", None, report)
        except ExportMismatch as err:
            assert not passes and f"at a token of log-prob {want[0, token]:.3g}" in str(err), (token, by, err)
        else:
            assert passes and report.largest_logprob_diff == pytest.approx(by), (token, by)
