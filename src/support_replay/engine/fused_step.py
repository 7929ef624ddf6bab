"""The engine's decode step as one function over the paged cache, outside Hugging Face's module tree.

Hugging Face's forward pays, at every decode step, module calls, keyword plumbing and mask
building that a step of one token per row does not need. This step runs the same operations
as the Hugging Face forward of a Llama or Qwen3 model, in the same order and with
the same functions where the model has them (its RMSNorm and rotary code, its attention
function: sdpa, the engine's CPU decode kernel (modeling/decode_attention.py), or the
batch-invariant arithmetic in true-on-policy mode), so its logits are the
same bits (tests/engine/test_fused_step.py; rows of unlike lengths attend in groups at their own
widths, engine/paged_cache.py, which keeps the bits of the batch-invariant attention and changes
sdpa's within float rounding: with ``group_rows`` off, every row attends at the batch's width as
the module tree does, bit for bit). What it changes: the query, key and value projections
are one product over one weight, and so are the gate and up projections, where that keeps each
projection's bits (``fuse_products``): by construction for the invariant product of true-on-policy mode, whose
every column is its own dot; for a vendor's product (MKL, oneDNN) only where a check of its fused columns
against its separate products at this shape and thread count finds them equal (``fused_columns_keep_bits``);
elsewhere the step runs the three and the two products apart, the module tree's products, and stays
available. The separate projections' weights become views into the fused ones, so a weight update written
into the model's parameters reaches the step without a copy. Measured: 5-6% more tokens/s
on SmolLM2 (docs/benchmarks.md).

On a CPU, on oneDNN's fp32 product and in bf16, the step also runs over packed copies of its
weights (modeling/packed_weights.py: the reorder oneDNN would otherwise do at every call, done
once), for each weight whose packed product is probed to keep the model's own product's bits,
at the row counts where it does (fp32: 2 rows or more; one row takes another kernel packed and
keeps the plain weight). SmolLM2's decode step at batch 16: 55 ms instead of 76
(docs/benchmarks.md), for one more copy of the decode weights in memory. A pack is made again
when its parameter's version counter says it was written in place (``copy_``,
``load_state_dict``, the engine's weight update), when its module holds another tensor (a replaced
``o_proj`` or ``down_proj`` weight, or the head's) and when the thread count changes; a write
through ``.data`` bypasses the counter and is not seen. ``drop_packs`` frees them until the
next step (``Engine.release_packed_weights``: a colocated trainer's update).

In float32 the layers' elementwise work (the norms, the rotary embedding with the keys' and values' cache
writes, SiLU x up, the residual adds) runs in four compiled calls a layer instead of ~35 PyTorch operations,
rounded as those operations round (modeling/decode_layer.py, checked bit for bit against the models' own
functions at start-up): the same bits, 11-12 instead of 19 ms of an 85 ms step on a Zen 3 EPYC at batch 16
(docs/benchmarks.md). ``compiled_layers`` off keeps PyTorch's operations (benchmarks).

Where the decode kernel attends every row of a step in place in the cache (the rows reserved at one pitch, the
common case of a rollout) and the products are the model's own (``F.linear`` or oneDNN's, packed or not), a float32
step's layers run in one compiled call (``DecodeLayers``, kernels/csrc/decode_layers.cpp): the same kernels, products
and order as the Python loop over them, so the same bits (tests/engine/test_fused_step.py compares both with the
module tree), without the interpreter, views and argument passing between them. SmolLM2 at the GRPO shape on a
Zen 3 EPYC: a decode step 57.1 instead of 61.4 ms (docs/benchmarks.md). The call holds the layers' weights, packs
and norms in a table made again when a pack or one of those tensors changed; it times its own parts for the
benchmarks (``time_loop``, ``loop_seconds``, ``LOOP_PARTS``). ``layer_loop`` off keeps the Python loop.

The layers run in inference mode: the same kernels, so the same bits, without autograd's per-operation
bookkeeping (version counters, view records); about 10% of a SmolLM2 step at batch 16. The tensors a step
leaves behind (the cache's write positions and gather buffer, its lengths; the logits) are made outside it.

Other models (other families, biases on some fused projections only, activations other than
SiLU) keep the module-tree decode; ``unsupported(model)`` says why.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import EngineError
from ..kernels import build
from ..modeling import decode_attention, decode_layer
from ..modeling.batch_invariant import act_mul, invariant_dtype
from ..modeling.decode_attention import ATTENTION as DECODE_ATTENTION
from ..modeling.decode_attention import takes_kernel
from ..modeling.linear_kernels import model_kernel, model_linear, onednn_linear
from ..modeling.packed_weights import Pack, pack, packed_linear
from .paged_cache import PagedCache

log = logging.getLogger(__name__)

FAMILIES = {"llama", "qwen3"}  # the layer layouts this step was written from and is tested on
# what the layer loop times of its layers where ``time_loop`` (seconds, decode_layers.cpp's ``run``): the products,
# the attention, its inputs (norms and rotation of the queries and keys, the cache writes), the residual adds with
# their RMSNorms, SiLU x up
LOOP_PARTS = ("products", "attention", "inputs", "norms", "silu")


def unsupported(model) -> str | None:
    """Why ``model`` cannot take the fused step (None when it can)."""
    config = model.config
    if config.model_type not in FAMILIES:
        return f"model type {config.model_type!r} (fused decode knows {sorted(FAMILIES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    if (getattr(config, "pretraining_tp", 1) or 1) != 1:
        return f"pretraining_tp {config.pretraining_tp}"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for group in [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]:
            if len({p.bias is None for p in group}) != 1:
                return "biases on some fused projections only"
    return None


@functools.cache
def fused_columns_keep_bits(
    linear: Callable, widths: tuple[int, ...], in_features: int, dtype: torch.dtype, threads: int
) -> bool:
    """Whether a vendor's product over weights stacked by rows (``widths`` output features each: a fused QKV or
    gate/up projection) gives every part the bits of its own product, at decode-step row counts (random data).
    Where it does not, the fused step runs the parts apart (the module tree's products): a choice of speed, never of
    availability."""
    gen = torch.Generator().manual_seed(sum(widths) * 8191 + in_features)
    parts = [torch.randn(w, in_features, generator=gen).to(dtype) for w in widths]
    fused = torch.cat(parts)
    with torch.no_grad():
        for rows in (1, 2, 3, 8, 16, 17, 33, 64):
            x = torch.randn(rows, in_features, generator=gen).to(dtype)
            pieces = linear(x, fused).split(list(widths), dim=-1)
            if not all(torch.equal(piece, linear(x, w)) for piece, w in zip(pieces, parts)):
                return False
    return True


def fuse_products(model) -> bool:
    """Whether the step's QKV and gate/up products run over the fused weights with the separate products' bits: by
    construction in true-on-policy mode, else where ``fused_columns_keep_bits`` finds it for every layer's shapes."""
    if invariant_dtype(model) is not None:
        return True
    linear, threads = model_linear(model), torch.get_num_threads()
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for group in [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]:
            widths, inputs = tuple(p.out_features for p in group), group[0].in_features
            if not fused_columns_keep_bits(linear, widths, inputs, group[0].weight.dtype, threads):
                return False
    return True


def _fuse(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for ``linears``; each linear's parameters become views into it."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    bias = None if linears[0].bias is None else torch.cat([lin.bias.detach() for lin in linears])
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = weight[start : start + rows]
        if bias is not None:
            lin.bias.data = bias[start : start + rows]
        start += rows
    return weight, bias


def _slot(module: nn.Module, name: str) -> tuple[dict, str]:
    """Where ``module.name`` lives (its parameters, buffers or plain attributes): a dictionary lookup reads it
    without nn.Module's ``__getattr__``, so the per-step checks over every layer stay in the tens of microseconds."""
    for place in (module._parameters, module._buffers, module.__dict__):
        if name in place:
            return place, name
    raise EngineError(f"fused decode: {type(module).__name__} has no {name!r}")


def _slot_watch(slots: list[tuple[dict, str]]):
    """A compiled watch over ``slots`` marked now (csrc/slot_watch.cpp), or None where the CPU kernels did not build
    or a slot holds nothing."""
    module = build.built()[0]
    if module is None:
        return None
    watch = module.SlotWatch(slots)
    return watch if watch.mark() else None


class _Layer:
    def __init__(self, layer):
        attn, mlp = layer.self_attn, layer.mlp
        self.attn = attn
        self.input_norm = layer.input_layernorm.forward
        self.post_norm = layer.post_attention_layernorm.forward
        self.norm_modules = layer.input_layernorm, layer.post_attention_layernorm
        self.head_norms = (attn.q_norm, attn.k_norm) if hasattr(attn, "q_norm") else None
        self.q_norm = attn.q_norm.forward if hasattr(attn, "q_norm") else None
        self.k_norm = attn.k_norm.forward if hasattr(attn, "k_norm") else None
        self.projections = [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj]
        self.qkv, self.qkv_bias = _fuse(self.projections[:3])
        self.gate_up, self.gate_up_bias = _fuse(self.projections[3:])
        self.splits = [attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0], attn.v_proj.weight.shape[0]]
        self.intermediate = mlp.gate_proj.weight.shape[0]
        self.o_proj, self.down_proj = attn.o_proj, mlp.down_proj
        self.head_dim = attn.head_dim
        self.heads, self.kv_heads = self.splits[0] // self.head_dim, self.splits[1] // self.head_dim
        self.scaling = attn.scaling
        self._views = [p.weight.data_ptr() for p in self.projections]
        self.packs: dict[str, Pack | None] = {}  # product name -> packed weight (empty: plain products)
        self.packed_versions: list[tuple[int, int]] | None = None  # the sources and their versions when packed
        self.packed_sources: list[torch.Tensor] = []  # held, so that no other tensor takes their ids

    def fused(self) -> bool:
        """The separate projections still view the fused weights (nothing replaced them)."""
        return [p.weight.data_ptr() for p in self.projections] == self._views

    def weights(self) -> dict[str, torch.Tensor]:
        return {"qkv": self.qkv, "o": self.o_proj.weight, "gate_up": self.gate_up, "down": self.down_proj.weight}

    def weight_modules(self) -> list[nn.Module]:
        """The modules whose ``weight`` the packs are made from (``sources``)."""
        return [*self.projections, self.o_proj, self.down_proj]

    def sources(self) -> list[torch.Tensor]:
        """The weights the packs are made from, as the modules hold them now (a replaced one is a new tensor)."""
        return [p.weight for p in self.projections] + [self.o_proj.weight, self.down_proj.weight]

    def versions(self, sources: list[torch.Tensor]) -> list[tuple[int, int]]:
        # an in-place write to a parameter (copy_, load_state_dict) bumps its version counter
        return [(id(w), w._version) for w in sources]

    def held(self, next_norm) -> list[tuple[nn.Module, str]]:
        """Where the layer loop (``DecodeLayers``) reads what it holds beside the fused weights and the packs:
        ``(module, attribute)``; another object there (a replaced weight, another epsilon) means a new table."""
        norms = [self.norm_modules[1], next_norm, *(self.head_norms or ())]
        held = [(self.o_proj, "weight"), (self.o_proj, "bias"), (self.down_proj, "weight"), (self.down_proj, "bias")]
        return held + [(n, name) for n in norms for name in ("weight", "variance_epsilon")]


class FusedDecoder:
    """One decode step of a Llama or Qwen3 causal LM (``unsupported(model)`` is None) over a PagedCache.

    Every projection runs through the product the model's linear layers use (``model_linear``:
    ``F.linear``, oneDNN's, or the padded product of the batch-invariant forward); the
    attention is the model's attention function, called as the model calls it.
    """

    def __init__(self, model):
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.norm = inner.norm.forward
        self.head = model.get_output_embeddings()
        self.layers = [_Layer(layer) for layer in inner.layers]
        # the norm after each layer's residual add: the next layer's input norm, the model's final norm after the last
        self.next_norms = [layer.norm_modules[0] for layer in self.layers[1:]] + [inner.norm]
        self.model = model
        self.linear = model_linear(model)
        # QKV and gate/up as one product each where that keeps each projection's bits, else apart (fuse_products)
        self.fused_products = fuse_products(model)
        self.act_mul = act_mul(model)  # SiLU(gate) x up as the model's MLP computes it
        self.rope, self.attention = _model_functions(model)
        built = decode_attention.compiled()[0] if model.config._attn_implementation == DECODE_ATTENTION else None
        self.decode_kernel = None if built is None else built.decode_attention
        self._kernel_takes: dict[int, bool] = {}
        # sdpa and the decode kernel take an additive mask as sdpa would make it (modeling/decode_attention.py)
        self.additive_mask = model.config._attn_implementation in ("sdpa", DECODE_ATTENTION)
        # oneDNN products over packed copies of the weights, where they keep the plain product's bits:
        # oneDNN's fp32 kernel, and bf16 (F.linear is oneDNN's product there)
        dtype, kernel = self.head.weight.dtype, model_kernel(model)
        on_cpu = all(p.device.type == "cpu" for p in model.parameters())
        self.can_pack = on_cpu and (kernel == "onednn" or (kernel == "torch" and dtype == torch.bfloat16))
        self.packing = self.can_pack  # off: plain weights (benchmarks)
        # rows of like length attend together at their own width (paged_cache.attention_groups); off: every
        # row at the longest row's width, as the module tree attends (the batch-invariant attention gives
        # the same bits either way; sdpa's bits may change with the width, within float rounding)
        self.group_rows = True
        self.packed_linear = packed_linear  # an attribute, like ``linear``: benchmarks time both
        # the layers' elementwise work in compiled kernels with the model's bits (float32; modeling/decode_layer.py)
        why = decode_layer.unsupported(model)
        self.layer_kernels = decode_layer.compiled()[0] if why is None else None
        self.compiled_layers = self.layer_kernels is not None  # off: PyTorch's operations (benchmarks)
        if why is not None:
            log.debug("fused decode: the layers' elementwise work stays PyTorch's (%s)", why)
        self._packed_threads: int | None = None  # the thread count the packs were checked at
        self._head_pack: Pack | None = None
        self._head_version: tuple[int, int] | None = None
        self._head_source: torch.Tensor | None = None
        # the layers in one compiled call where the step is the common one (``_loop_runs``); off: the Python loop
        linear = model_linear(model)
        self._loop_plain = {F.linear: "linear", onednn_linear: "onednn"}.get(linear)
        self.layer_loop = self.layer_kernels is not None and self._loop_plain is not None
        self._loop = None  # the compiled table of the layers (DecodeLayers) and what it was built from
        self._loop_key: tuple | None = None
        self._loop_held: list = []
        self._held = [pair for layer, n in zip(self.layers, self.next_norms) for pair in layer.held(n)]
        # where the layer table's held tensors and the weights ``check`` reads (each layer's sources, the head's)
        # live; and what ``check`` found when it last had nothing to do
        self._held_slots, self._watched = self._slots()
        self._checked: tuple | None = None
        self._checked_tensors: list[torch.Tensor] = []  # held, so that no other tensor takes their ids
        # the same comparisons in one compiled call where the CPU kernels built (csrc/slot_watch.cpp): over the
        # watched weights since the last full check, over the layer table's held objects since it was made
        self._watch = None
        self._table_watch = None
        self._packs_made = 0  # counts the packs made or dropped: a new table after each
        # the seconds the loop spent in each of its parts (``LOOP_PARTS``), where ``time_loop`` (benchmarks)
        self.time_loop = False
        self.loop_seconds = dict.fromkeys(LOOP_PARTS, 0.0)

    def _slots(self) -> tuple[list[tuple[dict, str]], list[tuple[dict, str]]]:
        """``_held``'s slots, and those of the weights ``check`` watches."""
        watched = [_slot(w, "weight") for layer in self.layers for w in layer.weight_modules()]
        return [_slot(module, name) for module, name in self._held], watched + [_slot(self.head, "weight")]

    def _state(self) -> tuple[tuple, list[torch.Tensor]]:
        """What ``check`` depends on, in one pass: the thread count, the packing switches and packs made, and each
        watched weight's identity, version and data pointer (an in-place write bumps the version; a replaced
        tensor is another object; ``.data =`` moves the pointer)."""
        try:
            tensors = [place[name] for place, name in self._watched]
        except KeyError:  # a parameter deleted, or set as a plain attribute: look again
            self._held_slots, self._watched = self._slots()
            tensors = [place[name] for place, name in self._watched]
        ids, versions = [id(t) for t in tensors], [t._version for t in tensors]
        pointers = [t.data_ptr() for t in tensors]
        return (self._head_state(), ids, versions, pointers), tensors

    def _head_state(self) -> tuple:
        return (torch.get_num_threads(), self.packing, self.can_pack, self._packs_made)

    def check(self) -> None:
        """Refuses to run if a projection's weight was replaced instead of written in place; repacks
        the weights an update wrote since they were packed. Nothing to do where no watched weight, thread
        count or packing switch changed since the last check (``_state``): 0.036 instead of 0.24 ms alone on a Zen 5
        EPYC, inside a step some 0.34 ms (its tensors' objects cold after the products); through the compiled watch
        (``_slot_watch``) 0.004 ms alone and some 0.07 ms inside a step."""
        if self._watch is not None:
            if self._checked is not None and self._checked[0] == self._head_state() and not self._watch.changed():
                return
        else:
            state, _ = self._state()
            if state == self._checked:
                return
        self._full_check()
        self._checked, self._checked_tensors = self._state()
        self._watch = _slot_watch(self._watched)

    def _full_check(self) -> None:
        for i, layer in enumerate(self.layers):
            if not layer.fused():
                raise EngineError(f"fused decode: layer {i}'s projection weights were replaced, not written in place")
        fused = fuse_products(self.model)  # checked per thread count (cached): the count may have changed
        if fused != self.fused_products:
            self.fused_products = fused
            self.drop_packs()  # the packs and the layer table were made for the other way
        if self.packing and self.can_pack:
            self._refresh_packs()
        elif self._head_pack is not None or self.layers[0].packs:
            self.drop_packs()

    def drop_packs(self) -> None:
        for layer in self.layers:
            layer.packs, layer.packed_versions, layer.packed_sources = {}, None, []
        self._head_pack, self._head_version, self._head_source, self._packed_threads = None, None, None, None
        self._packs_made += 1
        self._loop, self._loop_key, self._loop_held = None, None, []  # the layer table holds the packs

    def _refresh_packs(self) -> None:
        threads = torch.get_num_threads()
        if threads != self._packed_threads:  # the bits were checked per thread count
            self.drop_packs()
            self._packed_threads = threads
        for layer in self.layers:
            sources = layer.sources()
            versions = layer.versions(sources)
            if versions != layer.packed_versions:
                layer.packs = {
                    name: pack(w, self.linear)
                    for name, w in layer.weights().items()
                    if self.fused_products or name in ("o", "down")  # apart, the parts' products are plain
                }
                layer.packed_versions, layer.packed_sources = versions, sources
                self._packs_made += 1
        head = self.head.weight
        if (id(head), head._version) != self._head_version:
            self._head_pack = pack(head, self.linear)
            self._head_version, self._head_source = (id(head), head._version), head  # held: its id stays its own

    def _attend(
        self, layer: _Layer, q, kv: tuple[torch.Tensor, torch.Tensor], mask, group: int = 0, shared=None
    ) -> torch.Tensor:
        """The model's attention function, called as the model calls it: ``[rows, 1, heads, head_dim]``. The decode
        kernel's function takes a call after checking it (``takes_kernel``, ~10 us); every layer's call of a step
        and group has the first one's shapes, so the check runs once a step and group and the kernel is called."""
        if self.decode_kernel is not None:
            takes = self._kernel_takes.get(group)
            if takes is None:
                takes = self._kernel_takes[group] = takes_kernel(q, kv[0], kv[1], mask, 0.0, {})
            if takes:
                return self.decode_kernel(q, kv[0], kv[1], mask, float(layer.scaling), shared)
        out, _ = self.attention(layer.attn, q, kv[0], kv[1], mask, dropout=0.0, scaling=layer.scaling)
        return out

    @torch.no_grad()
    def step(self, cache: PagedCache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, V]`` (float32) of one new token per row; writes its keys and values at each row's position."""
        cache.prepare_decode(grouped=self.group_rows)  # rows of like length attend together
        self._kernel_takes = {}  # this step's groups: whether the decode kernel takes their calls
        packing = self.packing and self.can_pack
        # inference mode (module docstring): what outlives the step, the cache's tensors and the logits, is made outside
        with torch.inference_mode():
            if self.compiled_layers and self.layer_kernels is not None:
                h = self._compiled_layers(cache, tokens, positions, packing)
            else:
                h = self.norm(self._layers(cache, tokens, positions, packing))
        cache.finish_decode()
        return self._product(h, self.head.weight, self.head.bias, self._head_pack, packing)[:, -1, :].float()

    def _stacked(self, x, layer: _Layer, name: str, packing: bool) -> torch.Tensor:
        """Layer ``layer``'s ``qkv`` or ``gate_up`` product: one over the fused weight where it keeps the parts' bits
        (``fused_products``), else the parts' own products side by side (the module tree's)."""
        if self.fused_products:
            weight, bias = (layer.qkv, layer.qkv_bias) if name == "qkv" else (layer.gate_up, layer.gate_up_bias)
            return self._product(x, weight, bias, layer.packs.get(name), packing)
        parts = layer.projections[:3] if name == "qkv" else layer.projections[3:]
        return torch.cat([self.linear(x, p.weight, p.bias) for p in parts], dim=-1)

    def _product(self, x, weight, bias, pack: Pack | None, packing: bool) -> torch.Tensor:
        """``x @ weight.T + bias`` over the packed weight where it keeps the plain product's bits, else plain."""
        if packing and pack is not None and x.shape[0] >= pack.rows_from:  # fewer rows: their bits are the plain's
            return self.packed_linear(x, pack.weight, bias)
        return self.linear(x, weight, bias)

    def _masks(self, cache: PagedCache, x: torch.Tensor) -> list[torch.Tensor]:
        """Each attention group's mask, ``[rows, 1, 1, width]``: True where a key is seen, or additive."""
        masks = [group.mask for group in cache.groups]
        if self.additive_mask:  # what sdpa turns a boolean mask into, once per step instead of once per layer
            zero, minus_inf = torch.zeros((), dtype=x.dtype), torch.full((), float("-inf"), dtype=x.dtype)
            masks = [torch.where(m, zero, minus_inf).to(x.device) for m in masks]
        return masks

    def _attend_groups(self, cache: PagedCache, index: int, layer: _Layer, q, masks) -> torch.Tensor:
        """Layer ``index``'s attention of this step's queries ``[B, heads, 1, d]``: ``[B, 1, heads, d]``."""
        if len(masks) == 1 and cache.groups[0].rows is None:  # every row, in batch order
            return self._attend(layer, q, cache.attended(index), masks[0], shared=cache.groups[0].shared)
        # each group at its own width, its rows' outputs back in batch order
        out = q.new_empty(q.shape[0], 1, q.shape[1], q.shape[3])
        for number, (group, mask) in enumerate(zip(cache.groups, masks)):
            kv = cache.attended(index, group)
            attended = self._attend(layer, q.index_select(0, group.rows), kv, mask, number, group.shared)
            out.index_copy_(0, group.rows, attended)
        return out

    def _compiled_layers(
        self, cache: PagedCache, tokens: torch.Tensor, positions: torch.Tensor, packing: bool
    ) -> torch.Tensor:
        """``_layers`` and the final norm with the layers' elementwise work in the compiled kernels
        (modeling/decode_layer.py), the same bits: the normed last hidden states ``[B, 1, H]``."""
        kernels = self.layer_kernels
        x = self.embed.forward(tokens[:, None])
        batch = x.shape[0]
        cos, sin = self.rotary.forward(x, positions[:, None])
        masks = self._masks(cache, x)
        first = self.layers[0].norm_modules[0]
        h = kernels.rms_norm(x, first.weight, first.variance_epsilon)
        if self._loop_runs(cache, x, masks):
            group = cache.groups[0]
            h, seconds = self._loop_table(packing).run(
                x, h, cos, sin, cache.pool.storage, cache.write_slots, masks[0], group.shared,
                group.first, group.stride, group.width, packing, self.time_loop,
            )  # fmt: skip
            for part, spent in seconds.items():  # empty unless ``time_loop``
                self.loop_seconds[part] += spent
            return h
        for index, (layer, next_norm) in enumerate(zip(self.layers, self.next_norms)):
            packs = layer.packs
            qkv = self._stacked(h, layer, "qkv", packing)
            q_norm, k_norm = layer.head_norms or (None, None)
            eps = q_norm.variance_epsilon if q_norm is not None else 0.0
            keys, values, slots = cache.write_target(index)
            q = kernels.attention_inputs(
                qkv, layer.heads, layer.kv_heads, layer.head_dim, cos, sin,
                None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight,
                eps, keys, values, slots,
            )  # fmt: skip
            out = self._attend_groups(cache, index, layer, q, masks)
            o_proj, post_norm = layer.o_proj, layer.norm_modules[1]
            update = self._product(out.reshape(batch, 1, -1), o_proj.weight, o_proj.bias, packs.get("o"), packing)
            x, h = kernels.add_rms_norm(x, update, post_norm.weight, post_norm.variance_epsilon)
            gate_up = self._stacked(h, layer, "gate_up", packing)
            act = kernels.silu_mul(gate_up, layer.intermediate)
            down = layer.down_proj
            update = self._product(act, down.weight, down.bias, packs.get("down"), packing)
            x, h = kernels.add_rms_norm(x, update, next_norm.weight, next_norm.variance_epsilon)
        return h

    def _loop_runs(self, cache: PagedCache, x: torch.Tensor, masks: list[torch.Tensor]) -> bool:
        """Whether this step's layers run in one compiled call: the decode kernel attends every row, in batch order
        and in place in the cache (one group), with the additive mask the kernel takes."""
        if not (self.layer_loop and self._loop_plain and self.decode_kernel is not None and self.additive_mask):
            return False
        if len(cache.groups) != 1 or cache.groups[0].rows is not None or cache.groups[0].gather is not None:
            return False
        layer = self.layers[0]
        keys, values = cache.attended(0)
        query = x.new_empty(x.shape[0], layer.heads, 1, layer.head_dim)
        return takes_kernel(query, keys, values, masks[0], 0.0, {})

    def _loop_table(self, packing: bool):
        """The layers' compiled table (``DecodeLayers``), made again when a pack or a tensor it holds changed since
        (it holds the packs, so dropping them drops it too)."""
        if self._loop is not None and self._loop_key is not None and self._loop_key[:2] == (self._packs_made, packing):
            if self._table_watch is not None and not self._table_watch.changed():
                return self._loop  # nothing it holds moved (a tensor written in place: the slower look below)
        try:
            held = [place[name] for place, name in self._held_slots]
        except KeyError:  # an attribute moved (a parameter set as a plain tensor): look again
            self._held_slots, self._watched = self._slots()
            held = [place[name] for place, name in self._held_slots]
        key = (self._packs_made, packing, [id(obj) for obj in held])
        if self._loop is not None and self._loop_key == key:
            self._table_watch = _slot_watch(self._held_slots)
            return self._loop
        table = self.layer_kernels.DecodeLayers(self._loop_plain)
        for layer, next_norm in zip(self.layers, self.next_norms):
            weights = layer.weights()
            biases = [layer.qkv_bias, layer.o_proj.bias, layer.gate_up_bias, layer.down_proj.bias]
            packs = [layer.packs.get(name) for name in ("qkv", "o", "gate_up", "down")] if packing else [None] * 4
            q_norm, k_norm = layer.head_norms or (None, None)
            post_norm = layer.norm_modules[1]
            apart = [] if self.fused_products else [*layer.splits, layer.intermediate, layer.intermediate]
            table.add_layer(
                [weights[name] for name in ("qkv", "o", "gate_up", "down")], biases,
                [None if p is None else p.weight for p in packs], [0 if p is None else p.rows_from for p in packs],
                apart,
                post_norm.weight, post_norm.variance_epsilon, next_norm.weight, next_norm.variance_epsilon,
                None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight,
                q_norm.variance_epsilon if q_norm is not None else 0.0,
                layer.heads, layer.kv_heads, layer.head_dim, layer.intermediate, float(layer.scaling),
            )  # fmt: skip
        # the objects are kept with their ids, so that no other object takes one of those ids
        self._loop, self._loop_key, self._loop_held = table, key, held
        self._table_watch = _slot_watch(self._held_slots)
        return table

    def _layers(self, cache: PagedCache, tokens: torch.Tensor, positions: torch.Tensor, packing: bool) -> torch.Tensor:
        """The decoder layers of one step: the last layer's hidden states ``[B, 1, H]``."""
        rope = self.rope
        x = self.embed.forward(tokens[:, None])
        batch = x.shape[0]

        def linear(x, weight, bias, pack):
            return self._product(x, weight, bias, pack, packing)

        cos, sin = self.rotary.forward(x, positions[:, None])
        masks = self._masks(cache, x)
        for index, layer in enumerate(self.layers):
            residual = x
            h = layer.input_norm(x)
            packs = layer.packs
            q, k, v = self._stacked(h, layer, "qkv", packing).split(layer.splits, dim=-1)
            q, k, v = (t.view(batch, 1, -1, layer.head_dim) for t in (q, k, v))
            if layer.q_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q, k = rope(q, k, cos, sin)
            cache.write(index, k, v)
            out = self._attend_groups(cache, index, layer, q, masks)
            x = residual + linear(out.reshape(batch, 1, -1), layer.o_proj.weight, layer.o_proj.bias, packs.get("o"))
            residual = x
            gate, up = self._stacked(layer.post_norm(x), layer, "gate_up", packing).split(layer.intermediate, dim=-1)
            act = self.act_mul(gate, up)
            x = residual + linear(act, layer.down_proj.weight, layer.down_proj.bias, packs.get("down"))
        return x


def _model_functions(model) -> tuple[Callable, Callable]:
    """The model's own ``apply_rotary_pos_emb`` and attention function, as its attention module finds them."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    module = importlib.import_module(type(model.model.layers[0].self_attn).__module__)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(model.config._attn_implementation, module.eager_attention_forward)
    return module.apply_rotary_pos_emb, attention
