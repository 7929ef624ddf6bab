"""Poison requests: each one must get a 4xx, quickly, while the good requests sent beside it come
out exactly as without it (deterministic engine). Used by tests/serving/test_reliability.py (8 good
requests) and bench/poison.py (63)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

GOOD = {
    "sampling_params": {"temperature": 1.0, "top_k": 16, "top_p": 0.9, "max_new_tokens": 6, "ignore_eos": True},
    "return_sampling_mask": True,
}

POISONS = {
    "huge seed": {"input_ids": [1, 2, 3], "sampling_params": {"top_k": 8, "sampling_seed": 2**64}},
    "over-long prompt": {"input_ids": [5] * 100_000, "sampling_params": {"top_k": 8}},
    "huge max_new_tokens": {"input_ids": [1, 2, 3], "sampling_params": {"top_k": 8, "max_new_tokens": 10**9}},
    "10^4 stop strings": {
        "input_ids": [1, 2, 3],
        "sampling_params": {"top_k": 8, "stop": [f"s{i}" for i in range(10_000)]},
    },
    "support over the capture limit": {
        "input_ids": [1, 2, 3],
        "sampling_params": {"top_k": 100_000},
        "return_sampling_mask": True,
    },
    "malformed JSON": b'{"input_ids": [1, 2,',
    "wrong types": {"input_ids": "one two three", "sampling_params": {"top_k": "eight"}},
}


def good_body(i: int) -> dict:
    return {
        "input_ids": [5 + i % 7, 40, 77, 9 + i],
        **GOOD,
        "sampling_params": {**GOOD["sampling_params"], "sampling_seed": 1000 + i},
    }


def send_with(post, n_good: int, poison=None) -> tuple[list, tuple | None]:
    """Send ``n_good`` good requests and the poison at once; ``(good answers, (poison status, seconds))``."""

    def one(body):
        start = time.perf_counter()
        status, payload = post(body)
        return status, payload, time.perf_counter() - start

    bodies = [good_body(i) for i in range(n_good)]
    with ThreadPoolExecutor(n_good + 1) as pool:
        bad = pool.submit(one, poison) if poison is not None else None
        goods = list(pool.map(one, bodies))
    answers = [
        (
            status,
            json.dumps(payload.get("output_ids")),
            json.dumps(payload.get("meta_info", {}).get("output_token_sampling_logprobs")),
        )
        for status, payload, _ in goods
    ]
    return answers, (bad.result()[0], bad.result()[2]) if bad is not None else None
