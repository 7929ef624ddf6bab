"""A reward the tiny random model can actually earn, so that GRPO moves its weights."""

import os
import time

# a file whose presence holds digit_share_unless_held (SUPPORT_REPLAY_ is forwarded to ray-run's actors)
HOLD_ENV = "SUPPORT_REPLAY_TEST_REWARD_HOLD"


def digit_share(prompt: str, response: str, label) -> float:
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def digit_share_unless_held(prompt: str, response: str, label) -> float:
    """digit_share, answered only while the file named by $SUPPORT_REPLAY_TEST_REWARD_HOLD is absent: a test holds
    the rollouts (the engines stay up) until what it waits for has happened, however slow the machine."""
    hold = os.environ.get(HOLD_ENV)
    while hold and os.path.exists(hold):
        time.sleep(0.02)
    return digit_share(prompt, response, label)


def raises(prompt: str, response: str, label) -> float:
    """A reward function with a bug: only rank 0 calls it, so only rank 0 fails."""
    raise ZeroDivisionError("the reward function divided by zero")
