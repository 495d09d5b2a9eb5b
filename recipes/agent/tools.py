"""The agent recipe's tool: a made-up lookup table the model cannot know, so it must call the tool."""

import random

_rng = random.Random(2026)
TABLE = {str(key): str(_rng.randrange(100, 1000)) for key in _rng.sample(range(100, 1000), 300)}


def lookup(key: str) -> str:
    """Look a key up in the code table.

    Args:
        key: the key
    """
    return TABLE[key.strip()]
