"""The generation engine against transformers and plain forwards, and prompts rendered as training did.

Greedy tokens equal transformers' `generate`; each recorded log-probability equals the one a full
forward (no cache) gives; sampling is a function of (seed, key) alone; top-k/top-p keep exactly the
set a brute-force reference keeps; a chat prompt is token for token the context training put before
the answer, for every template family the tests ship.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_chat_templates import EXPECTED, FAMILIES, TWO_TURNS, encode_rows, family_tokenizer

from liger_cli.data.encode import encode_instruction
from liger_cli.generate.engine import Sampling, choose, generate, truncated
from liger_cli.generate.prompts import PromptError, Renderer, turn_end_ids
from liger_cli.run.samples import prompt_and_answer


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def prompts_of(tok, texts):
    return [tok(t)["input_ids"] for t in texts]


TEXTS = ["one two three", "seven", "a b c d e f g h i j", "forty-two and"]


def test_greedy_equals_transformers_generate(tiny):
    model, tok = tiny
    prompts = prompts_of(tok, TEXTS)
    got = generate(
        model, prompts, Sampling(12, temperature=0), stop_ids=[tok.eos_token_id], pad_id=tok.pad_token_id
    )
    tok.padding_side = "left"
    batch = tok.pad({"input_ids": prompts}, return_tensors="pt")
    ref = model.generate(**batch, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id)  # fmt: skip
    for row, completion in enumerate(got):
        want = ref[row, batch["input_ids"].shape[1] :].tolist()
        if tok.eos_token_id in want:
            want = want[: want.index(tok.eos_token_id) + 1]
        assert completion.ids == want
        assert completion.finish_reason == ("stop" if want[-1] == tok.eos_token_id else "length")


def test_log_probs_are_those_of_a_full_forward(tiny):
    """Both log-probs of each sampled token, against one cache-free forward over prompt + completion."""
    model, tok = tiny
    prompts = prompts_of(tok, TEXTS)
    sampling = Sampling(10, temperature=0.7, top_k=20, top_p=0.9, seed=3)
    got = generate(model, prompts, sampling, stop_ids=[], pad_id=tok.pad_token_id)
    for prompt, completion in zip(prompts, got, strict=True):
        assert len(completion.ids) == 10 and completion.finish_reason == "length"
        ids = torch.tensor([prompt + completion.ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double()
        full = torch.log_softmax(logits / 0.7, dim=-1)
        want_full = full.gather(-1, torch.tensor(completion.ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(completion.full_logprobs, dtype=torch.float64), want_full,
                                   atol=2e-5, rtol=0)  # fmt: skip
        # The distribution sampled from: the top 20, then the most likely tokens reaching 0.9, renormalised.
        for t, token in enumerate(completion.ids):
            order = full[t].argsort(descending=True, stable=True)[:20]
            probs = full[t, order].exp() / full[t, order].exp().sum()
            kept = order[: int((probs.cumsum(0) - probs < 0.9).sum())]
            assert token in kept.tolist()
            want = full[t, token] - torch.logsumexp(full[t, kept], 0)
            assert completion.logprobs[t] == pytest.approx(want.item(), abs=2e-5)
            assert completion.logprobs[t] >= completion.full_logprobs[t] - 1e-6


def test_sampling_depends_on_seed_and_key_only(tiny):
    model, tok = tiny
    prompts = prompts_of(tok, TEXTS)
    sampling = Sampling(8, temperature=1.0, seed=11)
    whole = generate(model, prompts, sampling, stop_ids=[], pad_id=tok.pad_token_id)
    alone = generate(model, prompts[2:3], sampling, stop_ids=[], pad_id=tok.pad_token_id, keys=[2])
    assert alone[0].ids == whole[2].ids  # the batch around it changes nothing
    again = generate(model, prompts, sampling, stop_ids=[], pad_id=tok.pad_token_id)
    assert [c.ids for c in again] == [c.ids for c in whole]
    other = generate(
        model, prompts, Sampling(8, temperature=1.0, seed=12), stop_ids=[], pad_id=tok.pad_token_id
    )
    assert [c.ids for c in other] != [c.ids for c in whole]


def test_each_sequence_stops_on_its_own(tiny):
    """A stop token ends one row (finish_reason stop, the token kept) while the others go on."""
    model, tok = tiny
    prompts = prompts_of(tok, TEXTS)
    free = generate(model, prompts, Sampling(8, temperature=0), stop_ids=[], pad_id=tok.pad_token_id)
    stop = free[1].ids[3]
    got = generate(model, prompts, Sampling(8, temperature=0), stop_ids=[stop], pad_id=tok.pad_token_id)
    for row, (f, g) in enumerate(zip(free, got, strict=True)):
        cut = f.ids.index(stop) + 1 if stop in f.ids else len(f.ids)
        assert g.ids == f.ids[:cut], row
        assert g.finish_reason == ("stop" if stop in f.ids else "length")
    assert got[1].finish_reason == "stop" and len(got[1].ids) <= 4


def test_truncation_keeps_what_a_reference_keeps():
    torch.manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(6, 50) * 2, dim=-1)
    for top_k, top_p in [(0, 1.0), (5, 1.0), (0, 0.5), (7, 0.8), (1, 0.3)]:
        kept = truncated(logprobs, top_k, top_p)
        for row in range(6):
            order = sorted(range(50), key=lambda i: -logprobs[row, i].item())
            if top_k:
                order = order[:top_k]
            p = logprobs[row, order].exp()
            p = p / p.sum()
            keep = [order[i] for i in range(len(order)) if p[:i].sum() < top_p]
            assert sorted((kept[row] > -torch.inf).nonzero().flatten().tolist()) == sorted(keep)
            assert kept[row].exp().sum().item() == pytest.approx(1.0, abs=1e-5)


def test_sampled_frequencies_follow_the_kept_distribution():
    """Inverse-CDF sampling with 4000 seeded uniforms lands on each kept token about as often as its
    renormalised probability says, and never outside."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).repeat(4000, 1)
    generator = torch.Generator().manual_seed(0)
    uniforms = torch.rand(4000, generator=generator)
    sampling = Sampling(1, temperature=1.0, top_p=0.9)
    token, sampled, _ = choose(logits, sampling, uniforms)
    kept = truncated(torch.log_softmax(logits[:1], -1), 0, 0.9)[0].exp()
    counts = torch.bincount(token, minlength=6).double() / 4000
    assert (counts[kept == 0] == 0).all()
    torch.testing.assert_close(counts, kept.double(), atol=0.03, rtol=0)
    torch.testing.assert_close(sampled, kept[token].log(), atol=1e-6, rtol=0)


def test_bad_sampling_settings_are_refused():
    for bad in ({"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -1}, {"max_new_tokens": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Sampling(**bad)


# --- prompts rendered as training rendered them -------------------------------------------------------------


@pytest.mark.parametrize("family", [*EXPECTED, "qwen3"])
def test_a_chat_prompt_is_the_context_training_put_before_the_answer(tmp_path, family):
    """The rendered prompt for messages[:k] is exactly the tokens before turn k's first learned token,
    for every family's template (Qwen3's, which is not prefix-stable, for the last turn)."""
    tok = family_tokenizer(family)
    train = encode_rows(tmp_path, tok, [{"messages": TWO_TURNS}], learn_turns="last")
    prompt, answer = prompt_and_answer(train.examples[0]["input_ids"], train.examples[0]["labels"])
    renderer = Renderer(tok, "chat")
    assert renderer.ids({"messages": TWO_TURNS[:-1]}) == prompt
    assert TWO_TURNS[-1]["content"] in tok.decode(answer)
    stops = renderer.stop_ids()
    assert answer[-1] in stops or tok.decode(answer[-1:]).strip() == ""  # the turn's closer stops it


def test_the_turn_end_token_of_each_family():
    want = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "gemma": "<end_of_turn>", "mistral": "</s>",
            "marked": "<|im_end|>"}  # fmt: skip
    for family, token in want.items():
        tok = family_tokenizer(family)
        assert [tok.convert_ids_to_tokens(i) for i in turn_end_ids(tok)] == [token], family
    assert set(want) == set(EXPECTED) and "qwen3" in FAMILIES


def test_an_instruction_prompt_is_the_training_prompt(tiny):
    _, tok = tiny
    row = {"instruction": "Write the number in words.", "input": "347", "output": "three hundred forty-seven"}
    encoded = encode_instruction(row, tok)
    prompt = encoded.input_ids[: next(t for t, label in enumerate(encoded.labels) if label != -100)]
    renderer = Renderer(tok, "instruction")
    assert renderer.ids(row) == prompt
    assert renderer.ids({"prompt": "Write the number in words.\n347"}) == prompt  # first line, then input
    assert renderer.stop_ids() == [tok.eos_token_id]


def test_prompts_a_format_cannot_render_are_refused(tiny):
    _, tok = tiny
    messages = [{"role": "user", "content": "hi"}]
    for fmt in ("text", "instruction"):
        with pytest.raises(PromptError, match=f"trained on format {fmt}"):
            Renderer(tok, fmt).ids({"messages": messages})
    chat = Renderer(family_tokenizer("chatml"), "chat")
    with pytest.raises(PromptError, match="ends with an assistant turn"):
        chat.ids({"messages": [*messages, {"role": "assistant", "content": "x"}]})
    with pytest.raises(PromptError, match="must be a text"):
        chat.ids({"prompt": 3})
    system = Renderer(family_tokenizer("chatml"), "chat", system="Be brief.")
    assert json.dumps(system.ids({"prompt": "hi"})) != json.dumps(chat.ids({"prompt": "hi"}))
