"""The peak activation memory of one step, as a sympy expression in ``T`` and ``B``.

:func:`activation_peak` propagates fake tensors with *symbolic* sizes through a rewritten step
graph (``FakeTensorProp`` under a ``ShapeEnv``: the token count of ``input_ids`` and the sequence
count of ``seq_lens`` become symbols, whose sympy forms are renamed ``T`` and ``B``), then walks
the nodes in order with their liveness:

* a node's output that shares storage with something earlier (a view, an in-place op, a no-op
  ``to``) allocates nothing; otherwise it allocates ``numel * itemsize`` bytes;
* a storage is freed after the last node that reads it or any view of it (the graph's outputs
  live to the end);
* the live bytes right after each node's outputs are allocated (its inputs still alive) are the
  candidates for the peak.

Inputs (metadata, KV caches) and weights are not activations and are not counted. Work space an
op allocates inside its kernel (a GEMM's packing buffers, an attention kernel's per-thread
accumulators) is not visible in the graph and not counted either.

The peak is ``Max`` of the candidates none of which is dominated by another (each is a
polynomial in ``T`` and ``B`` with non-negative coefficients, so one whose every coefficient is
at most another's is never larger, for any ``T, B >= 0``).
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.multiprocessing.reductions import StorageWeakRef

from pagedpack.step.contract import METADATA_INPUTS

T, B = sympy.symbols("T B", integer=True, positive=True)

# Example sizes for the fake inputs: distinct, and not 0 or 1 (which the ShapeEnv specialises).
_EXAMPLE_T, _EXAMPLE_B, _EXAMPLE_WIDTH, _EXAMPLE_BLOCKS, _EXAMPLE_BLOCK_SIZE = 37, 3, 5, 8, 16
_DYNAMIC_DIMS = {"input_ids": (0,), "positions": (0,), "slot_mapping": (0,), "cu_seqlens_q": (0,),
                 "seq_lens": (0,), "block_table": (0, 1), "logits_indices": (0,), "state_indices": (0,),
                 "has_initial_state": (0,)}


@dataclass
class ActivationPeak:
    """``expr``: peak activation bytes of one step (sympy, in :data:`T` and :data:`B`);
    ``candidates``: the non-dominated live-byte expressions it is the ``Max`` of."""

    expr: sympy.Expr
    candidates: list[sympy.Expr]

    def bytes(self, num_tokens: int, num_seqs: int) -> int:
        """The peak for a step of ``num_tokens`` tokens over ``num_seqs`` sequences."""
        return int(self.expr.subs({T: num_tokens, B: num_seqs}))


def activation_peak(graph_module: torch.fx.GraphModule, kv_cache_specs, state_specs=()) -> ActivationPeak:
    """The symbolic peak activation bytes of one step of a rewritten step graph (module
    docstring). ``kv_cache_specs`` / ``state_specs``: the graph's :class:`~pagedpack.step.contract.KVCacheSpec`
    and :class:`~pagedpack.step.contract.StateSpec` lists.
    Raises ``ValueError`` naming the node if shape propagation fails. The graph is left as it
    was: the example's fake values the propagation writes into ``node.meta["val"]`` (block size
    16, its own symbols) are replaced by the graph's own afterwards, which later passes read."""
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    inputs = _example_inputs(kv_cache_specs, state_specs)
    fake_inputs = [_fake(mode, tensor, _DYNAMIC_DIMS.get(name, ())) for name, tensor in inputs]
    own = {node: node.meta["val"] for node in graph_module.graph.nodes if "val" in node.meta}
    try:
        FakeTensorProp(graph_module, mode).propagate_dont_convert_inputs(*fake_inputs)
        rename = _symbol_names(fake_inputs[:len(METADATA_INPUTS)])
        candidates = _live_bytes(graph_module, rename)
    except Exception as err:  # any failure of a node's fake kernel: name it
        raise ValueError(f"activation_peak: symbolic shape propagation failed: {type(err).__name__}: "
                         f"{str(err)[:300]}") from err
    finally:
        for node in graph_module.graph.nodes:
            if node in own:
                node.meta["val"] = own[node]
            else:
                node.meta.pop("val", None)
    frontier = _non_dominated(candidates)
    return ActivationPeak(sympy.Max(*frontier) if frontier else sympy.Integer(0), frontier)


def _example_inputs(kv_cache_specs, state_specs) -> list[tuple[str, torch.Tensor]]:
    from pagedpack.step.metadata import example_metadata, example_state_inputs

    q_lens = [_EXAMPLE_T - 2 * (_EXAMPLE_B - 1)] + [2] * (_EXAMPLE_B - 1)
    context = [0] + [(_EXAMPLE_WIDTH - 1) * _EXAMPLE_BLOCK_SIZE] * (_EXAMPLE_B - 1)
    batch = example_metadata(q_lens, context, block_size=_EXAMPLE_BLOCK_SIZE, num_blocks=_EXAMPLE_BLOCKS)
    metadata = batch.as_inputs()
    inputs = [(name, metadata[name]) for name in METADATA_INPUTS]
    for spec in kv_cache_specs:
        for shape in spec.cache_shapes(_EXAMPLE_BLOCKS, _EXAMPLE_BLOCK_SIZE):
            inputs.append(("kv_cache", torch.empty(shape, dtype=spec.dtype)))
    state = example_state_inputs(state_specs, context)
    return inputs + list(zip(["state_indices", "has_initial_state", *["state"] * len(state_specs)], state))


def _fake(mode: FakeTensorMode, tensor: torch.Tensor, dynamic: tuple[int, ...]) -> torch.Tensor:
    sizes = [DimDynamic.DYNAMIC if d in dynamic else DimDynamic.STATIC for d in range(tensor.dim())]
    return mode.from_tensor(tensor, symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes))


def _symbol_names(metadata: list[torch.Tensor]) -> dict[sympy.Symbol, sympy.Expr]:
    """The ShapeEnv's symbols of the token and sequence counts -> :data:`T`, :data:`B` (the
    logits rows, one per sequence, are ``B`` too)."""
    by_name = dict(zip(METADATA_INPUTS, metadata))
    rename = {}
    for name, target in (("input_ids", T), ("seq_lens", B), ("logits_indices", B)):
        expr = by_name[name].shape[0].node.expr
        if isinstance(expr, sympy.Symbol):
            rename[expr] = target
    return rename


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(tensor: torch.Tensor, rename) -> sympy.Expr:
    numel = tensor.numel()
    expr = numel.node.expr if isinstance(numel, torch.SymInt) else sympy.Integer(numel)
    return sympy.expand(expr.xreplace(rename) * tensor.element_size())


def _live_bytes(graph_module: torch.fx.GraphModule, rename) -> list[sympy.Expr]:
    nodes = list(graph_module.graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    allocated: dict[StorageWeakRef, tuple[int, sympy.Expr]] = {}  # storage -> (node index, bytes)
    last_use: dict[StorageWeakRef, int] = {}
    for i, node in enumerate(nodes):
        end = max([index[user] for user in node.users] + [i])
        for tensor in _tensors(node.meta.get("val")):
            ref = StorageWeakRef(tensor.untyped_storage())
            if ref not in last_use and node.op == "call_function":
                allocated[ref] = (i, _nbytes(tensor, rename))
            last_use[ref] = max(last_use.get(ref, i), end)
    born: dict[int, list[sympy.Expr]] = {}
    dies: dict[int, list[sympy.Expr]] = {}
    for ref, (i, size) in allocated.items():
        born.setdefault(i, []).append(size)
        dies.setdefault(last_use[ref], []).append(size)
    live, candidates = sympy.Integer(0), []
    for i in range(len(nodes)):
        if i in born:
            live = sympy.expand(live + sum(born[i]))
            candidates.append(live)
        if i in dies:
            live = sympy.expand(live - sum(dies[i]))
    return candidates


def _non_dominated(candidates: list[sympy.Expr]) -> list[sympy.Expr]:
    unique = list(dict.fromkeys(candidates))
    coefficients = [sympy.Poly(e, T, B).as_dict() for e in unique]

    def dominated(a: dict, b: dict) -> bool:  # a <= b for all T, B >= 0, a != b
        return a != b and all(v <= b.get(k, 0) for k, v in a.items()) and all(v >= 0 for v in b.values())

    return [e for e, c in zip(unique, coefficients)
            if not any(dominated(c, other) for other in coefficients)]
