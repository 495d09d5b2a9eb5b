"""The agent recipe's reward: the final answer is the table's code for the row's key."""


def correct(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """1.0 where the last model turn's text, stripped, is the row's answer."""
    return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]
