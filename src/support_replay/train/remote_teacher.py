"""A distillation teacher over HTTP: ``support-replay serve`` (its ``/score_support``: each position's own ids)
or SGLang's own server (``/generate`` with ``max_new_tokens`` 0, ``return_logprob``, ``logprob_start_len`` and
``token_ids_logprob``, read in SGLang 0.5.23's ``io_struct.GenerateReqInput`` and seen answering here: one id
list per request, applied at every position, so the union of the sample's support ids is sent and each
position's own ids are read out of it). Checked at start-up against the student's vocabulary and tokenizer;
an answer that misses an id fails the sample by name. ``take_stats`` reports the ids sent against the ids needed
and the seconds spent."""

from __future__ import annotations

import time

import httpx
import torch
from transformers import AutoConfig, AutoTokenizer

from ..errors import ConfigError, SampleError
from ..modeling.tokenizer_identity import tokenizer_fingerprint
from ..serving.security import Keys
from .batches import MicroBatch
from .teacher import check_head

# every sampling field SGLang would otherwise fill from the model's generation_config.json, given neutral: the
# teacher's distribution, not one its config's top-p or penalties renormalised (0.5.23's SamplingParams fields)
NEUTRAL = {
    "max_new_tokens": 0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
}
TEACHER_TIMEOUT = 600.0  # seconds for one sample's scoring (a long sequence on a busy engine)


class RemoteTeacher:
    def __init__(self, url: str, student_path, student_vocab: int, transport: httpx.BaseTransport | None = None):
        self.url = url.rstrip("/")
        headers = Keys.load().header(admin=False)
        self.client = httpx.Client(timeout=TEACHER_TIMEOUT, headers=headers, transport=transport)
        try:
            info = self.client.get(self.url + "/model_info").raise_for_status().json()
        except (httpx.HTTPError, ValueError) as exc:
            raise ConfigError(f"--opd-teacher-url={url!r}: /model_info did not answer: {exc}") from exc
        if "tokenizer_fingerprint" not in info and "tokenizer_path" not in info:
            raise ConfigError(
                f"--opd-teacher-url={url!r}: its /model_info is neither support-replay serve's nor SGLang's, so it "
                "cannot be asked for the log-probs of each token's support ids (vLLM's prompt log-probs give the "
                "sampled token's alone: not built)"
            )
        self.sglang = "tokenizer_fingerprint" not in info  # else our serve
        vocab, fingerprint = (
            self._identity(info) if self.sglang else (info.get("vocab_size"), info.get("tokenizer_fingerprint"))
        )
        check_head(f"--opd-teacher-url={url!r}", vocab, student_vocab)
        mine = tokenizer_fingerprint(AutoTokenizer.from_pretrained(student_path))
        if fingerprint != mine:
            raise ConfigError(
                f"--opd-teacher-url={url!r}: its tokenizer (token map and chat template) is not the student's "
                f"(fingerprint {str(fingerprint)[:12]}, the student's {mine[:12]})"
            )
        self.sent = self.needed = 0
        self.seconds = 0.0

    def _identity(self, info: dict) -> tuple[int | None, str]:
        """SGLang's /model_info names its model's and tokenizer's paths: read them to check."""
        try:
            vocab = AutoConfig.from_pretrained(info["model_path"]).vocab_size
            fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(info["tokenizer_path"]))
        except Exception as exc:
            raise ConfigError(
                f"--opd-teacher-url={self.url!r}: SGLang serves {info.get('model_path')!r}; its config and tokenizer "
                f"could not be read here to check them against the student's ({type(exc).__name__}: {exc})"
            ) from exc
        return vocab, fingerprint

    def score(self, batch: MicroBatch, samples) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        return {i: self.score_sample(samples[i]) for i in batch.indices}

    def take_stats(self) -> dict:
        """``opd_teacher_ids_sent`` over ``opd_teacher_ids_needed`` (SGLang: the union at every position) and
        ``opd_teacher_seconds`` since the last call."""
        out = {
            "opd_teacher_ids_sent": self.sent,
            "opd_teacher_ids_needed": self.needed,
            "opd_teacher_seconds": self.seconds,
        }
        self.sent = self.needed = 0
        self.seconds = 0.0
        return out

    def score_sample(self, sample) -> tuple[torch.Tensor, torch.Tensor]:
        rows = sample.support.to_lists()
        ids = list(sample.prompt_ids) + list(sample.response_ids)
        start = len(sample.prompt_ids)
        t0 = time.perf_counter()
        if self.sglang:
            union = sorted({i for r in rows for i in r})
            body = {
                "input_ids": ids,
                "sampling_params": NEUTRAL,
                "return_logprob": True,
                "logprob_start_len": start - 1,
                "token_ids_logprob": union,
            }
            support, tokens = self._sglang_values(sample, self._post(sample, "/generate", body), rows, ids[start:])
            self.sent += len(union) * len(rows)
        else:
            body = {"input_ids": ids, "response_start": start, "support_ids": rows}
            out = self._post(sample, "/score_support", body)
            support, tokens = out.get("support_logprobs"), out.get("token_logprobs")
            self.sent += sum(len(r) for r in rows)
        self.seconds += time.perf_counter() - t0
        self.needed += sum(len(r) for r in rows)
        covered = (
            isinstance(support, list)
            and isinstance(tokens, list)
            and len(support) == len(rows) == len(tokens)
            and all(isinstance(a, list) and len(a) == len(r) for a, r in zip(support, rows))
        )
        if not covered:
            raise SampleError(
                f"sample {sample.index}: the teacher's answer does not cover every support id of every position"
            )
        flat = [v for a in support for v in a]
        return torch.tensor(flat, dtype=torch.float32), torch.tensor(tokens, dtype=torch.float32)

    def _post(self, sample, path: str, body: dict) -> dict:
        try:
            reply = self.client.post(self.url + path, json=body)
        except httpx.HTTPError as exc:
            raise SampleError(f"sample {sample.index}: the teacher at {self.url} did not answer: {exc}") from exc
        if reply.status_code != 200:
            raise SampleError(
                f"sample {sample.index}: the teacher at {self.url}{path} answered HTTP {reply.status_code}: "
                f"{reply.text[:300]}"
            )
        return reply.json()

    @staticmethod
    def _sglang_values(sample, out: dict, rows: list[list[int]], response: list[int]):
        """SGLang's ``input_token_ids_logprobs``: from ``logprob_start_len``, one entry per position (the first
        None), each ``[logprob, id, text]`` for every id sent, the distribution of the token at that position;
        ``input_token_logprobs`` the same for the input token itself."""
        meta = out.get("meta_info", {})
        per_position = (meta.get("input_token_ids_logprobs") or [None])[1:]
        own = (meta.get("input_token_logprobs") or [None])[1:]
        if len(per_position) != len(rows) or len(own) != len(rows):
            raise SampleError(
                f"sample {sample.index}: SGLang answered {len(per_position)} positions of id log-probs for "
                f"{len(rows)} response tokens"
            )
        support = []
        for p, (entry, wanted) in enumerate(zip(per_position, rows)):
            values = {int(i): v for v, i, *_ in entry or []}
            missing = [i for i in wanted if values.get(i) is None]
            if missing:
                raise SampleError(
                    f"sample {sample.index}, response position {p}: SGLang's answer has no log-prob for support "
                    f"ids {missing[:5]}"
                )
            support.append([values[i] for i in wanted])
        tokens = []
        for p, (entry, token) in enumerate(zip(own, response)):
            if not entry or int(entry[1]) != token or entry[0] is None:
                raise SampleError(f"sample {sample.index}, response position {p}: SGLang scored {entry}, not {token}")
            tokens.append(entry[0])
        return support, tokens
