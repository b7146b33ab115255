"""The model an ``LLM`` serves: loaded from what ``EngineArgs.model`` names, described, captured
and rewritten. The capture side (``transformers``' modeling code, capture, the passes) is imported
inside the functions, so importing this module costs a serving process nothing."""
from __future__ import annotations

import torch

from pagedpack.engine_args import EngineArgs
from pagedpack.inputs import check_causal_lm
from pagedpack.step.contract import ModelDescription


def capture_source(args: EngineArgs) -> tuple[torch.nn.Module, ModelDescription, object]:
    """``(module, description, rewritten)``: ``args.model`` loaded (:func:`load_source`),
    described (eos ids, ``max_model_len``, tokenizer) and captured and rewritten (a
    :class:`~pagedpack.passes.pipeline.RewrittenModel`, whose report notes the description's
    caveat); refused sites are not raised here (``rewritten.raise_if_refused()``)."""
    module, description, note = describe_source(args)
    rewritten = rewrite_module(module, args)
    if note:
        rewritten.report.notes.append(note)
    return module, description, rewritten


def describe_source(args: EngineArgs) -> tuple[torch.nn.Module, ModelDescription, str | None]:
    """``(module, description, note)``: ``args.model`` loaded (:func:`load_source`) and described
    (eos ids, ``max_model_len``, tokenizer; ``note``: the description's caveat, or None)."""
    from pagedpack.models.loading import describe_model

    module, tokenizer = load_source(args)
    description, note = describe_model(module, tokenizer)
    return module, description, note


def rewrite_module(module: torch.nn.Module, args: EngineArgs):
    """``module`` captured and rewritten with ``args.extra_passes`` and, with ``args.enable_lora``, its
    linears given LoRA inputs (:mod:`pagedpack.passes.lora`): a
    :class:`~pagedpack.passes.pipeline.RewrittenModel`; refused sites are in its report, not raised."""
    from pagedpack.models.capture import capture
    from pagedpack.passes.pipeline import rewrite

    rewritten = rewrite(capture(module), extra_passes=args.extra_passes)
    if args.enable_lora and rewritten.ok:
        from pagedpack.passes.lora import add_lora

        rewritten.lora_specs = add_lora(rewritten.graph_module, module)
        slices = sum(len(spec.modules) for spec in rewritten.lora_specs)
        rewritten.report.notes.append(f"lora: {len(rewritten.lora_specs)} linears take LoRA adapters "
                                      f"({slices} module projections)")
    return rewritten


def load_source(args: EngineArgs, *, model=None) -> tuple[torch.nn.Module, object]:
    """``(module, tokenizer)``: the caller's module (moved and cast in place; tokenizer None) or
    the model ``model`` (default ``args.model``) names, loaded for ``args.device`` / ``args.dtype``."""
    from pagedpack.models.loading import load

    if isinstance(args.model, torch.nn.Module):
        check_causal_lm(args.model)  # before moving it: the caller's module is converted in place
        return args.model.to(device=args.device, dtype=args.dtype).eval(), None
    builtin = args.lowering_target.builtin_model
    module, tokenizer = load(model or args.model, dtype=args.dtype, device=args.device, builtin=builtin)
    check_causal_lm(module)
    return module, tokenizer
