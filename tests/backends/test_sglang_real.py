"""The real SGLang 0.5.23 server (``make sglang``: its PyPI wheel on this machine's CPU torch), as a user starts
it: its own HTTP server, scheduler, ``Qwen3ForCausalLM``, torch-native attention and PyTorch sampler."""

import httpx
import pytest

pytestmark = pytest.mark.slow

MASKED = {"temperature": 1.0, "top_k": 8, "top_p": 0.9, "max_new_tokens": 8, "ignore_eos": True}


def test_the_server_answers_with_its_sampling_masks(sglang_server):
    """SGLang's own ``meta_info``: one support per output token holding the sampled id, and its log mu."""
    url, _ = sglang_server
    body = {"input_ids": [1, 2, 3, 4], "return_sampling_mask": True, "sampling_params": MASKED}
    answer = httpx.post(url + "/generate", json=body, timeout=120).json()
    meta = answer["meta_info"]
    masks, logprobs = meta["output_token_sampling_mask"], meta["output_token_sampling_logprobs"]
    assert len(answer["output_ids"]) == len(masks) == len(logprobs) == 8
    assert meta["output_token_sampling_mask_length"] == 8
    for token, mask, logprob in zip(answer["output_ids"], masks, logprobs):
        assert token in mask and 1 <= len(mask) <= 8 and logprob <= 0.0


def test_a_mask_without_a_finite_top_k_is_refused_by_sglangs_own_rule(sglang_server):
    """SGLang admits ``return_sampling_mask`` only with greedy or a finite top_k (up to 4,096): top-p alone is
    refused, in a 200 whose body is an error object."""
    url, _ = sglang_server
    body = {"input_ids": [1, 2, 3], "return_sampling_mask": True, "sampling_params": {**MASKED, "top_k": -1}}
    answer = httpx.post(url + "/generate", json=body, timeout=120).json()
    assert "return_sampling_mask requires top_k" in answer["error"]["message"]


@pytest.mark.float_bits  # log(1) is 0 exactly: a singleton support
def test_greedy_supports_are_singletons_with_log_mu_zero(sglang_server):
    url, _ = sglang_server
    body = {"input_ids": [5, 6, 7], "return_sampling_mask": True, "sampling_params": {**MASKED, "temperature": 0.0}}
    meta = httpx.post(url + "/generate", json=body, timeout=120).json()["meta_info"]
    assert all(len(mask) == 1 for mask in meta["output_token_sampling_mask"])
    assert all(logprob == 0.0 for logprob in meta["output_token_sampling_logprobs"])


# What SGLang 0.5.23 cannot do on a CPU, run for real: each start stops for SGLang's own reason. Where a later
# wheel starts, the test fails and says the stand-in (tests/engines/, our serve) can hand that part over.
CANNOT = {
    "routed experts": ("tiny_moe_checkpoint", ["--enable-return-routed-experts"]),
    "lora": (
        "tiny_checkpoint",
        ["--enable-lora", "--lora-backend", "torch_native", "--max-lora-rank", "8", "--lora-target-modules", "all"],
    ),
}


@pytest.fixture(scope="module")
def failed_starts(request) -> dict[str, str]:
    """The output of each ``CANNOT`` start of SGLang's server on its CPU path, started side by side (about 17 s
    each), each of which must stop by itself."""
    import os
    import subprocess

    from processes import free_port
    from sglang_env import SGLANG_ENV, sglang_missing, sglang_server_args

    if (why := sglang_missing()) is not None:
        pytest.skip(why)
    env = {**os.environ, **SGLANG_ENV}
    starts = {}
    for name, (checkpoint, extra) in CANNOT.items():
        args = sglang_server_args(request.getfixturevalue(checkpoint), free_port(), *extra)
        starts[name] = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    outputs = {}
    for name, start in starts.items():
        out, _ = start.communicate(timeout=300)
        assert start.returncode != 0, f"SGLang started with {name}: the stand-in's role can end (docs/engines.md)"
        outputs[name] = out
    return outputs


def test_sglang_cannot_capture_routed_experts_on_a_cpu(failed_starts):
    """``--enable-return-routed-experts``: its capturer's host cache is pinned memory registered with CUDA
    (``state_capturer/base.py`` -> ``mem_cache/pool_host/common.py``, ``alloc_with_host_register``)."""
    out = failed_starts["routed experts"]
    assert "Torch not compiled with CUDA enabled" in out and "alloc_with_host_register" in out


def test_sglang_cannot_serve_lora_adapters_on_a_cpu(failed_starts):
    """``--enable-lora`` with its torch-native backend: every LoRA layer and the backend allocate with
    ``pin_memory=True`` (``lora/layers.py``, ``lora/backend/torch_backend.py``), which needs an accelerator."""
    assert "pin_memory=True requires a CUDA or other accelerator backend" in failed_starts["lora"]


class FirstToken:
    """``body`` streamed from SGLang's ``/generate`` on a thread: ``first`` is set once its first token has come (the
    request is running, prefilled and decoding), ``last`` is the final chunk (the whole answer) once it has ended.
    The tests then hold the request with SGLang's own ``/pause_generation`` before they act: the engine decodes
    freely only from the first token's arrival to the pause (a thread's wake-up and one round trip), against the 500
    tokens each request asks for (48 once ran out under load). Not a gate inside the engine: SGLang's step is not
    held (a custom logit processor that waits would be one; not built)."""

    def __init__(self, url: str, body: dict):
        import json
        import threading

        self.first, self.ended, self.last = threading.Event(), threading.Event(), None

        def stream():
            try:
                with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=300) as reply:
                    for line in reply.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            self.last = json.loads(line[len("data: ") :])
                            if self.last.get("output_ids"):
                                self.first.set()
            finally:
                self.first.set()
                self.ended.set()

        self.thread = threading.Thread(target=stream, daemon=True)
        self.thread.start()
        assert self.first.wait(120) and not self.ended.is_set(), "the request ended before its first token came"

    def answer(self) -> dict:
        assert self.ended.wait(120) and self.last is not None
        return self.last


def pause(url: str, mode: str) -> None:
    assert httpx.post(url + "/pause_generation", json={"mode": mode}, timeout=60).status_code == 200


def carry_on(url: str) -> None:
    assert httpx.post(url + "/continue_generation", json={}, timeout=60).status_code == 200


def test_a_stopped_request_answers_with_its_tokens_and_their_supports(sglang_server):
    """SGLang's ``/abort_request {"rid"}`` on a running request (partial rollouts stop the slowest so): its
    ``/generate`` answers with the tokens so far, finish reason ``abort``, a support and log mu for each, which the
    backend keeps with ``partial``. Held in place after its first token, so the stop finds it running."""
    from support_replay import SamplingParams
    from support_replay.backends.sglang import SGLangBackend
    from support_replay.protocol import GenerateRequest, validate_completion

    url, _ = sglang_server
    backend = SGLangBackend(url, 384)
    params = SamplingParams(temperature=1.0, top_k=8)
    req = GenerateRequest([1, 2, 3, 4], params, 500, ignore_eos=True, return_sampling_mask=True, rid="stop-me")
    running = FirstToken(url, backend.body(req))
    pause(url, "in_place")
    try:
        backend.stop([req])
    finally:
        carry_on(url)
    item = running.answer()
    assert item["meta_info"]["finish_reason"]["type"] == "abort"
    completion = validate_completion(backend.completion(item, req), req, 384)
    assert 0 < completion.num_tokens < 500 and len(completion.log_mu) == completion.num_tokens
    assert all(token in row for token, row in zip(completion.output_ids, completion.support.to_lists()))


def test_a_push_under_a_retract_pause_continues_the_running_request_under_the_new_version(sglang_server):
    """SGLang's own ``/pause_generation {"mode": "retract"}``, ``/update_weights_from_disk`` while paused and
    ``/continue_generation`` (what ``--weight-sync-mode retract`` sends): the running request goes on, and its answer
    carries two version spans with a support and log mu for every token. The pause comes after its first token."""
    url, checkpoint = sglang_server
    body = {
        "input_ids": [1, 2, 3, 4],
        "return_sampling_mask": True,
        "sampling_params": {**MASKED, "max_new_tokens": 500},
    }
    running = FirstToken(url, body)
    try:
        pause(url, "retract")
        load = {"model_path": str(checkpoint), "weight_version": "paused-push"}
        assert httpx.post(url + "/update_weights_from_disk", json=load, timeout=120).json()["success"]
        carry_on(url)
        meta = running.answer()["meta_info"]
    finally:
        back = {"model_path": str(checkpoint), "weight_version": "default"}
        httpx.post(url + "/update_weights_from_disk", json=back, timeout=120)
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["default", "paused-push"] and spans[-1]["end"] == 500
    assert len(meta["output_token_sampling_mask"]) == len(meta["output_token_sampling_logprobs"]) == 500


def perturbed(checkpoint, path, scale: float = 0.5):
    """The checkpoint with its first layer's projections moved by ``scale`` of each weight's spread (seeded): every
    later position's keys and values change under it."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, path)
    weights = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name, value in weights.items():
        if ".layers.0." in name and name.endswith("proj.weight"):
            weights[name] = value + scale * value.std() * torch.randn(value.shape, generator=gen)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def stale_prefix_logprobs(old_path, new_path, prompt, output, start) -> list[float]:
    """What stale keys and values would give: ``output[start:]`` under the new weights read over the prefix's keys
    and values from the old ones (transformers, float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    old, new = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in (old_path, new_path))
    ids = torch.tensor([prompt + output])
    cut = len(prompt) + start - 1  # the prefix whose keys and values were computed before the push
    with torch.no_grad():
        cache = old(ids[:, :cut], use_cache=True).past_key_values
        logits = new(ids[:, cut:], past_key_values=cache, use_cache=True).logits[0]
    logp = torch.log_softmax(logits, -1)
    return [float(logp[i, t]) for i, t in enumerate(output[start:])]


def test_a_retract_push_of_other_weights_continues_on_the_new_weights_keys_and_values(sglang_server, tmp_path):
    """``--weight-sync-mode retract`` on SGLang: pause(retract), ``/update_weights_from_disk`` of *other* weights,
    continue. The running request's later tokens must be the new weights' own, not computed over keys and values the
    old weights left (SGLang flushes its radix cache only when idle): each one's log-prob within 1e-3 of a fresh
    prefill of the same prefix under the new weights (after ``/flush_cache``), where stale keys and values would
    move some by more than 0.1 (worked out with transformers over the old prefix)."""
    url, checkpoint = sglang_server
    other = perturbed(checkpoint, tmp_path / "other")
    prompt = [1, 2, 3, 4]
    body = {
        "input_ids": prompt,
        "return_logprob": True,
        "sampling_params": {**MASKED, "max_new_tokens": 500},  # as the other pause tests: 48 ended before the pause
    }
    try:
        running = FirstToken(url, body)
        pause(url, "retract")
        load = {"model_path": str(other), "weight_version": "other"}
        assert httpx.post(url + "/update_weights_from_disk", json=load, timeout=120).json()["success"]
        carry_on(url)
        item = running.answer()
        assert httpx.post(url + "/flush_cache", timeout=60).status_code == 200
        output = item["output_ids"]
        fresh = {
            "input_ids": prompt + output,
            "return_logprob": True,
            "logprob_start_len": len(prompt) - 1,
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
        }
        scored = httpx.post(url + "/generate", json=fresh, timeout=120).json()["meta_info"]["input_token_logprobs"][1:]
    finally:
        back = {"model_path": str(checkpoint), "weight_version": "default"}
        httpx.post(url + "/update_weights_from_disk", json=back, timeout=120)
        httpx.post(url + "/flush_cache", timeout=60)
    spans = item["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans] == ["default", "other"], spans
    start = spans[1]["start"]
    continued = [lp for lp, *_ in item["meta_info"]["output_token_logprobs"][start:]]
    new = [lp for lp, *_ in scored[start:]]
    assert len(continued) == len(new) == len(output) - start > 0
    assert max(abs(a - b) for a, b in zip(continued, new)) <= 1e-3
    stale = stale_prefix_logprobs(checkpoint, other, prompt, output, start)
    assert max(abs(a - b) for a, b in zip(stale, new)) > 0.1  # the check could tell stale keys and values
