"""A stand-in for an SGLang 0.5.23 server: a Hugging Face model for the logits, and SGLang's own
sampler, capture and payload code (``sglang_code``) for everything the client sees.

``SGLangPipeline`` turns per-step logits into sampled tokens and, at the end, the ``/generate``
result object, through the wheel's functions in the order SGLang calls them: temperature and
softmax (``Sampler.forward``: ``logits.div_(temperatures)``, then softmax), the torch sampler,
``_build_sampling_mask_output``, ``materialize_sampling_mask_output``,
``SamplingMaskRows.append``/``take``, the ``meta_info`` block of ``_handle_batch_output``, and
``add_weight_versions_to_meta_info``. The scheduler's own glue (request state, finish
reasons) is written here from the same files; it decides nothing about the support.

``create_app`` serves it as ``/generate``, ``/model_info``, ``/health``,
``/update_weights_from_disk`` and ``/update_weight_version``, one request at a time.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse
from sglang_code import SGLangCode

TOP_K_ALL = 1 << 30  # sglang/srt/sampling/sampling_params.py: top_k == -1 means the whole vocabulary


class GenerateReqInput:
    """What ``isinstance(state.obj, GenerateReqInput)`` in the meta_info block checks for."""

    def __init__(self, return_sampling_mask: bool, sampling_logprobs_mode: str | None):
        self.return_sampling_mask = return_sampling_mask
        self.sampling_logprobs_mode = sampling_logprobs_mode


@dataclass
class Request:
    """The attributes SGLang's code reads off a ``Req`` (scheduler) and a ``ReqState`` (tokenizer manager)."""

    input_ids: list[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    max_new_tokens: int
    return_sampling_mask: bool
    sampling_logprobs_mode: str | None
    sampling_mask_rows: object
    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict | None = None
    # what the sampler itself produced per token, before any host or payload code: (support ids, log mu)
    sampled: list[tuple[list[int], float]] = field(default_factory=list)


class SGLangPipeline:
    def __init__(self, code: SGLangCode, sampling_mask_max_tokens: int = 4096, weight_version: str = "default"):
        self.code = code
        self.capacity = sampling_mask_max_tokens
        self.weight_version = weight_version

    def request(
        self, input_ids, params: dict, return_sampling_mask: bool, sampling_logprobs_mode: str | None
    ) -> Request:
        temperature = float(params.get("temperature", 1.0))
        top_k = int(params.get("top_k", -1))
        if temperature < 1e-6:  # sampling_params.py: greedy is top_k 1 at temperature 1
            temperature, top_k = 1.0, 1
        return Request(
            list(input_ids),
            temperature,
            TOP_K_ALL if top_k == -1 else top_k,
            float(params.get("top_p", 1.0)),
            float(params.get("min_p", 0.0)),
            int(params.get("max_new_tokens", 128)),
            return_sampling_mask,
            sampling_logprobs_mode,
            self.code.sampling_mask.SamplingMaskRows(),
        )

    def step(self, reqs: list[Request], logits: torch.Tensor, generator_seed: int) -> list[int]:
        """Sample one token for every request from its row of ``logits``; capture as SGLang does."""
        ns = self.code.namespace
        rows, vocab = logits.shape
        logits = logits.float().clone()
        logits.div_(torch.tensor([[r.temperature] for r in reqs]))
        probs = torch.softmax(logits, dim=-1)
        top_ks = torch.tensor([min(r.top_k, vocab) for r in reqs], dtype=torch.int32)
        top_ps = torch.tensor([r.top_p for r in reqs], dtype=torch.float32)
        min_ps = torch.tensor([r.min_p for r in reqs], dtype=torch.float32)
        torch.manual_seed(generator_seed)  # the unseeded torch path draws with torch.multinomial
        ids, weights, token_ids, selected = self.code.sample_from_probs(
            probs, top_ks, top_ps, min_ps, bool((min_ps > 0).any()), None, None, return_filtered_probs=True
        )
        capture_rows = torch.tensor([i for i, r in enumerate(reqs) if r.return_sampling_mask], dtype=torch.long)
        if len(capture_rows):
            select = lambda t: t if len(capture_rows) == rows else t.index_select(0, capture_rows)  # noqa: E731
            capture = ns["_SamplingMaskCapture"](
                weights=select(weights),
                token_ids=select(token_ids),
                selected_weight=select(selected),
                batch_rows=capture_rows,
            )
            support_rows = [i for i in capture_rows.tolist() if reqs[i].sampling_logprobs_mode == "support"]
            sampler = SimpleNamespace(sampling_mask_max_tokens=self.capacity, tp_sync_group=None, cp_sync_group=None)
            output = SimpleNamespace(
                sampling_mask_output=self.code.build_sampling_mask_output(
                    sampler,
                    ids,
                    capture,
                    torch.tensor([capture_rows.tolist().index(i) for i in support_rows]) if support_rows else None,
                )
            )
            device = output.sampling_mask_output
            for row, i in enumerate(capture_rows.tolist()):
                n = int(device.lengths[row])
                reqs[i].sampled.append(
                    (sorted(device.token_ids[row, :n].tolist()), float(device.selected_logprobs[row]))
                )
            self.code.materialize(reqs, output)
            for i, req in enumerate(reqs):
                if not req.return_sampling_mask:
                    continue
                status = output.next_token_sampling_mask_status[i]
                if status != ns["SamplingMaskStatus"].OK:  # get_sampling_mask_finish_reason: the request aborts
                    req.finish_reason = {"type": "abort", "status": int(status)}
                    continue
                req.sampling_mask_rows.append(
                    output.next_token_sampling_mask_idx[i], output.next_token_sampling_logprobs[i]
                )
        out = ids.tolist()
        for req, token in zip(reqs, out):
            if req.finish_reason is None:
                req.output_ids.append(int(token))
                if len(req.output_ids) >= req.max_new_tokens:
                    req.finish_reason = {"type": "length", "length": len(req.output_ids)}  # FINISH_LENGTH.to_json
        return out

    def result(self, req: Request, text: str = "") -> dict:
        """The ``/generate`` result object of a finished request, assembled by SGLang's code."""
        n = len(req.output_ids)
        meta_info = {  # tokenizer_manager.py, _handle_batch_output
            "id": "standin",
            "finish_reason": req.finish_reason,
            "prompt_tokens": len(req.input_ids),
            "weight_version": self.weight_version,
            "num_retractions": 0,
        }
        if req.return_sampling_mask:
            state = SimpleNamespace(
                obj=GenerateReqInput(True, req.sampling_logprobs_mode),
                output_token_sampling_mask=[],
                output_token_sampling_logprobs=[],
            )
            recv_obj = SimpleNamespace(output_token_sampling_mask=[req.sampling_mask_rows.take()])
            exec(
                self.code.meta_info_block,
                {
                    "state": state,
                    "recv_obj": recv_obj,
                    "i": 0,
                    "meta_info": meta_info,
                    "GenerateReqInput": GenerateReqInput,
                },
            )
        meta_info.update({"reasoning_tokens": 0, "completion_tokens": n, "cached_tokens": 0})
        wv = self.code.weight_versions
        spans = wv.compute_weight_version_spans([], self.weight_version, n)
        wv.add_weight_versions_to_meta_info(meta_info, spans, num_output_tokens=n)
        return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta_info}


def create_app(code: SGLangCode, model, tokenizer, *, sampling_mask_max_tokens: int = 4096):
    """A FastAPI app answering as an SGLang 0.5.23 server would, one request at a time."""
    from safetensors.torch import load_file

    pipeline = SGLangPipeline(code, sampling_mask_max_tokens)
    app = FastAPI()
    lock = asyncio.Lock()
    vocab = model.get_output_embeddings().weight.shape[0]

    def run(body: dict) -> dict:
        params = body.get("sampling_params") or {}
        for name, neutral in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0)):
            if params.get(name, neutral) != neutral:
                raise ValueError(f"the stand-in applies no {name}")
        req = pipeline.request(
            body["input_ids"], params, bool(body.get("return_sampling_mask")), body.get("sampling_logprobs_mode")
        )
        if (
            req.return_sampling_mask and req.top_k != 1 and not 1 < req.top_k <= sampling_mask_max_tokens
        ):  # scheduler.py admission
            return JSONResponse(
                {
                    "error": {
                        "message": f"return_sampling_mask requires top_k=1 or 1 < top_k <= {sampling_mask_max_tokens}"
                    }
                },
                status_code=400,
            )
        seed = int(params.get("sampling_seed", params.get("seed", 0)) or 0)
        with torch.no_grad():
            while req.finish_reason is None:
                logits = model(torch.tensor([req.input_ids + req.output_ids])).logits[:, -1, :]
                pipeline.step([req], logits, seed * 100_003 + len(req.output_ids))
        if req.finish_reason.get("type") == "abort":
            return JSONResponse(
                {"error": {"message": "Sampling support exceeds --sampling-mask-max-tokens"}}, status_code=400
            )
        return pipeline.result(req, tokenizer.decode(req.output_ids))

    @app.get("/health")
    async def health():
        return {}

    @app.get("/model_info")
    async def model_info():
        return {
            "model_path": "standin",
            "is_generation": True,
            "weight_version": pipeline.weight_version,
            "vocab_size": vocab,
        }

    @app.post("/generate")
    async def generate(request: HTTPRequest):
        body = await request.json()
        async with lock:
            return await asyncio.to_thread(run, body)

    @app.post("/update_weights_from_disk")
    async def update_weights(request: HTTPRequest):
        body = await request.json()
        async with lock:
            state = {}
            for f in sorted(Path(body["model_path"]).glob("*.safetensors")):
                state.update(load_file(str(f)))
            model.load_state_dict(state, strict=False)
            if body.get("weight_version") is not None:
                pipeline.weight_version = body["weight_version"]
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    @app.post("/update_weight_version")
    async def update_weight_version(request: HTTPRequest):
        body = await request.json()
        pipeline.weight_version = body["new_version"]
        return {
            "success": True,
            "message": f"Weight version updated to {body['new_version']}",
            "new_version": body["new_version"],
        }

    return app


def main() -> None:
    import argparse
    import sys

    import sglang_code
    import uvicorn
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(
        description="an SGLang 0.5.23 stand-in: our model's logits, SGLang's sampler and payload code"
    )
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    try:
        code = sglang_code.load()
    except sglang_code.Unavailable as exc:
        print(f"SGLang's code is not available: {exc}", file=sys.stderr)
        raise SystemExit(3) from exc
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    uvicorn.run(create_app(code, model, tokenizer), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
