"""The engine's fused decode step computes the module tree's bits (engine/fused_step.py)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from support_replay.engine import Engine
from support_replay.engine.fused_step import LOOP_PARTS, unsupported
from support_replay.engine.model_runner import ModelRunner
from support_replay.engine.weight_updates import load_state
from support_replay.errors import EngineError
from support_replay.modeling import decode_layer
from support_replay.modeling.batch_invariant import make_batch_invariant
from support_replay.modeling.decode_attention import compiled, use_decode_attention
from support_replay.modeling.linear_kernels import linear_function, onednn_available, use_linear
from tiny_model import build_tiny_checkpoint, greedy_decode

pytestmark = pytest.mark.float_bits  # bit for bit under every kernel set: CI reruns them under the other two

KERNELS = ["torch", "onednn"] if onednn_available() else ["torch"]


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), llama_tied=True)


def decode_both_ways(runner: ModelRunner, prompts, steps: int, reserve: list[int] | None = None):
    """Logits of ``steps`` greedy decode steps, fused and through the modules, from one prefill each."""
    out = {}
    for fused in (True, False):
        runner.use_fused = fused
        out[fused] = greedy_decode(runner, prompts, steps, reserve)
    runner.use_fused = True
    return out[True], out[False]


CASES = [  # (deterministic, attention, layers, kernel, products fused)
    *[
        (False, attention, layers, kernel, True)
        for attention in ("sdpa", "kernel")
        for layers in ("loop", "compiled", "pytorch")
        for kernel in KERNELS
    ],  # fmt: skip
    # the parts of the fused weights apart, as a CPU whose product changes a fused column's bits runs them
    *[(False, "kernel", layers, KERNELS[-1], False) for layers in ("loop", "compiled", "pytorch")],
    # the invariant arithmetic: its products, norms and SiLU are the module tree's own (no compiled layers)
    (True, "batch-invariant", "pytorch", "invariant", True),
]


@pytest.mark.parametrize(
    "deterministic, attention, layers, kernel, fused_products",
    CASES,
    ids=[f"{a}-{lay}-{k}" + ("" if f else "-apart") for _, a, lay, k, f in CASES],
)
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_fused_decode_is_the_module_tree_bit_for_bit(
    tiny_checkpoint, tied_llama, family, deterministic, attention, layers, kernel, fused_products, monkeypatch
):
    from support_replay.engine import fused_step

    path = tiny_checkpoint if family == "qwen3" else tied_llama
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if deterministic:
        make_batch_invariant(model)
    else:
        use_linear(model, linear_function(kernel))
        if attention == "kernel":
            built, why = compiled()
            assert built is not None, f"the decode-attention kernel did not build: {why}"
            assert use_decode_attention(model, "kernel") == "kernel"
    assert unsupported(model) is None
    if not fused_products:
        monkeypatch.setattr(fused_step, "fuse_products", lambda model: False)
    runner = ModelRunner(model)
    assert runner.fused is not None
    assert runner.fused.fused_products == (deterministic or fused_step.fuse_products(model))
    if layers != "pytorch":  # the layers' elementwise work in the compiled kernels (modeling/decode_layer.py)
        assert runner.fused.layer_kernels is not None, decode_layer.unsupported(model)
        # loop: a step's layers in one compiled call where the decode kernel attends every row in place
        runner.fused.layer_loop = runner.fused.layer_loop and layers == "loop"
    else:
        runner.fused.compiled_layers = False
    prompts = [
        [5 + i % 40 for i in range(61)],
        [11, 12],
        [20 + i % 30 for i in range(9)],
    ]  # left padding, block edge at 64
    # rows of unlike lengths attend in groups at their own widths: the batch-invariant attention keeps its
    # bits at any width; sdpa's change with it, so there the fused step also attends at the batch's width
    fused, tree = decode_both_ways(runner, prompts, 6)
    for t, (a, b) in enumerate(zip(fused, tree)):
        if attention != "sdpa":  # the decode kernel too keeps a row's bits at any width
            assert torch.equal(a, b), (t, (a - b).abs().max().item())
        else:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # rows reserved at once lie at one pitch and attend in place: the loop takes those steps where the decode kernel
    # attends (a reservation of 8 blocks holds the longest prompt and its steps)
    fused, tree = decode_both_ways(runner, prompts, 6, reserve=[8] * len(prompts))
    for t, (a, b) in enumerate(zip(fused, tree)):
        if attention != "sdpa":
            assert torch.equal(a, b), (t, (a - b).abs().max().item())
        else:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert (runner.fused._loop is not None) == (layers == "loop" and attention == "kernel")
    if attention != "batch-invariant":
        runner.fused.group_rows = False
        fused, tree = decode_both_ways(runner, prompts, 6)
        for t, (a, b) in enumerate(zip(fused, tree)):
            assert torch.equal(a, b), (t, (a - b).abs().max().item())


@pytest.mark.parametrize("layers", ["loop", "compiled"])
def test_a_groups_shared_prompt_is_read_from_one_row_with_the_same_bits(tiny_checkpoint, layers, monkeypatch):
    """Samples of one prompt prefilled once hold its keys and values each: the decode kernel reads them from the
    group's first row (``AttentionGroup.shared``); the logits are the module tree's and those of reading each row's
    own copy, bit for bit."""
    from support_replay.engine.paged_cache import PagedCache

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    assert use_decode_attention(model, "kernel") == "kernel"
    runner = ModelRunner(model)
    assert runner.fused.layer_kernels is not None, decode_layer.unsupported(model)
    runner.fused.layer_loop = layers == "loop"
    a, b = [5 + i % 40 for i in range(37)], [20 + i % 30 for i in range(21)]
    prompts, reserve = [a, a, b, a, b], [8] * 5
    seen = []
    real = PagedCache._shared
    monkeypatch.setattr(PagedCache, "_shared", lambda self, rows: seen.append(real(self, rows)) or seen[-1])
    fused, tree = decode_both_ways(runner, prompts, 6, reserve)
    assert seen and seen[0].tolist() == [[0, 0], [0, 37], [2, 0], [0, 37], [2, 21]]
    monkeypatch.setattr(PagedCache, "_shared", lambda self, rows: None)
    apart, _ = decode_both_ways(runner, prompts, 6, reserve)
    for t, (x, y, z) in enumerate(zip(fused, tree, apart)):
        assert torch.equal(x, y) and torch.equal(x, z), t
    assert (runner.fused._loop is not None) == (layers == "loop")


def fused_engine(path) -> Engine:
    """An engine on ``auto``'s kernel, which decodes with the fused step on every CPU."""
    engine = Engine.from_pretrained(path)
    assert engine.runner.fused is not None, unsupported(engine.runner.model)
    return engine


def test_a_weight_update_written_in_place_reaches_the_fused_step(tiny_checkpoint):
    engine = fused_engine(tiny_checkpoint)
    runner = engine.runner
    q = runner.model.model.layers[0].self_attn.q_proj.weight
    assert q.data_ptr() == runner.fused.layers[0].qkv.data_ptr()  # a view into the fused weight
    prompts = [[5, 6, 7, 8], [9, 10]]
    before, _ = decode_both_ways(runner, prompts, 2)
    state = {name: t.detach() * 1.5 for name, t in runner.model.state_dict().items() if "proj" in name}
    load_state(engine.runner.model, state)
    fused, tree = decode_both_ways(runner, prompts, 2)
    assert all(torch.equal(a, b) for a, b in zip(fused, tree))
    assert not torch.equal(fused[0], before[0])


def test_the_layer_loop_follows_updates_and_replaced_tensors_and_lets_its_packs_go(tiny_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    use_linear(model, linear_function(KERNELS[-1]))  # oneDNN where it runs: the loop holds packed weights
    assert use_decode_attention(model, "kernel") == "kernel"
    runner = ModelRunner(model)
    prompts, reserve = [[5, 6, 7, 8], [9, 10], [11] * 20], [4, 4, 4]

    def same_as_the_modules():
        fused, tree = decode_both_ways(runner, prompts, 3, reserve)
        assert all(torch.equal(a, b) for a, b in zip(fused, tree))
        return fused

    before = same_as_the_modules()
    table = runner.fused._loop
    assert table is not None
    load_state(model, {n: t.detach() * 1.5 for n, t in model.state_dict().items() if "proj" in n})  # in place
    assert not torch.equal(same_as_the_modules()[0], before[0])
    layer = model.model.layers[1]
    layer.post_attention_layernorm.weight = torch.nn.Parameter(layer.post_attention_layernorm.weight * 1.25)
    layer.self_attn.o_proj.weight = torch.nn.Parameter(layer.self_attn.o_proj.weight.detach().clone() * 0.5)
    same_as_the_modules()  # a new table holds the new tensors
    assert runner.fused._loop is not table
    runner.fused.drop_packs()  # a colocated trainer's update: the packs' memory goes back, the table with them
    assert runner.fused._loop is None
    same_as_the_modules()  # the next step packs again and makes a new table, though no weight changed since
    assert runner.fused._loop is not None and runner.fused.layers[0].packs


def test_the_layer_loop_times_its_parts_without_changing_its_bits(tiny_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    use_linear(model, linear_function(KERNELS[-1]))
    assert use_decode_attention(model, "kernel") == "kernel"
    runner = ModelRunner(model)
    prompts, reserve = [[5, 6, 7, 8], [9, 10], [11] * 20], [4, 4, 4]
    plain = greedy_decode(runner, prompts, 3, reserve)
    assert runner.fused._loop is not None and set(runner.fused.loop_seconds.values()) == {0.0}
    runner.fused.time_loop = True
    timed = greedy_decode(runner, prompts, 3, reserve)
    assert all(torch.equal(a, b) for a, b in zip(timed, plain))
    assert set(runner.fused.loop_seconds) == set(LOOP_PARTS)
    assert all(seconds > 0 for seconds in runner.fused.loop_seconds.values()), runner.fused.loop_seconds


@pytest.mark.parametrize("how", ["parameter", "data"])
@pytest.mark.parametrize("decoded_before", [False, True], ids=["first step", "after a step"])
def test_a_replaced_projection_weight_is_refused(tiny_checkpoint, how, decoded_before):
    engine = fused_engine(tiny_checkpoint)
    if decoded_before:  # the check found nothing to do once: it must look again
        batch, logits = engine.runner.prefill([[5, 6, 7]])
        engine.runner.decode(batch, logits.argmax(-1), torch.tensor([3]))
    proj = engine.runner.model.model.layers[1].mlp.up_proj
    if how == "parameter":
        proj.weight = torch.nn.Parameter(proj.weight.detach().clone())  # a new tensor: the fused weight would be stale
    else:
        proj.weight.data = proj.weight.detach().clone()  # the same tensor on other memory
    batch, logits = engine.runner.prefill([[5, 6, 7]])
    with pytest.raises(
        EngineError, match="fused decode: layer 1's projection weights were replaced, not written in place"
    ):
        engine.runner.decode(batch, logits.argmax(-1), torch.tensor([3]))


def test_a_weight_set_as_a_plain_tensor_is_followed(tiny_checkpoint):
    engine = fused_engine(tiny_checkpoint)
    runner = engine.runner
    decode_both_ways(runner, [[5, 6, 7]], 2)  # the checks have a state to compare with
    proj = runner.model.model.layers[0].mlp.down_proj
    weight = proj.weight.detach()
    del proj.weight
    proj.weight = weight * 0.5  # a plain attribute now, no longer a parameter: the checks look it up again
    fused, tree = decode_both_ways(runner, [[5, 6, 7]], 2)
    assert all(torch.equal(a, b) for a, b in zip(fused, tree))


def test_the_compiled_watch_sees_writes_moves_replacements_and_removals():
    """``SlotWatch`` (csrc/slot_watch.cpp), the per-step checks' comparison: a slot changed where a tensor there was
    written in place (a view's write too), moved to other memory, replaced, or removed; nothing else changes it."""
    from support_replay.kernels import build

    module, why = build.built()
    assert module is not None, f"the CPU kernels did not build: {why}"
    linear, norm = torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)
    slots = [(linear._parameters, "weight"), (linear._parameters, "bias"), (norm.__dict__, "eps")]
    watch = module.SlotWatch(slots)
    assert len(watch) == 3 and watch.changed()  # nothing marked yet
    assert watch.mark() and not watch.changed()
    _ = linear(torch.randn(2, 4)) + norm.weight.sum()  # reading changes nothing
    assert not watch.changed()
    changes = [
        lambda: linear.weight[0].add_(1),  # a write through a view: the base's version
        lambda: setattr(linear.weight, "data", torch.zeros(4, 4)),  # other memory
        lambda: setattr(linear, "bias", torch.nn.Parameter(torch.zeros(4))),  # another tensor
        lambda: setattr(norm, "eps", 1e-3),  # another object
    ]
    for change in changes:
        with torch.no_grad():
            change()
        assert watch.changed()
        assert watch.mark() and not watch.changed()
    del linear.bias
    assert watch.changed() and not watch.mark()  # a slot that holds nothing: the Python checks look again


def test_other_models_keep_the_module_tree(tiny_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    model.config.hidden_act = "gelu"
    assert unsupported(model) == "activation 'gelu'"
    runner = ModelRunner(model)
    assert runner.fused is None and not runner.use_fused
    batch, logits = runner.prefill([[5, 6, 7]])
    assert runner.decode(batch, logits.argmax(-1), torch.tensor([3])).shape == logits.shape


def test_what_a_fused_step_leaves_behind_is_an_ordinary_tensor(tiny_checkpoint):
    """The layers run in inference mode; the logits and the cache's tensors are made outside it, so
    sampling may write the logits in place and the module tree may decode the same cache afterwards."""
    engine = fused_engine(tiny_checkpoint)
    runner = engine.runner
    batch, logits = runner.prefill([[5, 6, 7, 8], [9, 10]])
    pos = torch.tensor([4, 2])
    for _ in range(2):
        logits = runner.decode(batch, logits.argmax(-1), pos)
        pos += 1
    assert not logits.is_inference()
    logits.add_(0.0)  # an inference tensor refuses this outside inference mode
    assert not batch.lengths.is_inference()
    assert all(not t.is_inference() for t in runner.pool.storage)
    runner.use_fused = False
    assert runner.decode(batch, logits.argmax(-1), pos).shape == logits.shape
    runner.use_fused = True
