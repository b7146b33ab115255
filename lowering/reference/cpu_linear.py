"""fp32 and bf16 linears on the CPU as oneDNN GEMMs on weights prepacked once.

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

import functools
import os

import torch
import torch.fx

from pagedpack.host.devices import is_cpu
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


def _packable(weight: torch.Tensor | None, bias: torch.Tensor | None, has_bias: bool) -> bool:
    if weight is None or weight.dtype not in packable_dtypes() or not is_cpu(weight) or weight.dim() != 2:
        return False
    if weight.layout != torch.strided:
        return False
    if has_bias:
        return bias is not None and bias.dtype == weight.dtype and bias.shape == (weight.shape[0],)
    return True


def prepack_linears(graph_module: torch.fx.GraphModule) -> int:
    """Replace every fp32 / bf16 CPU ``aten.linear.default`` of ``graph_module`` (weight, and bias if
    any, read with ``get_attr``) by oneDNN's linear on its weight prepacked now (module
    docstring); a weight read by several linears is packed once. Returns how many linears were
    replaced; 0, graph untouched, without oneDNN."""
    if not available():
        return 0
    graph, packed_names, replaced = graph_module.graph, {}, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.linear.default:
            continue
        args = list(node.args) + [None] * (3 - len(node.args))
        x, weight_node, bias_node = args[0], args[1], node.kwargs.get("bias", args[2])
        weight, bias = attr_tensor(graph_module, weight_node), attr_tensor(graph_module, bias_node)
        if not _packable(weight, bias, bias_node is not None):
            continue
        if weight_node.target not in packed_names:
            name = fresh_attr_name(graph_module, weight_node.target.replace(".", "_") + "_packed")
            with torch.no_grad():
                graph_module.register_buffer(name, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None))
            packed_names[weight_node.target] = name
        with graph.inserting_before(node):
            packed = graph.get_attr(packed_names[weight_node.target])
        replace_with_call(node, torch.ops.mkldnn._linear_pointwise.default, (x, packed, bias_node, "none", [], ""))
        graph.erase_node(node)
        replaced += 1
    return finish_rewrite(graph_module, replaced)
