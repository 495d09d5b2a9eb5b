"""Each data format's row check names a bad row's first problem in words a user can act on (the text that
`liger train` and `liger data` print with the file and line): one case per message, in this process."""

from __future__ import annotations

import pytest

from liger_cli.data.files import row_check

USER = {"role": "user", "content": "Write 12 in words."}
ANSWER = {"role": "assistant", "content": "twelve"}

CASES = [
    ("chat", {}, 'field "messages" is missing'),
    ("chat", {"messages": "hi"}, 'field "messages" must be a list, found str'),
    ("chat", {"messages": []}, 'field "messages" is empty'),
    ("chat", {"messages": [USER, ANSWER], "tools": {}}, 'field "tools" must be a list of tool schemas, found dict'),
    ("chat", {"messages": ["hi"]}, 'field "messages[0]" must be an object with role and content, found str'),
    ("chat", {"messages": [{"content": "x"}]}, 'field "messages[0].role" is missing'),
    ("chat", {"messages": [{"role": 1, "content": "x"}]}, 'field "messages[0].role" must be a string, found int'),
    ("chat", {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     'field "messages[0].tool_calls" must be a list, on an assistant message'),
    ("chat", {"messages": [{"role": "user"}]}, 'field "messages[0].content" is missing'),
    ("chat", {"messages": [{"role": "user", "content": 3}]}, 'field "messages[0].content" must be a string, found int'),
    ("chat", {"messages": [USER, {"role": "assistant", "content": [{"type": "image", "path": "a.png"}]}]},
     'field "messages[1].content[0]": an assistant turn\'s parts must be text (images are for the other turns)'),
    ("chat", {"messages": [USER, {**ANSWER, "reasoning_content": 1}]},
     'field "messages[1].reasoning_content" must be a string, on an assistant message'),
    ("chat", {"messages": [USER]}, 'field "messages" has no assistant turn, so there is nothing to learn'),
    ("chat", {"messages": [USER, ANSWER]}, None),
    ("prompt", {}, 'field "prompt" is missing'),
    ("prompt", {"prompt": " "}, 'field "prompt" is empty'),
    ("prompt", {"prompt": 3}, 'field "prompt" must be a string or a non-empty list of messages'),
    ("prompt", {"prompt": [{"role": "user"}]}, 'field "prompt[0]" must be an object with "role" and "content"'),
    ("prompt", {"prompt": [USER, ANSWER]}, 'field "prompt": the last message is the assistant\'s; end with the turn to answer'),
    ("preference", {"chosen": "a"}, 'field "rejected" is missing'),
    ("preference", {"chosen": "a", "rejected": 1}, 'field "rejected" must be a string or a list of messages, found int'),
    ("preference", {"chosen": "a", "rejected": [ANSWER]},
     'fields "prompt", "chosen" and "rejected" must be all strings or all message lists, not mixed'),
    ("preference", {"prompt": "p", "chosen": "a", "rejected": " "}, 'field "rejected" is empty'),
    ("preference", {"prompt": [USER], "chosen": [ANSWER], "rejected": [USER]},
     'field "rejected" has no assistant turn, so there is nothing to learn'),
    ("preference", {"prompt": [USER], "chosen": [ANSWER], "rejected": [ANSWER, USER]},
     'field "rejected": its last message must be the assistant\'s answer'),
    ("preference", {"chosen": [USER, ANSWER], "rejected": [{**USER, "content": "other"}, ANSWER]},
     'without "prompt", chosen and rejected must be whole conversations that share every message but the '
     "last; add a prompt field, or make their earlier messages equal"),
    ("unpaired", {"prompt": "p", "completion": "c"},
     'field "label" must be true (a desirable completion) or false (an undesirable one): it is missing'),
    ("unpaired", {"prompt": "p", "completion": "c", "label": "yes"},
     'field "label" must be true (a desirable completion) or false (an undesirable one): found str \'yes\''),
    ("unpaired", {"messages": [USER, ANSWER], "prompt": "p", "label": True},
     'give either "messages" or "prompt" with "completion", not both'),
    ("unpaired", {"messages": [ANSWER, USER], "label": True},
     'field "messages": its last message must be the assistant\'s completion'),
    ("unpaired", {"prompt": "p", "label": True}, 'field "completion" is missing (or give "messages")'),
    ("unpaired", {"prompt": "p", "completion": 1, "label": True},
     'field "completion" must be a string or a list of messages, found int'),
    ("unpaired", {"prompt": "p", "completion": [ANSWER], "label": True},
     'fields "prompt" and "completion" must be both strings or both message lists, not mixed'),
    ("unpaired", {"prompt": "p", "completion": " ", "label": False}, 'field "completion" is empty'),
    ("unpaired", {"prompt": [], "completion": [ANSWER], "label": False}, 'field "prompt" is empty'),
    ("unpaired", {"prompt": [USER], "completion": [ANSWER, USER], "label": False},
     'field "completion": its last message must be the assistant\'s'),
    ("unpaired", {"prompt": [USER], "completion": [ANSWER], "label": True}, None),
]  # fmt: skip


@pytest.mark.parametrize(("fmt", "row", "message"), CASES)
def test_each_bad_row_gets_its_first_problem_named(fmt: str, row: dict, message: str | None) -> None:
    assert row_check(fmt)(row) == message
