"""Tensor parallelism for Llama-style Hugging Face decoders on torch's own DTensor machinery.

Megatron's layout, as ``parallelize_module`` plans express it: in every layer the query, key,
value, gate and up projections are split by output columns (each rank holds whole attention
heads and a slice of the MLP) and the output and down projections by input rows, whose partial
sums are all-reduced; norms stay replicated (per-head norms as replicated DTensors, so the
gradient of their weight sums over the heads of every rank). The LM head is split by vocabulary rows and
returns each rank's logit columns ``[T, V / tp]`` as a plain tensor: the scores come from
``core/parallel.py``'s vocab-parallel functions, so no rank ever holds ``[T, V]``. A tied input
embedding is split the same way (vocabulary rows) and re-tied, so the two stay one parameter.

A mixture-of-experts layer splits its attention only: the sparse block (router and experts) stays
whole on every TP rank, like the norms, and computes on the replicated hidden state after the
attention's all-reduce. Splitting each expert by columns would cut its small products (a 768-wide
expert of Qwen3-30B-A3B over 8 ranks is 96 columns) and add an all-reduce per layer for little
memory, and expert parallelism (experts over ranks, all-to-all dispatch) is a layout of its own;
replicated experts give every rank the single-device expert output, and the routing its bits.

DTensor's autograd does the collectives of the backward; the vocab-parallel functions return
each rank's own logit gradient, and the hidden state's partial gradients from the head are
summed by DTensor (the head's input is replicated), so a loss replicated on the TP ranks
gets exactly the single-device gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from ..errors import ConfigError
from .moe import ROUTERS

ATTENTION_COLUMNS, MLP_COLUMNS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("mlp.gate_proj", "mlp.up_proj"),
)
ATTENTION_ROWS, MLP_ROWS = ("self_attn.o_proj",), ("mlp.down_proj",)
COLUMNS, ROWS = ATTENTION_COLUMNS + MLP_COLUMNS, ATTENTION_ROWS + MLP_ROWS


def _split(layer: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The column- and row-split linears of ``layer``: attention only where its MLP is a sparse block."""
    if any(type(m).__name__ in ROUTERS for m in layer.modules()):
        return ATTENTION_COLUMNS, ATTENTION_ROWS
    return COLUMNS, ROWS


HEAD_NORMS = ("self_attn.q_norm", "self_attn.k_norm")


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows of the LM head: global ids ``[start, start + size)``."""

    start: int
    size: int


def check_tensor_parallel(hf: nn.Module, tp: int) -> None:
    """Refuse, naming the setting, a model whose heads or MLP do not split over ``tp`` ranks."""
    cfg = hf.config
    layers = getattr(hf.get_decoder(), "layers", None)
    if not layers:
        raise ConfigError(
            f"--tensor-model-parallel-size={tp}: {type(hf).__name__} has no Llama-style decoder layers to split"
        )
    columns, rows = _split(layers[0])
    missing = [
        name
        for name in columns + rows
        if not (_has(layers[0], name) and isinstance(layers[0].get_submodule(name), nn.Linear))
    ]
    if missing:
        raise ConfigError(
            f"--tensor-model-parallel-size={tp}: {type(hf).__name__} has no Llama-style {missing[0]} linear layer"
        )
    split = ("num_attention_heads", "num_key_value_heads") + (("intermediate_size",) if columns == COLUMNS else ())
    for name in split:
        value = getattr(cfg, name, None)
        if value is None or value % tp:
            raise ConfigError(f"--tensor-model-parallel-size={tp}: the model's {name}={value} is not a multiple of it")


def parallelize_tensor(hf: nn.Module, tp_mesh) -> VocabShard:
    """Split ``hf`` in place over ``tp_mesh`` (1-D); returns this rank's vocabulary rows."""
    check_tensor_parallel(hf, tp_mesh.size())
    tied = hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
    for layer in hf.get_decoder().layers:
        columns, rows = _split(layer)
        plan = {name: ColwiseParallel() for name in columns} | {name: RowwiseParallel() for name in rows}
        # per-head norms (Qwen3's q_norm, k_norm) see only this rank's heads: their weight becomes a
        # replicated DTensor over heads sharded on dim 2, so its partial gradients are summed
        plan |= {
            name: SequenceParallel(sequence_dim=2, use_local_output=True) for name in HEAD_NORMS if _has(layer, name)
        }
        parallelize_module(layer, tp_mesh, plan)
    head_name = _name_of(hf, hf.get_output_embeddings())
    plan = {head_name: ColwiseParallel(output_layouts=Shard(-1), use_local_output=True)}
    if tied:  # one parameter for both: split the embedding by vocabulary rows too, then tie again
        plan[_name_of(hf, hf.get_input_embeddings())] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Replicate()
        )
    parallelize_module(hf, tp_mesh, plan)
    head = hf.get_output_embeddings()
    if tied:
        head.weight = hf.get_input_embeddings().weight
    weight = head.weight
    assert isinstance(weight, DTensor)
    local = weight.to_local().shape[0]
    # DTensor splits like torch.chunk: every shard ceil(V / tp) rows but the last
    start = tp_mesh.get_local_rank() * -(-weight.shape[0] // tp_mesh.size())
    return VocabShard(start=start, size=local)


def _has(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
        return True
    except AttributeError:
        return False


def _name_of(root: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in root.named_modules() if m is module)
