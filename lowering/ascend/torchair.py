"""``torch.compile`` on Ascend: the ascend lowering, then TorchAir.

The pagedpack rewrite runs first, at capture (:func:`pagedpack.passes.pipeline.rewrite`): it adds
the metadata and cache inputs, which a ``torch.compile`` backend cannot do (its compiled callable
must take the inputs dynamo traced). Compile the rewritten step graph with :func:`ascend_backend`::

    step = compile_step(rewritten.graph_module, ascend_backend(max_num_tokens=2048, max_num_seqs=256))

The backend lowers the ``pagedpack`` ops of the graph dynamo hands it
(:func:`pagedpack.lowering.ascend.lower_to_ascend`) and passes the result to
``torchair.get_npu_backend(compiler_config=...)``. ``LLM(..., target="ascend")``
(:class:`pagedpack.lowering.ascend.target.AscendTarget`) lowers at construction instead (so a
refused model fails there, not at the first step), then compiles the lowered graph with
TorchAir's backend. torch_npu and TorchAir are
imported only when an NPU is used.
"""
from __future__ import annotations

from typing import Callable

import torch

from pagedpack.lowering.ascend.lower import AscendOps, import_torchair, lower_to_ascend, npu_ops
from pagedpack.lowering.targets import StepBounds
from pagedpack.step.contract import METADATA_INPUTS


def production_config(torchair):
    """``torchair.CompilerConfig()`` as production inference sets it: ``frozen_parameter`` (weights
    are graph constants: no per-step address refresh), as vllm-ascend's TorchAir model runner and
    cann-recipes-infer do."""
    config = torchair.CompilerConfig()
    config.experimental_config.frozen_parameter = True
    return config


def _option(config, name: str):
    """A TorchAir option's value (options are ``OptionValue`` objects holding ``.value``)."""
    option = getattr(config, name, None)
    return getattr(option, "value", option)


def torchair_backend(compiler_config=None) -> Callable:
    """``torchair.get_npu_backend`` in max-autotune (GE) mode, the only mode that runs
    ``torch.ops.air.npu_fused_infer_attention_score`` (torchair/ops/_npu_fused_infer_attention_score.py)
    and the one TND allows (reduce-overhead is not supported for TND: _op_plugin_docs.py,
    npu_fused_infer_attention_score_v2, TND limits). Default config: :func:`production_config`.
    Operators compile from the installed binaries (``torch.npu.set_compile_mode(jit_compile=False)``,
    as production does; it applies to the whole process).

    ``ValueError`` for another mode, or for ``experimental_config.tiling_schedule_optimize``
    (tiling sink), which TorchAir documents as unsupported with the TND layout."""
    torchair = import_torchair()
    config = compiler_config or production_config(torchair)
    if _option(config, "mode") != "max-autotune":
        raise ValueError(f"compiler_config.mode: expected 'max-autotune' (the tensor-length FIA op runs only "
                         f"there), got {_option(config, 'mode')!r}")
    if _option(getattr(config, "experimental_config", None), "tiling_schedule_optimize"):
        raise ValueError("compiler_config.experimental_config.tiling_schedule_optimize: tiling sink is not "
                         "supported with the TND layout every attention call of this lowering uses; turn it off")
    set_compile_mode = getattr(getattr(torch, "npu", None), "set_compile_mode", None)
    if set_compile_mode is not None:
        set_compile_mode(jit_compile=False)
    return torchair.get_npu_backend(compiler_config=config)


def ascend_backend(*, max_num_tokens: int, max_num_seqs: int, compiler_config=None, ops: AscendOps | None = None,
                   npu_backend: Callable | None = None) -> Callable:
    """A ``torch.compile`` backend for rewritten step graphs on Ascend.

    ``max_num_tokens`` / ``max_num_seqs`` bound every step (the TND limits depend on them).
    ``ops`` defaults to the real torch_npu/TorchAir ops and ``npu_backend`` to
    :func:`torchair_backend` (``compiler_config``); tests pass the emulation and a recorder.
    """
    bounds = StepBounds(max_num_tokens, max_num_seqs)

    def backend(gm: torch.fx.GraphModule, example_inputs):
        lower_to_ascend(gm, example_inputs, ops=ops or npu_ops(), bounds=bounds)
        return (npu_backend or torchair_backend(compiler_config))(gm, example_inputs)

    return backend


def compile_step(step_graph: torch.fx.GraphModule, backend: Callable) -> Callable:
    """``torch.compile`` a step graph so that one graph serves every batch composition.

    Caches and weights stay static; every dimension of the metadata inputs (``T``, ``B``,
    ``max_blocks_per_seq``) is marked dynamic on each call. (``dynamic=True`` would also make the
    cache dimensions symbolic, and dynamo's duck sizing can tie ``B`` to a cache dimension of the
    same size and specialise it.) Dimensions of size 0 or 1 are still specialised by dynamo, so a
    step with ``B == 1`` or ``T == 1`` gets its own graph.
    """
    compiled = torch.compile(step_graph, backend=backend, dynamic=False, fullgraph=True)

    def step(*inputs):
        for tensor in inputs[: len(METADATA_INPUTS)]:
            for dim in range(tensor.dim()):
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
        return compiled(*inputs)

    return step
