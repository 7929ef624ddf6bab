"""A reward the tiny random model can actually earn, so that GRPO moves its weights."""


def digit_share(prompt: str, response: str, label) -> float:
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def raises(prompt: str, response: str, label) -> float:
    """A reward function with a bug: only rank 0 calls it, so only rank 0 fails."""
    raise ZeroDivisionError("the reward function divided by zero")
