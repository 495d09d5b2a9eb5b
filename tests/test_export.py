"""`liger export --format gguf`: the file llama.cpp loads computes what liger computes, or nothing is left.

Round trips through llama.cpp itself (llama-cpp-python, installed by scripts/setup.sh): the quickstart's
and the DPO recipe's outputs (short runs of the shipped recipes), and a tiny model of every family liger
exports, each with another of the pre-tokenizers llama.cpp is told about. Each is checked by the
export's own verification (tokens, template, next-token log-probs, stops) and, independently here, by
llama.cpp's own greedy generation against liger's engine on the run as it was trained (adapter on its
base, not the merge). Broken exports (a special token dropped, the template replaced, the wrong
pre-tokenizer, q/k not permuted) are caught and leave nothing; refusals are one line, exit 2. llama.cpp
runs in a child process: its crash (a signal), exit or hang there is one line too, and leaves nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import warm_python
from conftest import QUICKSTART_MODEL, save_tiny_model

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"


def liger(*args, timeout: int = 600, **more: str) -> subprocess.CompletedProcess:
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **more}
    return warm_python.run(["-m", "liger_cli", *map(str, args)], timeout=timeout, env={**_env(), **env})


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Short runs of the shipped quickstart (SFT, LoRA), of it in full fine-tuning, and of the DPO recipe."""
    root = tmp_path_factory.mktemp("export-runs")
    found = {}
    for name, recipe, steps, more in (("quickstart", "quickstart", 40, []), ("dpo", "dpo", 16, []),
                                      ("full", "quickstart", 4, ["adapter.type=none", "training.lr=1e-4"])):  # fmt: skip
        out = root / name
        sets = [f"training.max_steps={steps}", f"output.dir={out}", "training.eval_every=1000", *more]
        proc = liger("train", RECIPES / f"{recipe}.yaml", *[a for item in sets for a in ("--set", item)])
        assert proc.returncode == 0, proc.stderr[-3000:]
        found[name] = out
    return found


def export(source: Path, out: Path, **kwargs):
    from liger_cli.export.command import export_gguf

    return export_gguf(source, out, say=lambda line: None, **kwargs)


def llama_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from liger_cli.export.runtime import Runtime

    loaded = Runtime(path, max(len(p) for p in prompts) + max_new_tokens + 1)
    try:
        return [loaded.generate_greedy(p, max_new_tokens) for p in prompts]
    finally:
        loaded.close()


def engine_greedy(source: Path, max_new_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """The run as trained (its adapter on its base, liger's loader): the eval prompts' ids and greedy ids."""
    from liger_cli.export.command import eval_rows
    from liger_cli.generate.engine import Sampling, generate
    from liger_cli.generate.load import chat_or_text, find_target, load_model, load_tokenizer_for
    from liger_cli.generate.prompts import Renderer

    target = find_target(source)
    tokenizer = load_tokenizer_for(target)
    model = load_model(target)
    renderer = Renderer(tokenizer, chat_or_text(target, tokenizer))
    prompts = [renderer.ids(row) for row in eval_rows(target)]
    done = generate(model, prompts, Sampling(max_new_tokens=max_new_tokens, temperature=0),
                    stop_ids=renderer.stop_ids(model.generation_config), pad_id=tokenizer.pad_token_id)  # fmt: skip
    return prompts, [c.ids for c in done]


def test_the_quickstart_run_exports_verified_with_a_modelfile(runs, tmp_path: Path) -> None:
    """`liger export RUN --quant f16 --ollama`: exit 0, the report, the files; the GGUF's own greedy
    generation (llama.cpp's loop) equals liger's engine on the run's adapter, the metadata is the run's."""
    import gguf

    out = tmp_path / "gguf"
    proc = liger("export", runs["quickstart"], "--out", out, "--quant", "f16", "--ollama")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "merge verified" in proc.stdout and "verified in llama.cpp:" in proc.stdout
    assert "pre-tokenizer smollm" in proc.stdout, proc.stdout
    assert sorted(p.name for p in out.iterdir()) == [
        ".liger-export",
        "Modelfile",
        "export.json",
        "quickstart-f16.gguf",
    ]
    assert not list(tmp_path.glob(".gguf.tmp-*"))
    record = json.loads((out / "export.json").read_text())
    assert record["template"] == "same" and record["texts"] >= 10 and record["prompts"] == 6
    assert record["positions"] > 10 and 0 < record["largest_logprob_diff"] <= 0.05 and record["stops"] == [2]
    modelfile = (out / "Modelfile").read_text()
    assert modelfile.startswith('FROM ./quickstart-f16.gguf\nPARAMETER stop "</s>"\n')
    assert 'TEMPLATE """### Instruction:\n{{ .Prompt }}\n\n### Response:\n"""' in modelfile
    assert "# Exact for one-line prompts" in modelfile

    reader = gguf.GGUFReader(out / "quickstart-f16.gguf")
    fields = {name: reader.fields[name].contents() for name in
              ("general.architecture", "tokenizer.ggml.pre", "tokenizer.ggml.eos_token_id", "tokenizer.chat_template",
               "tokenizer.ggml.add_bos_token")}  # fmt: skip
    template = (runs["quickstart"] / "final" / "chat_template.jinja").read_text()
    assert fields == {"general.architecture": "llama", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.eos_token_id": 2,
                      "tokenizer.chat_template": template, "tokenizer.ggml.add_bos_token": True}  # fmt: skip
    prompts, want = engine_greedy(runs["quickstart"], 24)
    assert len(prompts) == 4 and all(w[-1] == 2 for w in want)  # every answer ends at eos
    assert llama_greedy(out / "quickstart-f16.gguf", prompts, 24) == want


def test_the_dpo_run_exports_quantized_by_llama_cpp(runs, tmp_path: Path) -> None:
    """q8_0 from llama.cpp's own quantizer: the file and its 2-D weights are q8_0, the norms f32; greedy
    agreement and KL are measured and reported (a quantized file's greedy tokens may differ where the
    model's are close: the floor, not equality, is the check)."""
    import gguf

    done = export(runs["dpo"], tmp_path / "q8", quant="q8_0")
    assert done.path.name == "dpo-q8_0.gguf" and done.path.parent == tmp_path / "q8"
    assert (
        int(gguf.GGUFReader(done.path).fields["general.file_type"].contents())
        == gguf.LlamaFileType.MOSTLY_Q8_0
    )
    assert done.report.agreement >= 0.9 and 0 < done.report.mean_kl < 0.05, done.report
    assert any("greedy agreement" in line for line in done.lines)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(done.path).tensors}
    assert {types[n] for n in types if n.endswith("norm.weight")} == {"F32"}
    assert {types[n] for n in types if not n.endswith("norm.weight")} == {"Q8_0"}, types


def test_a_full_fine_tuning_run_exports_its_final_model(runs, tmp_path: Path) -> None:
    """No adapter to merge: final/ is written as it is, here in bf16 (its rounding within the bound)."""
    done = export(runs["full"], tmp_path / "bf16", quant="bf16")
    assert done.path.name == "full-bf16.gguf"
    assert 0 < done.report.largest_logprob_diff <= 0.25 and done.report.positions > 10, done.report
    assert not any("merge verified" in line for line in done.lines)


PROBE_CORPUS = [
    "Hello world! It's 2026; we'll see what they've done.", "numbers 1234567, 3.14159 and -42, 123 456 789",
    "DON'T shout; I'M here, you'LL see", "  two leading spaces,\ttabs\tand\n\nblank lines  \n",
    "Ünïcödé: naïve café, 日本語のテキスト, emoji 🙂👍", "What is 12 + 30? The answer is 42.",
    "Name a colour. Blue. Another one, please?",
]  # fmt: skip


TURN_END_TEMPLATE = (  # a chat template that ends each turn with <|turn_end|>, a token llama.cpp knows no name of
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|turn_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def trained_tokenizer(pre: str, folder: Path, chat_template: str | None = None):
    """A byte-level BPE trained here with llama.cpp pre-tokenizer `pre`'s splitting, so that its merges
    depend on it (Llama 3's regex learns "123", SmolLM's digits never merge), with the quickstart's
    special tokens, BOS prefix and chat template; saved in `folder`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from liger_cli.export.gguf_tokenizer import LLAMA3_REGEX, QWEN2_REGEX

    special = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|turn_end|>"]
    if pre in ("sentencepiece", "sentencepiece-unprefixed"):
        return sentencepiece_tokenizer(folder, special, chat_template, prefix=pre == "sentencepiece")
    tokenizer = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.pre_tokenizer = {
        "gpt-2": byte_level,
        "smollm": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]),
        "llama-bpe": pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_REGEX), "isolated"),
                                              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
        "qwen2": pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_REGEX), "isolated"),
                                          pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
    }[pre]  # fmt: skip
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(PROBE_CORPUS * 20, trainer)
    return save_fast(tokenizer, folder, special, chat_template)


def save_fast(tokenizer, folder: Path, special: list[str], chat_template: str | None):
    """`tokenizer` with BOS added, the quickstart's special tokens and chat template, saved as a fast
    tokenizer in `folder`."""
    from tokenizers import processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", extra_special_tokens=special[4:])  # fmt: skip
    fast.chat_template = chat_template or AutoTokenizer.from_pretrained(QUICKSTART_MODEL).chat_template
    fast.save_pretrained(folder)
    return fast


def sentencepiece_tokenizer(folder: Path, special: list[str], chat_template: str | None, prefix: bool = True):
    """A SentencePiece-style BPE as transformers converts Llama 2's and Mistral's: pieces learned with "▁"
    for space (from the probe corpus with each word reversed: the probe texts split into pieces, so the
    order of merges matters), <0x00>..<0xFF> byte-fallback tokens, merges listed for every way a token splits into two
    (ordered by the token's id, as transformers' SentencePiece converter orders them), a "▁" prepended to
    each text (the legacy normalizer; Gemma's prepends none), BOS added."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    words = Tokenizer(models.BPE())
    words.normalizer = normalizers.Replace(" ", "\u2581")
    words.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")  # pieces never cross a space
    corpus = [
        " ".join(word[::-1] for word in line.split()) for line in PROBE_CORPUS
    ]  # the probes split in pieces
    words.train_from_iterator(corpus * 20, trainers.BpeTrainer(vocab_size=500, show_progress=False))
    learned = sorted(words.get_vocab().items(), key=lambda item: item[1])
    vocab = {
        t: i
        for i, t in enumerate([*special, *(f"<0x{b:02X}>" for b in range(256)), *(t for t, _ in learned)])
    }
    merges = [(t[:k], t[k:]) for t in vocab for k in range(1, len(t)) if t[:k] in vocab and t[k:] in vocab
              and not t.startswith("<")]  # fmt: skip
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    )
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")][0 if prefix else 1 :]
    )
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])  # fmt: skip
    tokenizer.add_special_tokens(special)
    return save_fast(tokenizer, folder, special, chat_template)


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
GEMMA3 = {  # Gemma 3's attention: a window (shorter than the probes) on all but the last layer, two RoPEs
    "num_hidden_layers": 3, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8, "tie_word_embeddings": True,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
}  # fmt: skip
CASES = {  # name -> (model_type, config overrides, the pre-tokenizer its tokenizer is trained with, llama.cpp's arch)
    "llama": ("llama", {}, "llama-bpe", "llama"),
    "llama-3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}, "llama-bpe", "llama"),  # rope_freqs tensor
    "mistral": ("mistral", {"sliding_window": None}, "gpt-2", "llama"),
    "llama-sentencepiece": ("llama", {}, "sentencepiece", "llama"),  # Llama 2's and Mistral's tokenizer kind
    "gemma3": ("gemma3_text", GEMMA3, "sentencepiece-unprefixed", "gemma3"),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}, "qwen2", "qwen2"),  # attention biases, tied output
    "qwen3": ("qwen3", {"head_dim": 24}, "smollm", "qwen3"),  # q/k norms, head_dim != hidden / heads
}


def tiny_family_model(path: Path, case: str) -> Path:
    model_type, overrides, pre, _ = CASES[case]
    # Larger weights than the tests' usual tiny models: peaked next-token distributions, so that a
    # wrong rotation or mapping changes the greedy tokens rather than hiding in a near-uniform tie.
    save_tiny_model(path, model_type, seed=1, hidden_size=64, intermediate_size=128, initializer_range=0.25,
                    vocab_size=len(trained_tokenizer(pre, path / "tokenizer")), **overrides)  # fmt: skip
    trained_tokenizer(pre, path)  # replaces the quickstart tokenizer saved beside the model
    return path


@pytest.mark.parametrize("case", CASES)
def test_a_tiny_model_of_each_family_round_trips(case: str, tmp_path: Path) -> None:
    import gguf

    from liger_cli.export.families import FAMILIES

    assert {c[0] for c in CASES.values()} == set(FAMILIES)  # every family liger exports is walked here
    model_type, overrides, pre, arch = CASES[case]
    done = export(tiny_family_model(tmp_path / case, case), tmp_path / "out", quant="f32")
    report = done.report
    gelu = model_type == "gemma3_text"  # llama.cpp's GELU rounds through f16 (verify.GELU_F32_BOUND)
    assert report.largest_logprob_diff < (5e-3 if gelu else 1e-4), report
    assert report.positions >= 20 and report.near_ties == 0, report
    reader = gguf.GGUFReader(done.path)
    assert reader.fields["general.architecture"].contents() == arch
    spm = pre.startswith("sentencepiece")
    assert reader.fields["tokenizer.ggml.pre"].contents() == ("default" if spm else pre)
    assert reader.fields["tokenizer.ggml.model"].contents() == ("llama" if spm else "gpt2")
    names = {t.name for t in reader.tensors}
    assert ("output.weight" in names) != bool(overrides.get("tie_word_embeddings"))
    assert ("rope_freqs.weight" in names) == (case == "llama-3-rope")
    if (
        model_type == "gemma3_text"
    ):  # the window on the first two layers, the local RoPE base, the linear scaling
        fields = {k: reader.fields[f"gemma3.{k}"].contents() for k in ("attention.sliding_window",
                  "attention.sliding_window_pattern", "rope.freq_base_swa", "rope.scaling.factor")}  # fmt: skip
        assert fields == {"attention.sliding_window": 8, "attention.sliding_window_pattern": [True, True, False],
                          "rope.freq_base_swa": 10000.0, "rope.scaling.factor": 8.0}  # fmt: skip


def drop_special_token(monkeypatch) -> None:
    from liger_cli.export import gguf_tokenizer

    real = gguf_tokenizer.token_table

    def dropped(tokenizer, vocab_size, **kwargs):
        texts, types = real(tokenizer, vocab_size, **kwargs)
        types[tokenizer.convert_tokens_to_ids("<|user|>")] = 1  # NORMAL: no longer parsed whole
        return texts, types

    monkeypatch.setattr(gguf_tokenizer, "token_table", dropped)


def replace_template(monkeypatch) -> None:
    from liger_cli.export import gguf_tokenizer

    real = gguf_tokenizer.write_tokenizer

    def replaced(writer, folder, tokenizer, vocab_size, turn_end):
        kept, tokenizer.chat_template = (
            tokenizer.chat_template,
            "{% for m in messages %}{{ m['content'] }}{% endfor %}",
        )
        try:
            return real(writer, folder, tokenizer, vocab_size, turn_end)
        finally:
            tokenizer.chat_template = kept

    monkeypatch.setattr(gguf_tokenizer, "write_tokenizer", replaced)


def wrong_pre_tokenizer(monkeypatch) -> None:
    from liger_cli.export import gguf_tokenizer

    monkeypatch.setattr(
        gguf_tokenizer, "pre_tokenizer_name", lambda data: "smollm"
    )  # llama-bpe's digits differ


def no_permutation(monkeypatch) -> None:
    from liger_cli.export import families

    monkeypatch.setitem(families.FAMILIES, "llama", families.Family("LLAMA", permute_qk=False))


def no_merge_scores(monkeypatch) -> None:
    from liger_cli.export import gguf_tokenizer

    monkeypatch.setattr(gguf_tokenizer, "merge_scores", lambda data: {})  # every pair ties: leftmost first


def no_space_prefix(monkeypatch) -> None:
    from liger_cli.export import gguf_tokenizer

    monkeypatch.setattr(gguf_tokenizer, "space_prefix", lambda data: False)


def no_window(monkeypatch) -> None:
    from liger_cli.export import families

    real = families.gemma3_settings
    monkeypatch.setattr(families, "gemma3_settings", lambda config: {**real(config), "sliding": [False] * 3})


def norms_not_shifted(monkeypatch) -> None:
    from liger_cli.export import families

    monkeypatch.setitem(families.FAMILIES, "gemma3_text", families.Family("GEMMA3"))


def no_rope_frequencies(monkeypatch) -> None:
    from liger_cli.export import gguf_file

    monkeypatch.setattr(gguf_file, "rope_frequency_factors", lambda config: None)


BROKEN = {  # what is broken -> (how, the model, the error's words)
    "special token dropped": (drop_special_token, "llama", r"at token \d+ the tokenizer has 5 '<\|user\|>', llama.cpp"),
    "template replaced": (replace_template, "llama", "the file's chat template differs from the run's at character 1"),
    "wrong pre-tokenizer": (wrong_pre_tokenizer, "llama", r"at token 6 the tokenizer has \d+ '202', llama.cpp \d+ '2'$"),
    "q/k not permuted": (no_permutation, "llama", "greedy tokens differ on prompt 0 at completion token"),
    "Llama 3 RoPE factors left out": (no_rope_frequencies, "llama-3-rope", "greedy tokens differ on prompt 0"),
    "SentencePiece scores left out": (no_merge_scores, "llama-sentencepiece", r"at token \d+ the tokenizer has \d+ '▁', llama.cpp \d+ '▁a'"),
    "SentencePiece space prefix left out": (no_space_prefix, "llama-sentencepiece", "at token 0 the tokenizer has"),
    "Gemma 3's sliding window left out": (no_window, "gemma3", "greedy tokens differ on prompt 1"),
    "Gemma 3's norms not shifted by one": (norms_not_shifted, "gemma3", "greedy tokens differ on prompt 0"),
}  # fmt: skip


@pytest.mark.parametrize("broken", BROKEN)
def test_a_broken_export_is_caught_and_leaves_nothing(broken: str, tmp_path: Path, monkeypatch) -> None:
    from liger_cli.export.verify import ExportMismatch

    how, case, words = BROKEN[broken]
    model = tiny_family_model(tmp_path / case, case)
    how(monkeypatch)
    with pytest.raises(ExportMismatch, match=words):
        export(model, tmp_path / "out", quant="f32")
    assert sorted(p.name for p in tmp_path.iterdir()) == [case]  # no OUT, no temporary folder


def test_a_chat_models_end_of_turn_is_where_llama_cpp_stops(tmp_path: Path, monkeypatch) -> None:
    """A chat template ending turns with <|turn_end|> (not eos, and no name llama.cpp infers an end from):
    liger's engine stops there, so the file carries it as the eot token and llama.cpp stops there too.
    Left out, the stops check names it; and a generation config with a stop id GGUF cannot carry fails."""
    import gguf

    from liger_cli.export import gguf_tokenizer
    from liger_cli.export.verify import ExportMismatch

    model = tiny_family_model(tmp_path / "chat", "qwen2")
    tokenizer = trained_tokenizer("qwen2", model, chat_template=TURN_END_TEMPLATE)
    turn_end = tokenizer.convert_tokens_to_ids("<|turn_end|>")
    done = export(model, tmp_path / "out", quant="f32")
    assert done.report.stops == (2, turn_end) and done.report.template == "same"
    assert gguf.GGUFReader(done.path).fields["tokenizer.ggml.eot_token_id"].contents() == turn_end

    real = gguf_tokenizer.write_tokenizer
    monkeypatch.setattr(gguf_tokenizer, "write_tokenizer", lambda w, f, t, v, turn: real(w, f, t, v, None))
    with pytest.raises(
        ExportMismatch, match=rf"liger's engine stops at {turn_end} '<\|turn_end\|>'; llama.cpp does not"
    ):
        export(model, tmp_path / "out2", quant="f32")
    monkeypatch.undo()
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [2, 5]}))
    with pytest.raises(ExportMismatch, match=r"liger's engine stops at 5 '<\|user\|>'; llama.cpp does not"):
        export(model, tmp_path / "out3", quant="f32")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat", "out"]


def save_vlm(path: Path, config, tokenizer) -> None:
    """A tiny VLM of `config` with larger weights (peaked distributions), saved with its tokenizer."""
    import torch
    from transformers import AutoModelForImageTextToText

    for part in (config, config.text_config, config.vision_config):
        part.initializer_range = 0.2
    torch.manual_seed(1)
    AutoModelForImageTextToText.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def tiny_qwen_vl(path: Path, family: str) -> Path:
    """A tiny Qwen2-VL (vlm_models.py's), Qwen2.5-VL (two blocks: the first in 112-pixel windows, the
    second full) or Qwen3-VL (Qwen3-VL's rotary layout: 128-wide heads, interleaved sections 24/20/20, base
    5e6; a 3-block tower of 16-pixel patches whose 4 x 4 position grid is interpolated, deepstack mergers
    on its first two blocks) with larger weights (peaked distributions), Qwen-VL's own RMSNorm epsilon
    (1e-6) and the image processor saved beside it."""
    from conftest import tiny_llama_settings
    from transformers import AutoConfig, Qwen2VLImageProcessorPil
    from vlm_models import QWEN_TOKENS, _tokenizer, qwen2_vl_config

    tokenizer = _tokenizer(QWEN_TOKENS)
    ids = dict(zip(("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"),
                   tokenizer.convert_tokens_to_ids(QWEN_TOKENS), strict=True))  # fmt: skip
    settings, processor = {**tiny_llama_settings(tokenizer), "rms_norm_eps": 1e-6}, {}
    if family == "qwen2_vl":
        config = qwen2_vl_config(tokenizer)
        config.text_config.rms_norm_eps = 1e-6
    elif family == "qwen2_5_vl":
        text = AutoConfig.for_model("qwen2_5_vl_text", **settings,
                                    rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1]})  # fmt: skip
        vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "out_hidden_size": 32,
                  "window_size": 112, "fullatt_block_indexes": [1], "patch_size": 14, "spatial_merge_size": 2,
                  "temporal_patch_size": 2, "in_channels": 3, "hidden_act": "silu"}  # fmt: skip
        config = AutoConfig.for_model("qwen2_5_vl", text_config=text.to_dict(), vision_config=vision,
                                      tie_word_embeddings=False, **ids)  # fmt: skip
    else:
        settings["num_hidden_layers"] = 3  # llama.cpp adds deepstack features to layers before the last
        text = AutoConfig.for_model("qwen3_vl_text", **settings, head_dim=128, rope_parameters={
            "rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20], "mrope_interleaved": True})  # fmt: skip
        vision = {"depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "out_hidden_size": 32,
                  "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
                  "num_position_embeddings": 16, "deepstack_visual_indexes": [0, 1]}  # fmt: skip
        config = AutoConfig.for_model("qwen3_vl", text_config=text.to_dict(), vision_config=vision,
                                      tie_word_embeddings=False, **ids)  # fmt: skip
        processor = {"patch_size": 16, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}  # Qwen3-VL's
    save_vlm(path, config, tokenizer)
    Qwen2VLImageProcessorPil(**processor).save_pretrained(path)
    return path


def tiny_gemma3_vlm(path: Path) -> Path:
    """A tiny Gemma 3: the GEMMA3 language model above (its window, two RoPEs, GELU), a 2-block SigLIP
    tower on 32-pixel pictures of 4-pixel patches pooled to 4 image tokens, an unprefixed SentencePiece
    tokenizer with Gemma's image tokens, and the image processor saved beside it."""
    import torch
    from transformers import AutoModelForImageTextToText, Gemma3Config, Gemma3ImageProcessor

    special = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|turn_end|>",
               "<start_of_image>", "<end_of_image>", "<image_soft_token>"]  # fmt: skip
    tokenizer = sentencepiece_tokenizer(path, special, None, prefix=False)
    boi, eoi, image = tokenizer.convert_tokens_to_ids(special[-3:])
    text = {
        "model_type": "gemma3_text",
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "initializer_range": 0.25,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 3,
        **GEMMA3,
    }
    vision = {
        "model_type": "siglip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": 32,
        "patch_size": 4,
        "vision_use_head": False,
    }
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=boi,
                          eoi_token_index=eoi, image_token_index=image, initializer_range=0.25)  # fmt: skip
    torch.manual_seed(1)
    model = AutoModelForImageTextToText.from_config(config)
    with torch.no_grad():  # transformers starts the projection at zero: every picture would embed as zeros
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.25)
    model.save_pretrained(path)
    Gemma3ImageProcessor(size={"height": 32, "width": 32}).save_pretrained(path)
    return path


def tiny_mistral3(path: Path) -> Path:
    """A tiny Mistral 3: a Mistral language model (the projector norm's epsilon 1e-5, as Mistral Small
    3.1's), a 2-block Pixtral tower of 8-pixel patches (SiLU, 2D RoPE) merged 2x2, the quickstart tokenizer
    with Pixtral's image tokens, and the image processor saved beside it."""
    from conftest import tiny_llama_settings
    from transformers import AutoConfig, PixtralImageProcessorPil
    from vlm_models import _tokenizer

    tokenizer = _tokenizer(["[IMG]", "[IMG_BREAK]", "[IMG_END]"])
    text = AutoConfig.for_model(
        "mistral", **tiny_llama_settings(tokenizer), rms_norm_eps=1e-5, sliding_window=None
    )
    vision = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "head_dim": 8, "image_size": 128, "patch_size": 8, "hidden_act": "silu"}  # fmt: skip
    config = AutoConfig.for_model("mistral3", text_config=text.to_dict(), vision_config=vision, spatial_merge_size=2,
                                  image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), tie_word_embeddings=False)  # fmt: skip
    save_vlm(path, config, tokenizer)
    PixtralImageProcessorPil(size={"longest_edge": 128}, patch_size=8).save_pretrained(path)
    return path


def tiny_idefics3(path: Path, family: str) -> Path:
    """A tiny Idefics 3 or SmolVLM: a Llama language model, a 2-block SigLIP tower on 32-pixel tiles of
    8-pixel patches, pixel-shuffled 2x2 into 4 tokens a tile, pictures resized to a longest edge of 64 (two
    tiles a row), the quickstart tokenizer with the image tokens and a "\n\n" token (llama.cpp's mtmd puts
    it before the global view), and the image processor saved beside it."""
    from conftest import tiny_llama_settings
    from transformers import (
        AutoConfig,
        Idefics3ImageProcessorPil,
        SmolVLMImageProcessorPil,
    )
    from vlm_models import _tokenizer

    marks = ["<fake_token_around_image>", "<image>", "<global-img>", "<row_1_col_1>", "<row_1_col_2>"]
    tokenizer = _tokenizer(marks)
    tokenizer.add_tokens(["\n\n"])
    text = AutoConfig.for_model("llama", **tiny_llama_settings(tokenizer))
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "image_size": 32, "patch_size": 8}  # fmt: skip
    config = AutoConfig.for_model(family, text_config=text.to_dict(), vision_config=vision, scale_factor=2,
                                  image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)  # fmt: skip
    save_vlm(path, config, tokenizer)

    processor = Idefics3ImageProcessorPil if family == "idefics3" else SmolVLMImageProcessorPil
    processor(size={"longest_edge": 64}, max_image_size={"longest_edge": 32}).save_pretrained(path)
    return path


def swap_vision_q_and_k(monkeypatch) -> None:
    from liger_cli.export import gguf_projector

    real = gguf_projector.vision_tensors

    def swapped(name, tensor):
        for found, piece in real(name, tensor):
            yield (
                found.replace(".attn.q.", ".attn.x.")
                .replace(".attn.k.", ".attn.q.")
                .replace(".attn.x.", ".attn.k."),
                piece,
            )

    monkeypatch.setattr(gguf_projector, "vision_tensors", swapped)


def window_every_block_but_the_third(monkeypatch) -> None:
    from liger_cli.export import gguf_projector

    monkeypatch.setattr(gguf_projector, "window_pattern", lambda full: 3)  # the second block windowed too


def deepstack_under_the_wrong_blocks(monkeypatch) -> None:
    from liger_cli.export import gguf_projector

    real = gguf_projector.qwen3vl_tensors
    monkeypatch.setattr(
        gguf_projector, "qwen3vl_tensors", lambda name, tensor, blocks: real(name, tensor, blocks[::-1])
    )


def vision_q_and_k_not_permuted(monkeypatch) -> None:
    from liger_cli.export import gguf_projector

    monkeypatch.setattr(gguf_projector, "permute_qk", lambda tensor, heads: tensor)


def tiles_in_the_wrong_order(monkeypatch) -> None:
    from liger_cli.export import gguf_projector

    real = gguf_projector.tower_tensors

    def shuffled(folder, config, kind):  # each tile's patches pixel-shuffled in another order
        for name, tensor in real(folder, config, kind):
            yield (
                name,
                tensor.reshape(tensor.shape[0], -1, 4).flip(-1).reshape(tensor.shape)
                if "connector" in name
                else tensor,
            )

    monkeypatch.setattr(gguf_projector, "tower_tensors", shuffled)


def soft_embedding_norm_not_shifted(monkeypatch) -> None:
    from liger_cli.export import gguf_projector

    real = gguf_projector.gemma3_tensors

    def unshifted(name, tensor):
        for found, piece in real(name, tensor):
            yield found, piece - 1 if found.endswith("mm_soft_emb_norm.weight") else piece

    monkeypatch.setattr(gguf_projector, "gemma3_tensors", unshifted)


QWEN_TENSORS = {"v.patch_embd.weight", "v.patch_embd.weight.1", "mm.0.weight", "mm.2.weight", "v.post_ln.weight",
                "v.blk.1.attn_q.weight"}  # fmt: skip
QWEN3_TENSORS = {"v.patch_embd.weight", "v.patch_embd.weight.1", "v.patch_embd.bias", "v.position_embd.weight",
                 "v.blk.2.attn_qkv.weight", "v.deepstack.0.norm.weight", "v.deepstack.1.fc2.weight", "mm.0.weight",
                 "mm.2.weight", "v.post_ln.weight"}  # fmt: skip
PIXTRAL_TENSORS = {"v.patch_embd.weight", "v.pre_ln.weight", "v.blk.1.attn_q.weight", "v.blk.1.ffn_gate.weight",
                   "mm.input_norm.weight", "mm.patch_merger.weight", "mm.1.weight", "mm.2.weight",
                   "v.token_embd.img_break"}  # fmt: skip
IDEFICS3_TENSORS = {"v.patch_embd.weight", "v.position_embd.weight", "v.blk.1.attn_q.weight", "v.post_ln.weight",
                    "mm.model.fc.weight"}  # fmt: skip
GEMMA3_TENSORS = {"v.patch_embd.weight", "v.position_embd.weight", "v.blk.1.attn_q.weight", "v.post_ln.weight",
                  "mm.input_projection.weight", "mm.soft_emb_norm.weight"}  # fmt: skip
VISION = {  # family -> (llama.cpp's projector, its language model's architecture, projector tensors, how to break it)
    "qwen2_vl": ("qwen2vl_merger", "qwen2vl", QWEN_TENSORS, swap_vision_q_and_k),
    "qwen2_5_vl": ("qwen2.5vl_merger", "qwen2vl", QWEN_TENSORS, window_every_block_but_the_third),
    "qwen3_vl": ("qwen3vl_merger", "qwen3vl", QWEN3_TENSORS, deepstack_under_the_wrong_blocks),
    "gemma3": ("gemma3", "gemma3", GEMMA3_TENSORS, soft_embedding_norm_not_shifted),
    "mistral3": ("pixtral", "llama", PIXTRAL_TENSORS, vision_q_and_k_not_permuted),
    "idefics3": ("idefics3", "llama", IDEFICS3_TENSORS, tiles_in_the_wrong_order),
    "smolvlm": ("idefics3", "llama", IDEFICS3_TENSORS, tiles_in_the_wrong_order),
}


@pytest.mark.parametrize("family", VISION)
def test_a_vision_language_model_exports_with_its_projector(family: str, tmp_path: Path, monkeypatch) -> None:
    """The language model (llama.cpp's qwen2vl with M-RoPE sections, or gemma3) and the projector file
    (`mmproj`), checked together in llama.cpp: text as for every model, then a probe picture's embeddings
    (llama.cpp's mtmd, its own preprocessing) against the model's tower and projector, and the next token
    after a prompt holding it. A broken projector file (Qwen2-VL's vision q and k swapped; Qwen2.5-VL's
    full-attention block windowed; Gemma 3's soft-embedding norm not shifted by one) is caught at the
    embeddings and leaves nothing."""
    import gguf

    from liger_cli.export.families import VISION_FAMILIES
    from liger_cli.export.verify import ExportMismatch

    assert set(VISION) == set(VISION_FAMILIES)  # every vision-language family liger exports is walked here
    projector_type, arch, tensors, breaks = VISION[family]
    path = tmp_path / family
    if family in ("idefics3", "smolvlm"):
        model = tiny_idefics3(path, family)
    elif family in ("gemma3", "mistral3"):
        model = tiny_gemma3_vlm(path) if family == "gemma3" else tiny_mistral3(path)
    else:
        model = tiny_qwen_vl(path, family)
    done = export(model, tmp_path / "out", quant="f32", ollama=True)
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert names == {
        ".liger-export",
        "Modelfile",
        "export.json",
        f"mmproj-{family}-f32.gguf",
        f"{family}-f32.gguf",
    }
    modelfile = (tmp_path / "out" / "Modelfile").read_text()
    assert modelfile.startswith(f"FROM ./{family}-f32.gguf\n# mmproj-{family}-f32.gguf is for llama.cpp")
    assert "Ollama does not take a separate projector" in modelfile
    report = done.report
    assert report.largest_logprob_diff < (5e-3 if family == "gemma3" else 1e-3), (
        report
    )  # Gemma's GELU: f16 table
    assert report.near_ties == 0 and report.positions >= 20, report
    assert report.image_embedding_diff < 2e-3 and report.image_logprob_diff < 1e-2, report
    text = gguf.GGUFReader(done.path).fields
    assert text["general.architecture"].contents() == arch
    if arch == "qwen2vl":
        assert text["qwen2vl.rope.dimension_sections"].contents() == [2, 1, 1, 0]
    if arch == "qwen3vl":
        assert text["qwen3vl.rope.dimension_sections"].contents() == [24, 20, 20, 0]
        assert text["qwen3vl.n_deepstack_layers"].contents() == 2
    projector = gguf.GGUFReader(tmp_path / "out" / f"mmproj-{family}-f32.gguf")
    assert projector.fields["clip.projector_type"].contents() == projector_type
    assert {t.name for t in projector.tensors} >= tensors
    breaks(monkeypatch)
    with pytest.raises(ExportMismatch, match="llama.cpp encodes the probe image differently"):
        export(model, tmp_path / "broken", quant="f32")
    assert not (tmp_path / "broken").exists()


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def refused_sources(tmp_path: Path, runs: dict[str, Path]) -> dict[str, tuple[Path, dict, str]]:
    """name -> (source, export keywords, the error's words)."""
    from vlm_models import save_tiny_vlm

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
    spm = save_tiny_model(tmp_path / "spm", "llama")  # byte fallback on a byte-level decoder: neither kind
    edit_json(spm / "tokenizer.json", lambda data: data["model"].update(byte_fallback=True))
    qwen3 = tiny_qwen_vl(tmp_path / "qwen3-vl", "qwen3_vl")  # an erf GELU in the tower: llama.cpp's is tanh
    edit_json(qwen3 / "config.json", lambda data: data["vision_config"].update(hidden_act="gelu"))
    mistral3 = tiny_mistral3(tmp_path / "mistral3")  # the tower gated by an erf GELU: llama.cpp's by SiLU
    edit_json(mistral3 / "config.json", lambda data: data["vision_config"].update(hidden_act="gelu"))
    smolvlm = tiny_idefics3(tmp_path / "smolvlm", "smolvlm")  # untiled pictures: llama.cpp always tiles
    edit_json(smolvlm / "preprocessor_config.json", lambda data: data.update(do_image_splitting=False))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    quickstart = runs["quickstart"]
    return {
        "LLaVA": (save_tiny_vlm(tmp_path / "llava"), {}, "llava is a vision-language model: llama.cpp's own converter"),
        "Qwen2-VL without its processor": (save_tiny_vlm(tmp_path / "qwen2-vl", "qwen2_vl"), {}, "has no preprocessor_config.json"),
        "Qwen3-VL tower": (qwen3, {}, "qwen3_vl vision tower: hidden_act gelu (llama.cpp's tower uses the tanh GELU"),
        "Mistral 3 tower": (mistral3, {}, "mistral3: the tower's hidden_act gelu (llama.cpp's tower gates with SiLU"),
        "SmolVLM untiled": (smolvlm, {}, "smolvlm: the processor's tiling (do_image_splitting False, tiles of 32"),
        "family": (save_tiny_model(tmp_path / "gemma", "gemma"), {}, "model_type gemma: liger has not verified"),
        "scaled rope": (save_tiny_model(tmp_path / "rope", "llama", rope_parameters=yarn), {}, "rope_type yarn"),
        "sliding window": (save_tiny_model(tmp_path / "swa", "mistral", sliding_window=16), {}, "sliding_window 16"),
        "Gemma 3 query scale": (save_tiny_model(tmp_path / "g3", "gemma3_text", head_dim=8, query_pre_attn_scalar=12), {},
                                "gemma3 query_pre_attn_scalar 12: llama.cpp scales queries by 1/sqrt"),
        "tokenizer": (spm, {}, "a BPE tokenizer with byte fallback"),
        "quant": (quickstart, {"quant": "q9"}, "--quant q9: choose one of"),
        "format": (quickstart, {"fmt": "onnx"}, "--format onnx"),
        "agreement floor on a plain type": (quickstart, {"min_agreement": 0.5}, "--min-agreement goes with a quantized"),
        "out not empty": (quickstart, {"out": busy}, "is not empty"),
        "out holds the source": (quickstart, {"out": quickstart.parent}, "is the source or a parent"),
        "checkpoint": (quickstart / "checkpoints" / "step-40", {}, "give a finished run's folder"),
    }  # fmt: skip


def test_refusals_name_the_problem_and_write_nothing(runs, tmp_path: Path, monkeypatch) -> None:
    from liger_cli.errors import UserError

    for name, (source, kwargs, words) in refused_sources(tmp_path / "sources", runs).items():
        out = kwargs.pop("out", tmp_path / "out")
        before = sorted(out.parent.iterdir())
        with pytest.raises(UserError, match=words.replace("(", r"\(")):
            export(source, out, **kwargs)
        assert sorted(out.parent.iterdir()) == before, name
    first = export(runs["quickstart"], tmp_path / "again", quant="f32")  # --overwrite: only what export wrote
    again = export(runs["quickstart"], tmp_path / "again", quant="q8_0", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == [
        ".liger-export",
        "export.json",
        again.path.name,
    ]
    assert not first.path.exists()
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # the binding not installed
    with pytest.raises(UserError, match=r"pip install 'liger-cli\[export\]'"):
        export(runs["quickstart"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_command_line_says_one_line_and_exits_2_for_a_refusal_and_1_for_a_failed_check(
    runs, tmp_path
) -> None:
    proc = liger("export", runs["quickstart"], "--out", tmp_path / "out", "--quant", "q9")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --quant q9: choose one of f32, f16, bf16, q8_0, q6_k, q5_k_m, q5_k_s, q5_0, q4_k_m, q4_k_s, q4_0, "
        "q3_k_m, q2_k"
    ]
    model = tiny_family_model(
        tmp_path / "model", "llama"
    )  # its generation config stops where GGUF cannot say
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [2, 5]}))
    proc = liger("export", model, "--out", tmp_path / "out", "--quant", "f32")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "error: liger's engine stops at 5 '<|user|>'; llama.cpp does not"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no OUT, no temporary folder


@pytest.mark.parametrize(
    "fault, quant, words",
    [("logits:segv", "f32", "crashed (SIGSEGV, signal 11) while checking next tokens of model-f32.gguf"),
     ("quantize:abort", "q8_0", "crashed (SIGABRT, signal 6) while quantizing model-f32.gguf to q8_0")],
    ids=["segv", "abort"],
)  # fmt: skip
def test_llama_cpp_crashing_in_its_process_is_one_line_and_leaves_nothing(
    fault: str, quant: str, words: str, tmp_path: Path
) -> None:
    """llama.cpp runs in a child process (liger_cli/export/child.py): killed by a signal there (its test
    hook, as a crash in llama.cpp would be), `liger export` says so in one line (exit 1) after whatever
    llama.cpp wrote (ggml's abort message), and leaves no OUT and no temporary folder."""
    from liger_cli.export.child import FAULT

    model = tiny_family_model(tmp_path / "model", "llama")
    proc = liger("export", model, "--out", tmp_path / "out", "--quant", quant, **{FAULT: fault})
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[:-1] == ([f"GGML_ABORT: {FAULT} (a test hook)"] if "abort" in fault else [])
    assert lines[-1].startswith(f"error: llama.cpp {words}; nothing was exported. "), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no OUT, no temporary folder


@pytest.mark.parametrize(
    "fault, words",
    [("open:exit", r"llama.cpp's process exited \(code 3\) without an answer while loading x.gguf; nothing was"),
     ("open:hang", r"llama.cpp did not answer within 2 s while loading x.gguf: liger stopped it")],
    ids=["exit", "hang"],
)  # fmt: skip
def test_llama_cpp_exiting_or_hanging_in_its_process_is_a_failed_run(
    fault: str, words: str, monkeypatch
) -> None:
    """A child that exits without a signal, or answers no more (each call's deadline, here 2 s): RunFailed
    naming the call; the next call starts a new child, which has imported llama_cpp but not torch."""
    from liger_cli.errors import RunFailed
    from liger_cli.export import child
    from liger_cli.export.runtime import Runtime

    monkeypatch.setenv(child.FAULT, fault)  # the child fails before it reads the file
    monkeypatch.setattr(child, "CALL_TIMEOUT_S", 2.0)
    failed = child.shared()
    with pytest.raises(RunFailed, match=words):
        Runtime(Path("x.gguf"), 64)
    assert not failed.alive()
    monkeypatch.delenv(child.FAULT)
    fresh = child.shared()
    assert fresh is not failed and fresh.alive()
    imported = [fresh.call("asking", 60, "imported", name) for name in ("llama_cpp", "torch", "transformers")]
    assert imported == [True, False, False]


def test_an_end_of_generation_llama_cpp_adds_by_its_text_is_reported_unless_a_probe_reaches_it() -> None:
    """llama.cpp marks `<|endoftext|>` end-of-generation by its text (SmolLM2's id 0), where liger's engine
    stops at `<|im_end|>` only: reported when no probe completion holds it, refused with the fix where one
    does; a stop of liger's that llama.cpp lacks is refused as before."""
    from liger_cli.export.verify import ExportMismatch, Report, check_stops

    class Runtime:  # what check_stops reads of a loaded GGUF
        def __init__(self, ends):
            self.ends = ends

        def end_of_generation(self):
            return self.ends

        def piece(self, token):
            return {0: "<|endoftext|>", 2: "<|im_end|>"}[token]

    report = Report()
    check_stops(Runtime({0, 2}), [2], [[5, 6, 2], [7]], report)
    assert report.stops == (2,) and report.extra_stops == (0,)
    with pytest.raises(
        ExportMismatch, match=r"ends generation at 0 '<\|endoftext\|>' .* probe completion 2 .*eos_token_id"
    ):
        check_stops(Runtime({0, 2}), [2], [[5, 2], [7, 0, 3]], Report())
    with pytest.raises(ExportMismatch, match=r"liger's engine stops at 2 '<\|im_end\|>'; llama.cpp does not"):
        check_stops(Runtime({0}), [0, 2], [], Report())
