"""``/score_support``: this engine as a distillation teacher (train/teacher.py's ``RemoteTeacher``). A sequence,
where its response starts, and at each response position the ids to score (a student's replayed support);
the answer: the model's full-vocabulary log-softmax (temperature 1) at those ids, and at each response token.
Scored on the engine's thread between two steps (engine/support_scoring.py)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from ..engine.support_scoring import check_support_request, score_support
from ..errors import RequestError


class ScoreSupportIn(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field we do not implement is refused by name

    input_ids: list[int] = Field(min_length=2, max_length=1 << 20)
    response_start: int
    support_ids: list[list[int]] = Field(min_length=1, max_length=1 << 20)


def teacher_routes(engine) -> APIRouter:
    routes = APIRouter()

    @routes.post("/score_support")
    async def score(body: ScoreSupportIn):
        if len(body.input_ids) > engine.limits.max_prompt_tokens:  # the model's context length at most
            raise RequestError(
                f"input_ids: {len(body.input_ids)} tokens exceed the limit of {engine.limits.max_prompt_tokens}"
            )
        check_support_request(body.input_ids, body.response_start, body.support_ids, engine.vocab_size)
        model, device = engine.runner.model, engine.runner.device
        job = engine.call_between_steps(
            lambda: score_support(model, body.input_ids, body.response_start, body.support_ids, device)
        )
        support, tokens = await asyncio.wrap_future(job)
        return {"support_logprobs": support, "token_logprobs": tokens, "weight_version": engine.weight_version}

    return routes
