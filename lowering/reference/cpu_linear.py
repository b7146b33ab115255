"""fp32 and bf16 linears on the CPU as GEMMs on weights prepacked once: oneDNN's, or for bf16 on a CPU
where oneDNN has no bf16 kernels, the native one.

:func:`prepack_linears` replaces each ``aten.linear.default(x, weight[, bias])`` of a step graph
whose weight is a ``get_attr`` fp32 CPU tensor, or bf16 where oneDNN has bf16 kernels for the CPU
(:func:`packable_dtypes`), by::

    torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

with ``packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)`` computed once, at
lowering, and kept as a buffer of the graph module (``<weight>_packed``; an opaque oneDNN tensor
in the layout oneDNN's inner product wants, so the per-call reorder of ``F.linear``'s MKL path
and its primitive setup are gone). This is how Inductor packs bf16/fp16 weights (and fp32
ones in AOT mode) in ``torch/_inductor/fx_passes/mkldnn_fusion.py``; the batch-size hint is
None because a step's row count varies.

A bf16 weight on a CPU without bf16 dot-product instructions (no AVX512-BF16, no AMX: oneDNN would
emulate bf16, and ``F.linear`` computes about 17 GFLOP/s on two AVX2 cores at any row count) goes to
the native kernel instead (``kernels/csrc/linear_bf16_cpu.cpp``)::

    torch.ops.pagedpack_cpu.bf16_linear(x, packed, bias, out_features)

on ``packed = torch.ops.pagedpack_cpu.bf16_linear_pack(weight)`` (panels of 16 columns of W^T, bf16,
the weight's size): exact bf16 products summed in fp32 and rounded once, as oneDNN's bf16 inner
product. ``benchmarks/linear.py --quick --dtype bfloat16`` (AMD EPYC, AVX2, 2 threads, load 0.42): 0.31
of ``F.linear``'s time at decode row counts and 0.17 at prefill ones (geometric means over SmolLM2's and
W1's shapes; 110-122 GFLOP/s from 256 rows), 0.53-0.73 at one row, but 1.1-1.2x at one row on the
narrow k/v projections, which a served step merges into the qkv GEMM (docs/cpu-kernels.md).

Measured with ``benchmarks/linear.py`` (2 threads on an AMD EPYC with AVX-512, torch 2.13, load
0.77 at the start): time of oneDNN on the packed weight over ``F.linear``'s (MKL sgemm),
geometric mean over each model's linear shapes (q/o, k/v, merged qkv, gate/up, merged gate_up,
down; the LM head at decode only, as the step applies it to one row per sequence):

    rows M                 W1 (hidden 512)   SmolLM2-135M (hidden 576)
    decode  1 .. 32             0.62              0.58
    prefill 256 .. 2048         0.89              0.85

oneDNN loses only at M = 1 on the narrow k/v projections (N = 128 / 192: 18-21 us against
7-10 us, a fixed cost of ~10 us a call), which ``merge_linears`` folds into the qkv GEMM (0.79
there), and ties on q/o at M = 1; the LM head gains most (0.2-0.4 at decode; SmolLM2's: 9.7 ms
-> 3.8 ms at M = 1). Hence one path, oneDNN for every fp32 linear, without a dispatch on rows.

bf16 (2 threads on an Intel Xeon with AVX512-BF16, no AMX, SmolLM2's shapes): the packed GEMM takes
0.45-0.62 of ``F.linear``'s time at M = 2 and 0.69-0.79 at M = 200, with bit-identical outputs (both
are oneDNN's bf16 inner product with fp32 accumulation; ``F.linear`` reorders the weight on every
call); at M = 200 it takes 0.11-0.18 of the packed fp32 GEMM's time.

Memory: the packed weights replace the plain ones in the lowered copy of the graph (which then
drops the plain ones: ``drop_unused_attrs``); the rewritten graph, which ``LLM.export`` writes,
and the ``transformers`` model keep theirs, and an ``LLM`` lets those two go once lowered
(``pagedpack.llm.LLM``, Memory), so that serving holds each weight once.

Primitive caches: oneDNN builds a primitive (JIT code) for each input shape, so for each row
count a step brings, and keeps it in two process-wide caches, oneDNN's own and ideep's, of 1024
entries each by default: a server whose steps come in many sizes grew by about 2 MiB per new row
count (W1's model, 300 prompt lengths one at a time: 520 -> 1071 MiB RSS). Importing this module
caps both at :data:`ONEDNN_CACHE_CAPACITY` entries (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``,
``LRU_CACHE_CAPACITY``; a value already in the environment wins; read when the process creates
its first oneDNN primitive): 586 MiB after the same 300, and the same W1 time (a step of a
shape no longer cached rebuilds its primitives, ~0.6 ms a linear). vLLM keeps 32 per weight.

The reference target's CPU lowering (:mod:`pagedpack.lowering.reference.cpu`) applies it to a copy of the
rewritten graph and checks the result.
"""
from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch
import torch.fx
import torch.nn.functional as F

from pagedpack.host.devices import is_cpu
from pagedpack.kernels.native import native_ops
from pagedpack.passes.graph_attrs import attr_tensor, fresh_attr_name
from pagedpack.passes.graph_edit import finish_rewrite, replace_with_call

aten = torch.ops.aten
ONEDNN_CACHE_CAPACITY = 64
for _variable in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_variable, str(ONEDNN_CACHE_CAPACITY))


def available(device: torch.device | str = "cpu") -> bool:
    """oneDNN is built in and enabled, and ``device`` is the CPU."""
    return (is_cpu(device) and torch.backends.mkldnn.is_available()
            and torch.backends.mkldnn.enabled)




@functools.cache
def packable_dtypes() -> tuple[torch.dtype, ...]:
    """fp32, and bf16 where oneDNN has bf16 kernels for this CPU (AVX512-BF16 / AMX; without them it
    would emulate bf16 and lose to the plain path)."""
    return (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


def _kind(weight: torch.Tensor | None, bias: torch.Tensor | None, has_bias: bool) -> str | None:
    """``"onednn"`` or ``"native"`` (module docstring): the GEMM that runs this linear; None: neither."""
    if weight is None or not is_cpu(weight) or weight.dim() != 2 or weight.layout != torch.strided:
        return None
    if has_bias and (bias is None or bias.dtype != weight.dtype or bias.shape != (weight.shape[0],)):
        return None
    if weight.dtype in packable_dtypes() and available():
        return "onednn"
    if weight.dtype == torch.bfloat16 and torch.bfloat16 not in packable_dtypes() and native_ops() is not None:
        return "native"
    return None


def _pack(kind: str, weight: torch.Tensor) -> torch.Tensor:
    if kind == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    return native_ops().bf16_linear_pack(weight)


def prepack_linears(graph_module: torch.fx.GraphModule) -> int:
    """Replace every fp32 / bf16 CPU ``aten.linear.default`` of ``graph_module`` (weight, and bias if
    any, read with ``get_attr``) by a GEMM on its weight prepacked now, oneDNN's or the native bf16
    one (module docstring); a weight read by several linears is packed once. Returns how many
    linears were replaced; 0, graph untouched, where neither GEMM applies."""
    graph, packed_names, replaced = graph_module.graph, {}, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.linear.default:
            continue
        args = list(node.args) + [None] * (3 - len(node.args))
        x, weight_node, bias_node = args[0], args[1], node.kwargs.get("bias", args[2])
        weight, bias = attr_tensor(graph_module, weight_node), attr_tensor(graph_module, bias_node)
        kind = _kind(weight, bias, bias_node is not None)
        if kind is None:
            continue
        if weight_node.target not in packed_names:
            name = fresh_attr_name(graph_module, weight_node.target.replace(".", "_") + "_packed")
            with torch.no_grad():
                graph_module.register_buffer(name, _pack(kind, weight.detach()))
            packed_names[weight_node.target] = name
        with graph.inserting_before(node):
            packed = graph.get_attr(packed_names[weight_node.target])
        if kind == "onednn":
            replace_with_call(node, torch.ops.mkldnn._linear_pointwise.default, (x, packed, bias_node, "none", [], ""))
        else:
            replace_with_call(node, native_ops().bf16_linear.default, (x, packed, bias_node, weight.shape[0]))
        graph.erase_node(node)
        replaced += 1
    return finish_rewrite(graph_module, replaced)


def unpack_bf16_weight(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The ``[out_features, K]`` weight of ``bf16_linear_pack``'s panels ``[P, K, C]`` (a copy)."""
    panels, k, cols = packed.shape
    return packed.transpose(1, 2).reshape(panels * cols, k)[:out_features]


def bf16_linear_excess(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       expected: torch.Tensor | None = None) -> float:
    """How far ``got`` is from ``F.linear(x, weight, bias)`` in bf16, over what two fp32 sums of the exact
    products, each rounded once to bf16, may differ by: a bf16 step of the result (2**-7 of it: both
    round) plus ``K`` fp32 rounding steps of the products' absolute sum each. At most 1 when ``got`` is
    such a sum; a wrong GEMM is off by the result's own size. Equal values (infinities too) and NaN where
    ``F.linear`` has NaN count 0; a NaN or infinity elsewhere, infinite. ``expected``: that ``F.linear``
    result where the caller has it."""
    if not got.numel():
        return 0.0
    got, expected = got.float(), (F.linear(x, weight, bias) if expected is None else expected).float()
    magnitude = F.linear(x.float().abs(), weight.float().abs(), None if bias is None else bias.float().abs())
    bound = 2.0 ** -7 * expected.abs() + 2 * weight.shape[1] * 2.0 ** -24 * magnitude + 1e-30
    agree = (got == expected) | (got.isnan() & expected.isnan())
    excess = ((got - expected).abs() / bound).nan_to_num(nan=float("inf"))
    return torch.where(agree, 0.0, excess).max().item()


@contextlib.contextmanager
def native_linears_as_f_linear(graph_module: torch.fx.GraphModule) -> Iterator[list[float]]:
    """While open, each native ``bf16_linear`` call of ``graph_module`` and its submodules (row-chunked
    MLPs) computes both the native GEMM and ``F.linear`` on the unpacked weight, appends the native
    result's :func:`bf16_linear_excess` to the list it yields, and returns ``F.linear``'s: the rest of
    the graph then sees the original linears' values, so that a check of the lowered copy against the
    graph judges its other rewrites as before (a bf16 model's logits move by several times the check's
    tolerance when any GEMM sums in another order: SmolLM2-135M's by 2.3 to 12 of its largest 30 over
    30 layers of random tokens, even with correctly rounded linears), and the GEMM against its own op."""
    native = native_ops()
    excess: list[float] = []
    swapped = []

    def checked_bf16_linear(x, packed, bias, out_features):
        weight = unpack_bf16_weight(packed, out_features)
        expected = F.linear(x, weight, bias)
        excess.append(bf16_linear_excess(native.bf16_linear(x, packed, bias, out_features), x, weight, bias, expected))
        return expected

    for module in graph_module.modules() if native is not None else ():
        if isinstance(module, torch.fx.GraphModule):
            nodes = [n for n in module.graph.nodes if n.target is native.bf16_linear.default]
            for node in nodes:
                node.target = checked_bf16_linear
            if nodes:
                swapped.append((module, nodes))
                module.recompile()
    try:
        yield excess
    finally:
        for module, nodes in swapped:
            for node in nodes:
                node.target = native.bf16_linear.default
            module.recompile()
