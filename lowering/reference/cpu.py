"""The reference target's CPU lowering: a copy of the step graph with the CPU's fastest kernels.

On the CPU, :func:`cpu_step` copies a step graph (parameters shared) and in the copy

* runs fp32 and bf16 linears as GEMMs on weights prepacked once, oneDNN's (bf16 on a CPU where
  oneDNN has no bf16 kernels: the native one)
  (:func:`pagedpack.lowering.reference.cpu_linear.prepack_linears`);
* computes each gated MLP's ``silu(gate) * up`` or ``gelu_tanh(gate) * up`` in one native kernel
  (:func:`pagedpack.lowering.reference.cpu_activation.fuse_gated_activations`);
* runs each MLP a few hundred token rows at a time, which bounds a long prefill step's
  activation memory (:func:`pagedpack.lowering.reference.cpu_mlp.chunk_mlps`);
* applies each rotate-half rotary embedding in one native kernel, without temporaries
  (:func:`pagedpack.lowering.reference.cpu_rotary.fuse_rotary`);
* computes each RMSNorm, and the residual add before it, in one native kernel
  (:func:`pagedpack.lowering.reference.cpu_norm.fuse_rms_norms`);
* reads every weight with one attribute lookup (:func:`pagedpack.passes.graph_attrs.hoist_attrs`);
* drops export's guards and asserts and the dtype conversions that convert nothing (an fp32
  model's norms cast to fp32 and back): each was a dispatch a call;
* splits each attention layer's merged QKV output, applies its rotary embedding and writes its
  cache in one native call (:func:`pagedpack.lowering.reference.cpu_qkv.fuse_qkv_rope_cache`),
  and replaces each chain of views that only regroups dimensions by one ``reshape``
  (:func:`pagedpack.passes.view_chains.collapse_view_chains`);
* calls the native kernels ``torch.ops.pagedpack_cpu.{reshape_and_cache, paged_attention}``
  (:mod:`pagedpack.kernels.native`) directly instead of the ``pagedpack::`` ops that dispatch to
  them, which saves each call the custom op's Python layer (argument checks, mutation
  bookkeeping: tens of microseconds a call, two calls a layer). The native kernels check shapes
  and metadata bounds themselves.

The copy is checked on an example step (prefills, decodes and chunks, random tokens and caches,
more tokens than an MLP row chunk)
against the graph it copied, every sequence's logits within ``1e-4 * (1 + max |logits|)``
(fp32, as ``verify_attention`` checks a site's output; a bf16 / fp16 step within 16 of its dtype's
rounding steps, :data:`LOW_PRECISION_RTOL`); if it differs or does not run, that graph
runs instead and the note says why. The graph copied is a rewritten model's (which stays as it
is: ``LLM.export`` writes it) or the program of a ``.pt2`` export that ``LLM.from_exported``
serves. Measurements: ``docs/cpu-kernels.md``.
"""
from __future__ import annotations

import copy
import warnings

import torch
import torch.fx

from pagedpack.host.devices import is_cpu
from pagedpack.kernels.lora import NATIVE_LORA_DTYPES
from pagedpack.kernels.native import native_ops
from pagedpack.lowering.reference.cpu_activation import fuse_gated_activations
from pagedpack.lowering.reference.cpu_linear import native_linears_as_f_linear, prepack_linears
from pagedpack.lowering.reference.cpu_mlp import CHUNK_ROWS, chunk_mlps
from pagedpack.lowering.reference.cpu_norm import fuse_rms_norms
from pagedpack.lowering.reference.cpu_qkv import fuse_qkv_rope_cache
from pagedpack.lowering.reference.cpu_rotary import fuse_rotary
from pagedpack.passes.cleanup import drop_noop_conversions, strip_export_checks
from pagedpack.passes.graph_attrs import drop_unused_attrs, hoist_attrs, vocab_size
from pagedpack.passes.tensor_parallel import local_graph
from pagedpack.passes.view_chains import collapse_view_chains
from pagedpack.step.metadata import example_lora_inputs, example_metadata, example_state_inputs

FP32_RTOL = 1e-4  # of 1 + the largest |logit|, as verify_attention's fp32 output check
# A bf16 / fp16 step's logits move by several of the dtype's rounding steps whenever a GEMM's row
# count changes its accumulation order (which the row-chunked MLPs and the packed GEMMs do):
# SmolLM2 in bf16, 0.94 against a largest |logit| of 30, ~8 steps of 2**-8. A wrong kernel moves
# them by the logits' own size. Hence 16 of the dtype's steps.
LOW_PRECISION_RTOL = {torch.bfloat16: 16 * 2.0 ** -8, torch.float16: 16 * 2.0 ** -11}
_CHECK_BLOCK_SIZE = 4
# (cached, new) tokens: prefills, decodes and chunks, cut to the model's length limit; one logits row
# each (what the runner asks, and all an exported program takes)
_CHECK_SEQS = [(0, 37), (6, 1), (9, 3), (0, 1), (21, 12), (40, 2)]
# prefills of this many tokens are added until the step is longer than CHUNK_ROWS or than
# _CHECK_MAX_TOKENS (a larger chunk is not exercised by the check)
_CHECK_PREFILL, _CHECK_MAX_TOKENS = 240, 2048


def use_native_kernels(graph_module: torch.fx.GraphModule, lora_specs=()) -> int:
    """Point every ``pagedpack::reshape_and_cache`` / ``paged_attention`` call of ``graph_module`` (and
    ``lora_shrink`` / ``lora_expand``, when every ``lora_specs`` dtype has a native kernel) at the native
    CPU kernel of the same schema; returns how many (0 without native kernels)."""
    native = native_ops()
    if native is None:
        return 0
    ops = torch.ops.pagedpack
    swap = {ops.reshape_and_cache.default: native.reshape_and_cache.default,
            ops.paged_attention.default: native.paged_attention.default}
    if all(spec.dtype in NATIVE_LORA_DTYPES for spec in lora_specs):
        swap.update({ops.lora_shrink.default: native.lora_shrink.default,
                     ops.lora_expand.default: native.lora_expand.default})
    count = 0
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and node.target in swap:
            node.target = swap[node.target]
            count += 1
    if count:
        graph_module.recompile()
    return count


def cpu_step(gm: torch.fx.GraphModule, kv_cache_specs, device: torch.device | str,
             max_model_len: int | None = None, state_specs=(), lora_specs=()) -> tuple[object, str | None]:
    """``(program, note)``: the step program the reference target runs on ``device`` for the step
    graph ``gm`` (a rewritten model's, or a loaded ``.pt2`` program's ``.module()``) with caches
    ``kv_cache_specs``, and what was lowered; the example step it is checked on stays within
    ``max_model_len`` tokens a sequence (a learned position table may have no more rows). Off the
    CPU, or with nothing to lower, ``gm`` itself (note None)."""
    if not is_cpu(device):
        return gm, None
    with warnings.catch_warnings():  # torch's own deprecation, copying a loaded program's pytree specs
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        graph = copy.deepcopy(gm.graph)
    lowered = torch.fx.GraphModule(gm, graph)
    strip_export_checks(lowered)  # a loaded .pt2's guards and asserts: the runner builds the inputs
    conversions = drop_noop_conversions(lowered)
    linears = prepack_linears(lowered)
    activations = fuse_gated_activations(lowered)  # before the chunking: the fused call joins the MLP's region
    mlps = chunk_mlps(lowered, CHUNK_ROWS)
    rotary = fuse_rotary(lowered)
    norms, fused_adds = fuse_rms_norms(lowered)
    hoist_attrs(lowered)  # one attribute lookup a weight, not one a path component
    drop_unused_attrs(lowered)  # the plain weights the packed ones replaced, the paths hoisted from
    kernels = use_native_kernels(lowered, lora_specs)
    qkv = fuse_qkv_rope_cache(lowered)  # on the native rotary and cache-write calls
    views = collapse_view_chains(lowered)
    if not any((linears, activations, mlps, rotary, norms, kernels, qkv, views)):
        return gm, None
    done = (f"{linears} linears as GEMMs on weights prepacked once, "
            f"{activations} silu / gelu_tanh(gate) * up fused, {mlps} MLPs run {CHUNK_ROWS} token rows at a time, "
            f"{rotary} rotary embeddings fused, "
            f"{norms} RMSNorms as native kernels ({fused_adds} with their residual add), "
            f"{kernels} attention/cache/LoRA ops as native kernel calls, "
            f"{qkv} QKV splits with their rotary embedding and cache write in one call, "
            f"{views} view chains as one reshape, {conversions} conversions that convert nothing dropped")
    reason = _check(gm, lowered, kv_cache_specs, max_model_len, state_specs, lora_specs)
    if reason:
        return gm, f"cpu lowering: kept the graph as it was; its lowered copy ({done}) {reason}"
    return lowered, f"cpu lowering: {done}"


def _check(reference: torch.fx.GraphModule, lowered: torch.fx.GraphModule, kv_cache_specs,
           max_model_len: int | None, state_specs=(), lora_specs=()) -> str | None:
    """None if ``lowered`` computes ``reference``'s logits on an example step (random tokens and
    caches, zeroed recurrent states, random LoRA adapters, sequences of at most ``max_model_len`` tokens) to
    :data:`FP32_RTOL` (bf16 / fp16 logits: :data:`LOW_PRECISION_RTOL`); else what differs."""
    limit = max_model_len or max(c + q for c, q in _CHECK_SEQS)
    q_lens = [min(q, limit) for _, q in _CHECK_SEQS]
    context_lens = [min(c, limit - q) for (c, _), q in zip(_CHECK_SEQS, q_lens)]
    while sum(q_lens) <= min(CHUNK_ROWS, _CHECK_MAX_TOKENS):  # a step of more than one MLP row chunk
        q_lens.append(min(_CHECK_PREFILL, limit))
        context_lens.append(0)
    num_blocks = sum(-(-(q + c) // _CHECK_BLOCK_SIZE) for q, c in zip(q_lens, context_lens))
    batch = example_metadata(q_lens, context_lens, block_size=_CHECK_BLOCK_SIZE, num_blocks=num_blocks)
    g = torch.Generator().manual_seed(0)
    inputs = list(batch._replace(input_ids=torch.randint(0, vocab_size(reference), (batch.num_tokens,), generator=g)))
    caches = [torch.randn(shape, generator=g).to(spec.dtype) for spec in kv_cache_specs
              for shape in spec.cache_shapes(num_blocks, _CHECK_BLOCK_SIZE)]
    caches += example_state_inputs(state_specs, context_lens)  # the states' metadata, then the states
    caches += example_lora_inputs(lora_specs, q_lens)  # random adapters in some sequences' slots
    results = []
    # a tensor-parallel rank's graphs without their all-reduces: the other ranks would not join them
    with native_linears_as_f_linear(lowered) as linear_excess:
        programs = (("the graph itself", local_graph(reference)), ("the lowered copy", local_graph(lowered)))
        for which, program in programs:
            try:
                with torch.no_grad():
                    results.append(program(*inputs, *(c.clone() for c in caches)))
            except Exception as err:  # noqa: BLE001 -- whatever fails, the graph is served as it was
                return f"was not checked: the example step fails on {which} ({type(err).__name__}: {str(err)[:160]})"
    if linear_excess and max(linear_excess) > 1:
        return (f"has a native bf16 linear off its F.linear by {max(linear_excess):.3g} times the bound of two "
                f"fp32 sums rounded to bf16 on an example step")
    expected, got = results
    if got.shape != expected.shape:
        return f"returns logits of shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    diff = (got.double() - expected.double()).abs().max().item()
    tolerance = LOW_PRECISION_RTOL.get(expected.dtype, FP32_RTOL) * (1 + expected.abs().max().item())
    return None if diff <= tolerance else f"differs by {diff:.3g} (tolerance {tolerance:.3g}) on an example step"
