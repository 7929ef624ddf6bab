"""A LoRA adapter loaded into the engine alone (SGLang's /load_lora_adapter): merged by the trainer's own merge, bit
for bit what the trainer would have sent merged; requests name it; unloading gives the base weights back."""

import json

import pytest
import torch
from safetensors.torch import save_file

from support_replay import SamplingParams
from support_replay.engine import Engine
from support_replay.errors import RequestError
from support_replay.modeling.lora import LoraSettings, adapter_state, add_lora, merged_state
from support_replay.protocol import GenerateRequest

pytest.importorskip("peft")
SETTINGS = LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules="all-linear")


def trained_adapter(checkpoint, directory):
    """A peft adapter on the tiny model with nonzero B (as after training), saved as the trainer saves it; and the
    merged weights the trainer computes from the same tensors."""
    from transformers import AutoModelForCausalLM

    model = add_lora(AutoModelForCausalLM.from_pretrained(checkpoint), SETTINGS)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    state = {k: v.detach() for k, v in model.state_dict().items()}
    directory.mkdir(parents=True, exist_ok=True)
    save_file(adapter_state(state), str(directory / "adapter_model.safetensors"))
    SETTINGS.peft_config().save_pretrained(str(directory))
    return merged_state(state, SETTINGS.scaling)


def request(lora_path=None, seed=3):
    params = SamplingParams(temperature=1.0, top_p=0.8, top_k=16, seed=seed)
    return GenerateRequest([5, 6, 7, 8], params, max_new_tokens=6, return_sampling_mask=True, lora_path=lora_path)


def run(engine, *futures):
    engine.wait(list(futures))
    return [f.result() for f in futures]


def test_the_adapter_alone_gives_the_trainers_merged_weights_and_unloading_the_base(tiny_checkpoint, tmp_path):
    merged = trained_adapter(tiny_checkpoint, tmp_path / "adapter")
    engine = Engine.from_pretrained(tiny_checkpoint)
    params = dict(engine.runner.model.named_parameters())
    base = {k: v.detach().clone() for k, v in params.items()}
    (before,) = run(engine, engine.submit(request()))
    run(engine, engine.load_lora_adapter("policy", tmp_path / "adapter"))
    adapted = [k for k in merged if not torch.equal(merged[k], base[k])]
    assert adapted and all(torch.equal(params[k], merged[k]) for k in merged)  # bit for bit
    assert engine.adapters.listing() == {"policy": str(tmp_path / "adapter")}
    # the same request on the merged weights the trainer would have sent gives the same bits
    reference = Engine.from_pretrained(tiny_checkpoint)
    run(reference, reference.update_weights(merged))
    (ours,) = run(engine, engine.submit(request("policy")))
    (theirs,) = run(reference, reference.submit(request()))
    assert ours.output_ids == theirs.output_ids and ours.log_mu.tobytes() == theirs.log_mu.tobytes()
    # requests must name what the weights are; the base is back, bit for bit, after unloading
    with pytest.raises(RequestError, match="lora_path: the engine runs adapter 'policy' merged"):
        engine.submit(request()).result()
    with pytest.raises(RequestError, match="lora_path: 'other' is not loaded"):
        engine.submit(request("other")).result()
    run(engine, engine.unload_lora_adapter("policy"))
    assert all(torch.equal(params[k], base[k]) for k in base)
    (after,) = run(engine, engine.submit(request()))
    assert after.output_ids == before.output_ids and after.log_mu.tobytes() == before.log_mu.tobytes()
    with pytest.raises(RequestError, match="lora_path: 'policy' is not loaded"):
        engine.submit(request("policy")).result()


def test_loads_that_cannot_hold_are_refused_before_anything_changes(tiny_checkpoint, tmp_path):
    trained_adapter(tiny_checkpoint, tmp_path / "adapter")
    engine = Engine.from_pretrained(tiny_checkpoint)
    with pytest.raises(RequestError, match="is not a peft adapter directory"):
        engine.load_lora_adapter("policy", tmp_path)
    with pytest.raises(RequestError, match="no adapter 'policy' is loaded"):
        engine.unload_lora_adapter("policy")
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (wrong / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    (wrong / "adapter_model.safetensors").write_bytes((tmp_path / "adapter" / "adapter_model.safetensors").read_bytes())
    with pytest.raises(RequestError, match="do not fit the weight"):
        engine.load_lora_adapter("policy", wrong)
    assert engine.adapters.queued is None
    run(engine, engine.load_lora_adapter("policy", tmp_path / "adapter"))
    with pytest.raises(RequestError, match="failed to load LoRA adapter 'policy' because it is already loaded"):
        engine.load_lora_adapter("policy", tmp_path / "adapter")
    with pytest.raises(RequestError, match="serves one adapter, merged into its weights, and 'policy' is loaded"):
        engine.load_lora_adapter("second", tmp_path / "adapter")
    with pytest.raises(RequestError, match="unload it before loading other weights"):
        engine.update_weights({})
