"""`liger train` on a real pretrained model (SmolLM2-135M-Instruct, the `real_model` fixture): a 49,152-token
vocabulary, tied embeddings, 30 layers, GQA (9 heads, 3 kv heads), its ChatML template with a default
system message, pad == eos == <|im_end|>. Every objective runs once, for a step or two on a handful of
short rows, and each is checked as on a tiny model: its first numbers against transformers (and peft)
computed here on ids rendered here by the tokenizer's own chat template, its saved output reloaded.

Train once, assert many: every run shares ONE fresh process (test_train.liger_in_one_process), the SFT run
first so its measured peak is its own (the memory plan's test reads it). References run in the test's
process, whose transformers is never patched. Tolerances: fp32 throughout; liger's kernels (RMSNorm,
RoPE, SwiGLU, the fused chunked cross-entropy) and batching reorder sums over 30 layers and a 49k
vocabulary, which moves a loss by ~1e-6 relative, so 1e-4 relative says "the same computation" while
any token learned or rendered differently moves it by far more."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import causal_lm
from test_train import liger_here, liger_in_one_process

pytestmark = pytest.mark.timeout(1800)
SEED = 0
CHAT = [
    [{"role": "user", "content": "12"}, {"role": "assistant", "content": "twelve"}],
    [{"role": "user", "content": "340"}, {"role": "assistant", "content": "three hundred forty"}],
    [{"role": "system", "content": "Write numbers in words."}, {"role": "user", "content": "7"},
     {"role": "assistant", "content": "seven"}],
    [{"role": "user", "content": "58"}, {"role": "assistant", "content": "fifty-eight"},
     {"role": "user", "content": "9"}, {"role": "assistant", "content": "nine"}],
]  # fmt: skip
CHAT_EVAL = [
    [{"role": "user", "content": "21"}, {"role": "assistant", "content": "twenty-one"}],
    [{"role": "user", "content": "600"}, {"role": "assistant", "content": "six hundred"}],
]
PAIRS = [("3", "three", "four"), ("7", "seven", "six"), ("5", "five", "nine"), ("2", "two", "eight")]
TOOLS = '''def lookup(key: str) -> str:
    """Look a key up in the code table.

    Args:
        key: the key
    """
    return {"417": "123", "221": "968"}[key.strip()]
'''
REWARDS = """def chars(completions, **kwargs):
    return [len(c) / 10 for c in completions]


def found(completions, answer, **kwargs):
    return [float(a in c) for c, a in zip(completions, answer)]
"""
# SmolLM2's own template does not describe tools: a Hermes-style one (tool calls as <tool_call> JSON, tool
# results as a `tool` turn), ChatML otherwise, with an example call so the untrained model calls the tool.
TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
You are a helpful AI assistant named SmolLM, trained by Hugging Face. Answer by calling a tool. Example:
User: What is the code for 123?
Assistant: <tool_call>{"name": "lookup", "arguments": {"key": "123"}}</tool_call>
Tools:
{% for tool in tools %}{{ tool.function.name }}: {{ tool.function.description }}
{% endfor %}<|im_end|>
{% elif messages[0]['role'] != 'system' %}<|im_start|>system
You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}<|im_start|>tool
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content or '' }}{% for call in message.tool_calls or [] %}<tool_call>{"name": "{{ call.function.name }}", \
"arguments": {{ call.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def question(key: str) -> dict:
    return {"role": "user", "content": f"What is the code for {key}?"}


def tool_call(key: str) -> dict:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"key": key}}}],
    }


# One solved example before the question: SmolLM2 then calls the tool greedily, its first token ahead of the
# next by 0.8 logits (measured with transformers), a certainty at the agent run's temperature 0.05.
ONE_SHOT = [question("555"), tool_call("555"), {"role": "tool", "name": "lookup", "content": "777"},
            {"role": "assistant", "content": "777"}]  # fmt: skip


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": f"Write {text} in words."}]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def recipe(root: Path, name: str, model: Path, data: dict, training: dict, **sections) -> Path:
    """A recipe for RUN `name` in root/name: LoRA r=4 on every linear layer, logged every step."""
    body = {
        "model": {"path": str(model), "dtype": "float32"},
        "adapter": {"type": "lora", "r": 4, "alpha": 8},
        "data": {"max_seq_len": 96, **data},
        "training": {"micro_batch_size": 4, "lr": 2.0e-3, "seed": SEED, **training},
        "output": {"dir": str(root / name)},
        "logging": {"every": 1},
        **sections,
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


def truncated_student(real_model: Path, path: Path, layers: int = 4) -> Path:
    """The real model's first `layers` layers (its embeddings, tied head and tokenizer): a distillation
    student that shares the teacher's tokenizer and starts far from it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(real_model).save_pretrained(path)
    return path


def tool_tokenizer(real_model: Path, path: Path) -> Path:
    """SmolLM2's tokenizer with TOOL_TEMPLATE as its chat template (the recipe's model.tokenizer)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model)
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def runs(real_model: Path, tmp_path_factory) -> dict:
    """Every objective's run in ONE fresh process, SFT first (the memory plan compares its peak)."""
    root = tmp_path_factory.mktemp("real-model")
    (root / "tools.py").write_text(TOOLS)
    (root / "rewards.py").write_text(REWARDS)
    chat = write_jsonl(root / "chat.jsonl", [{"messages": m} for m in CHAT])
    chat_eval = write_jsonl(root / "chat-eval.jsonl", [{"messages": m} for m in CHAT_EVAL])
    pairs = write_jsonl(root / "pairs.jsonl", [
        {"prompt": user(n), "chosen": [{"role": "assistant", "content": c}],
         "rejected": [{"role": "assistant", "content": r}]} for n, c, r in PAIRS])  # fmt: skip
    thumbs = write_jsonl(root / "thumbs.jsonl", [
        {"prompt": user(n), "completion": [{"role": "assistant", "content": r if k % 2 else c}], "label": k % 2 == 0}
        for k, (n, c, r) in enumerate(PAIRS)])  # fmt: skip
    prompts = write_jsonl(root / "prompts.jsonl", [{"prompt": user(n), "answer": c} for n, c, _ in PAIRS[:2]])
    keys = write_jsonl(root / "keys.jsonl", [{"prompt": [*ONE_SHOT, question("417")], "answer": "123"}])
    student = truncated_student(real_model, root / "student")
    tokenizer = tool_tokenizer(real_model, root / "tool-tokenizer")
    m = real_model
    recipes = {
        "sft": recipe(root, "sft", m, {"train": chat, "eval": chat_eval, "format": "chat"},
                      {"max_steps": 2, "eval_every": 2}),
        "dpo": recipe(root, "dpo", m, {"train": pairs, "format": "preference"},
                      {"objective": "dpo", "max_steps": 2}, preference={"beta": 0.1}),
        "kto": recipe(root, "kto", m, {"train": thumbs, "eval": thumbs, "format": "unpaired"},
                      {"objective": "kto", "max_steps": 1, "eval_every": 1}, kto={"beta": 0.1}),
        "reward": recipe(root, "reward", m, {"train": pairs, "format": "preference"},
                         {"objective": "reward", "max_steps": 1}, reward={"center_coefficient": 0.01}),
        "grpo": recipe(root, "grpo", m, {"train": prompts, "format": "prompt"},
                       {"objective": "grpo", "max_steps": 1, "micro_batch_size": 2},
                       rl={"num_generations": 2, "max_new_tokens": 8, "temperature": 1.0, "loss": "dapo",
                           "rewards": [{"function": f"{root / 'rewards.py'}:chars"}]}),
        "agent": recipe(root, "agent", m, {"train": keys, "format": "prompt", "max_seq_len": 224},
                        {"objective": "grpo", "max_steps": 1, "micro_batch_size": 1},
                        rl={"tools": [f"{root / 'tools.py'}:lookup"], "max_turns": 2, "max_new_tokens": 32,
                            "num_generations": 2, "temperature": 0.05,
                            "rewards": [{"function": f"{root / 'rewards.py'}:found"}]}),
        "distill": recipe(root, "distill", student, {"train": prompts, "format": "prompt"},
                          {"objective": "distill", "max_steps": 1, "micro_batch_size": 2},
                          distill={"teacher": str(m)}, rl={"num_generations": 2, "max_new_tokens": 8}),
    }  # fmt: skip
    agent = yaml.safe_load(recipes["agent"].read_text())
    agent["model"]["tokenizer"] = str(tokenizer)
    recipes["agent"].write_text(yaml.safe_dump(agent, sort_keys=False))
    procs = liger_in_one_process(*(["train", str(path)] for path in recipes.values()), timeout=1500)
    return {"root": root, "student": student, "tokenizer": tokenizer, "recipes": recipes,
            "procs": dict(zip(recipes, procs, strict=True))}  # fmt: skip


def run(runs: dict, name: str) -> Path:
    proc = runs["procs"][name]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return runs["root"] / name


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def step(out: Path, n: int) -> dict:
    return next(m for m in metrics(out) if m.get("step") == n and "loss" in m)


def rollouts(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]


# --- the references: transformers on ids rendered here ------------------------------------------------------
@pytest.fixture(scope="module")
def base(real_model: Path):
    return causal_lm(real_model)


def render(tokenizer, messages: list[dict], **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def learned_turns(tokenizer, messages: list[dict], last_only: bool = False) -> tuple[list[int], list[int]]:
    """The conversation's ids and labels: each assistant turn learned from where the prompt before it
    (with the generation prompt) ends to where the conversation through it ends, as docs/data.md says."""
    text = render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant" and (not last_only or i == len(messages) - 1):
            start = len(render(tokenizer, messages[:i], add_generation_prompt=True))
            end = len(render(tokenizer, messages[: i + 1]))
            assert text[:end] == render(tokenizer, messages[: i + 1])  # the template is prefix-stable
            spans.append((start, end))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"]
    labels = [
        t if any(s <= a < e for s, e in spans) else -100
        for t, (a, _) in zip(ids, encoded["offset_mapping"], strict=True)
    ]
    return ids, labels


@torch.no_grad()
def token_logps(model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1."""
    logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def summed_logp(model, ids: list[int], labels: list[int]) -> float:
    mask = torch.tensor(labels[1:]) != -100
    return token_logps(model, ids)[mask].sum().item()


def mean_nll(model, rows: list[tuple[list[int], list[int]]]) -> float:
    total = sum(-summed_logp(model, ids, labels) for ids, labels in rows)
    return total / sum(sum(label != -100 for label in labels[1:]) for _, labels in rows)


# --- SFT, the kernels, the memory plan ----------------------------------------------------------------------
def test_sft_step_1_loss_is_transformers_loss_on_the_chat_template_s_tokens(runs, base, tokenizer):
    """Step 1 takes all 4 rows (micro-batch 4) at the initial weights (LoRA's B starts at zero): its loss
    is transformers' mean token NLL of the assistant turns, rendered here by SmolLM2's template (its
    default system message where a row has none), the whole conversation learned turn by turn."""
    out = run(runs, "sft")
    want = mean_nll(base, [learned_turns(tokenizer, m) for m in CHAT])
    assert step(out, 1)["loss"] == pytest.approx(want, rel=1e-4)
    assert step(out, 2)["loss"] < step(out, 1)["loss"]  # the same batch again, after a step on it


def test_sft_eval_loss_is_the_saved_adapter_reloaded_with_peft(runs, real_model, tokenizer):
    """final/ is a peft adapter of the real model: reloaded on it, its eval loss is the run's last."""
    from safetensors.torch import load_file

    out = run(runs, "sft")
    final = out / "final"
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (final / name).is_file(), name
    weights = load_file(final / "adapter_model.safetensors")
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in weights.items())  # trained, not the init
    model = causal_lm(real_model, final)
    want = mean_nll(model, [learned_turns(tokenizer, m) for m in CHAT_EVAL])
    final_eval = json.loads((out / "final_metrics.json").read_text())["eval_loss"]
    assert final_eval == pytest.approx(want, rel=1e-4)
    assert next(m for m in metrics(out) if m.get("step") == 0)["eval_loss"] > final_eval


def test_kernels_are_proved_and_patched_on_every_module_of_the_real_model(runs, base):
    """The Plan's kernel-check verdicts on this model: the check agrees and each kernel is patched into
    every module of its kind transformers built (61 RMSNorms: 2 a layer and the final one; 30 attention
    and MLP blocks; the one head). Step 1's loss above, patched, is transformers' unpatched."""
    plan = (run(runs, "sft") / "plan.txt").read_text()
    count = {}
    for module in base.modules():
        count[type(module).__name__] = count.get(type(module).__name__, 0) + 1
    assert (
        "note: kernel check: one step on a tiny twin, patched vs unpatched: loss, every gradient and " in plan
    )
    assert count["LlamaRMSNorm"] == 61 and count["LlamaAttention"] == count["LlamaMLP"] == 30
    assert f"rms_norm: patched {count['LlamaRMSNorm']} modules (LlamaRMSNorm)" in plan
    assert f"rope: patched {count['LlamaAttention']} modules (LlamaAttention)" in plan
    assert f"swiglu: patched {count['LlamaMLP']} modules (LlamaMLP)" in plan
    assert "fused_linear_cross_entropy: patched 1 module (LlamaForCausalLM)" in plan


def test_dry_run_memory_plan_is_within_25_percent_of_the_measured_peak(runs):
    """`--dry-run --json` on the SFT recipe (writes nothing) against the peak its run measured, the
    band tests/test_memory_plan.py holds the tiny models to. Its activations are under 1 MiB a tensor:
    served from glibc's heap (the threshold was 1 MiB) their fragments made the peak 1.35x the plan."""
    out = run(runs, "sft")
    proc = liger_here("train", str(runs["recipes"]["sft"]), "--dry-run", "--json",
                      "--set", f"output.dir={runs['root'] / 'dry'}")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (runs["root"] / "dry").exists()
    memory = json.loads(proc.stdout)["memory"]
    found = json.loads((out / "final_metrics.json").read_text())["peak_mem_growth_mb"] * 2**20
    assert 0.75 <= memory["total_bytes"] / found <= 1.25, (memory, found)


def test_dry_run_counts_the_real_model_s_parameters_and_its_tied_head_once(runs):
    """The memory plan's parameters are the real model's in fp32, its tied head counted once: the 134,515,008
    of transformers' own count plus the adapter's 1,221,120 (the run's line `parameters:`)."""
    proc = liger_here("train", str(runs["recipes"]["sft"]), "--dry-run", "--json",
                      "--set", f"output.dir={runs['root'] / 'dry'}")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (runs["root"] / "dry").exists()
    assert "parameters: 1,221,120 trainable of 135,736,128" in runs["procs"]["sft"].stdout
    memory = json.loads(proc.stdout)["memory"]
    assert memory["components"]["parameters"] == (134_515_008 + 1_221_120) * 4


# --- preferences ----------------------------------------------------------------------------------------------
def pair_ids(tokenizer, prompt: list[dict], answer: str) -> tuple[list[int], list[int]]:
    return learned_turns(tokenizer, [*prompt, {"role": "assistant", "content": answer}], last_only=True)


def test_dpo_step_1_log_probs_are_transformers(runs, base, tokenizer):
    """At step 1 policy == reference: the loss is ln 2, and logps/chosen and logps/rejected are the
    mean over the 4 pairs of transformers' summed log-probs of each answer turn (end of turn included)."""
    out = run(runs, "dpo")
    first = step(out, 1)
    chosen = [summed_logp(base, *pair_ids(tokenizer, user(n), c)) for n, c, _ in PAIRS]
    rejected = [summed_logp(base, *pair_ids(tokenizer, user(n), r)) for n, _, r in PAIRS]
    assert first["loss"] == pytest.approx(math.log(2), rel=1e-5)
    assert first["logps/chosen"] == pytest.approx(sum(chosen) / 4, rel=1e-4)
    assert first["logps/rejected"] == pytest.approx(sum(rejected) / 4, rel=1e-4)
    assert step(out, 2)["rewards/margins"] > 0  # one step on these pairs prefers the chosen answers
    assert (out / "final" / "adapter_model.safetensors").is_file()


def test_kto_eval_rewards_are_the_saved_adapter_against_the_base(runs, real_model, base, tokenizer):
    """After one step, the eval rewards are beta times (policy - reference) summed log-probs of each
    completion: the saved adapter through peft against the base model, averaged per label."""
    out = run(runs, "kto")
    first = step(out, 1)
    assert first["loss"] == pytest.approx(0.5) and first["kl"] == 0  # policy == reference at step 1
    policy = causal_lm(real_model, out / "final")
    rewards = {True: [], False: []}
    for k, (n, c, r) in enumerate(PAIRS):
        ids, labels = pair_ids(tokenizer, user(n), r if k % 2 else c)
        rewards[k % 2 == 0].append(0.1 * (summed_logp(policy, ids, labels) - summed_logp(base, ids, labels)))
    final = json.loads((out / "final_metrics.json").read_text())
    desirable, undesirable = (sum(v) / len(v) for v in (rewards[True], rewards[False]))
    assert final["eval_rewards/desirable"] == pytest.approx(desirable, rel=1e-3, abs=1e-5)
    assert final["eval_rewards/undesirable"] == pytest.approx(undesirable, rel=1e-3, abs=1e-5)
    assert desirable > 0 > undesirable


def test_reward_model_step_1_loss_is_transformers_sequence_classifier(runs, real_model, tokenizer):
    """Step 1 (all 4 pairs) is the Bradley-Terry loss with centring of transformers' own
    LlamaForSequenceClassification (the score head seeded as the run seeds it, LoRA at zero) on the
    pairs rendered here: where transformers reads a sequence's score is where liger trains it."""
    from transformers import AutoModelForSequenceClassification

    out = run(runs, "reward")
    torch.manual_seed(SEED)
    model = AutoModelForSequenceClassification.from_pretrained(
        real_model, num_labels=1, pad_token_id=tokenizer.pad_token_id, dtype=torch.float32
    ).eval()

    def score(n: str, answer: str) -> float:
        ids, _ = pair_ids(tokenizer, user(n), answer)
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids])).logits[0, 0].item()

    chosen = torch.tensor([score(n, c) for n, c, _ in PAIRS])
    rejected = torch.tensor([score(n, r) for n, _, r in PAIRS])
    want = (-F.logsigmoid(chosen - rejected) + 0.01 * (chosen + rejected) ** 2).mean()
    first = step(out, 1)
    assert first["loss"] == pytest.approx(want.item(), rel=1e-4)
    assert first["scores/chosen"] == pytest.approx(chosen.mean().item(), rel=1e-4, abs=1e-5)


# --- online: GRPO, the agent loop, distillation -----------------------------------------------------------
def test_grpo_prompts_log_probs_rewards_and_loss_are_transformers(runs, base, tokenizer):
    """Step 1's rollouts: each prompt is the chat template's rendering with the generation prompt, each
    sampled token's log-prob is transformers' at the initial weights, the rewards are the function's, and
    the dapo loss at ratio 1 is -sum_i A_i |o_i| / sum_i |o_i| with A the group-normalised rewards."""
    out = run(runs, "grpo")
    found = rollouts(out)
    assert len(found) == 4
    for r in found:
        want = tokenizer.apply_chat_template(
            r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert r["prompt_ids"] == list(want)
        logps = token_logps(base, r["prompt_ids"] + r["completion_ids"])[len(r["prompt_ids"]) - 1 :]
        torch.testing.assert_close(logps, torch.tensor(r["sampler_logprobs"]), atol=2e-4, rtol=0)
        assert r["reward"] == pytest.approx(len(r["completion"]) / 10)
    advantages, lengths = [], []
    for g in range(0, 4, 2):
        rewards = torch.tensor([r["reward"] for r in found[g : g + 2]])
        advantages += ((rewards - rewards.mean()) / (rewards.std() + 1e-4)).tolist()
        lengths += [sum(r["completion_mask"]) for r in found[g : g + 2]]
    want = -sum(a * n for a, n in zip(advantages, lengths, strict=True)) / sum(lengths)
    assert step(out, 1)["loss"] == pytest.approx(want, rel=1e-4, abs=1e-6)


def test_the_agent_calls_its_tool_through_a_tools_template(runs):
    """With a tools template (model.tokenizer), the real model's rollouts call lookup, get its result
    as a tool turn and answer in a second turn: the trajectory's ids are the template's rendering of its
    messages (token in, token out) and only the model's own tokens are learned."""
    from transformers import AutoTokenizer
    from transformers.utils import get_json_schema

    out = run(runs, "agent")
    tokenizer = AutoTokenizer.from_pretrained(runs["tokenizer"])
    namespace: dict = {}
    exec(TOOLS, namespace)
    schema = [get_json_schema(namespace["lookup"])]
    found = rollouts(out)
    called = [r for r in found if r["tool_calls"]]
    assert called, [r["completion"] for r in found]
    for r in found:
        prompt = tokenizer.apply_chat_template(
            r["prompt"], tools=schema, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert r["prompt_ids"] == list(prompt)
    r = called[0]
    tool = r["messages"][len(r["prompt"]) + 1]
    assert tool["role"] == "tool" and tool["content"] == "123" and r["turns"] == 2
    assert (
        r["messages"][len(r["prompt"])]["tool_calls"][0]["function"]
        == tool_call("417")["tool_calls"][0]["function"]
    )
    result = tokenizer("<|im_start|>tool\n123<|im_end|>", add_special_tokens=False)["input_ids"]
    ids, mask = r["completion_ids"], r["completion_mask"]
    at = next(i for i in range(len(ids)) if ids[i : i + len(result)] == result)
    assert not any(mask[at : at + len(result)]) and mask[0] == 1  # the tool's tokens are never learned
    last = step(out, 1)
    assert last["tool/calls"] == pytest.approx(sum(x["tool_calls"] for x in found) / len(found))


def test_distillation_kl_from_the_real_teacher_is_transformers(runs, real_model, base):
    """A 4-layer student cut from the real model learns from it: step 1's kl is the reverse KL(student
    || teacher) over the whole 49,152-token vocabulary at every sampled token, computed here with
    transformers for both models, averaged over the completions' tokens."""
    out = run(runs, "distill")
    student = causal_lm(runs["student"])
    total, tokens = 0.0, 0
    for r in rollouts(out):
        ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
        start = len(r["prompt_ids"]) - 1
        with torch.no_grad():
            s = torch.log_softmax(student(input_ids=ids).logits[0, start:-1], -1)
            t = torch.log_softmax(base(input_ids=ids).logits[0, start:-1], -1)
        total += (s.exp() * (s - t)).sum().item()
        tokens += len(r["completion_ids"])
    first = step(out, 1)
    assert first["kl"] == pytest.approx(total / tokens, rel=1e-4)
    assert (out / "final" / "adapter_model.safetensors").is_file()


def test_a_prompt_whose_messages_hold_tool_calls_is_kept_as_written(runs, tmp_path, monkeypatch):
    """A prompt row's messages with a tool call (typed List(Json) by `datasets`) reach the run as the JSON
    they were written as: the encoding map once kept the input column's type for its output of the same
    name, and the agent loop read the prompt back as a list of characters."""
    from transformers import AutoTokenizer

    from liger_cli.data import build_datasets
    from liger_cli.recipe import load_recipe
    from liger_cli.run.inputs import tool_schemas

    monkeypatch.setenv("LIGER_CACHE", str(tmp_path))  # built here, not read from the run's entry
    recipe = load_recipe(runs["recipes"]["agent"])
    tokenizer = AutoTokenizer.from_pretrained(runs["tokenizer"])
    train, _ = build_datasets(recipe.data, tokenizer, SEED, tool_schemas(recipe.rl))
    assert json.loads(train[0]["prompt"]) == [*ONE_SHOT, question("417")]
    assert json.loads(train[0]["fields"]) == {"answer": "123"}
