"""The limits an attention site must meet for the ``ascend`` lowering's FIA call, each with its source.

The lowering has one form (see :mod:`pagedpack.lowering.ascend.lower`): a single
``npu_fused_infer_attention_score`` (FIA) call per site over the whole packed step, in TND, paged,
``sparse_mode=3`` (or, for a sliding window, the band ``sparse_mode=4`` over the step plus one
two-row dummy sequence). Every limit below is quoted from the torch-npu 2.13.0 wheel,
``torch_npu/_op_plugin_docs.py``: entry "npu_fused_infer_attention_score" (cited ``FIA``) and entry
"npu_fused_infer_attention_score_v2" (cited ``FIA_V2``). Both entries lower to the same GE op,
FusedInferAttentionScore (``torchair/ops/_npu_fused_infer_attention_score.py`` and ``..._v2.py``),
so the v2 entry's detailed TND section is read as describing the kernel the lowering calls.
Where production code and its bug trackers say more than the docs, that is cited instead
(:data:`MHA_64`, :data:`PRODUCTION_BLOCK_SIZES`); block sizes the docs allow but production has
not run are allowed with a warning (:func:`unverified`).

Why no fallback form: the B-layouts (BSH/BSND/BNSD) accept float16 and other head sizes, but a
packed step would have to be padded to ``[B, max query length, ...]``, a size no graph input
carries; one batch entry per token (S = 1) breaks the page-attention rule that blocknum be at
least the blocks of all batch entries together. So a site outside these limits is refused.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from pagedpack.lowering.targets import StepBounds

FIA = "_op_plugin_docs.py, npu_fused_infer_attention_score"
FIA_V2 = "_op_plugin_docs.py, npu_fused_infer_attention_score_v2"
MHA_64 = "vllm-ascend issue #9632: the current kernel takes head_dim 64 when num_heads == num_key_value_heads"
PRODUCTION_BLOCK_SIZES = "vllm-ascend's supported kernel block sizes for this attention: [128]"
VERIFIED_BLOCK_SIZE = 128
MAX_GQA_RATIO = 64
MAX_HEADS = 256
MAX_TND_TOKENS = 65536
MAX_TND_SEQS = 4096
WINDOW_DUMMY_ROWS = 2  # query rows of the dummy sequence a windowed site appends (Q_S > 1: the band applies)


class AscendLoweringError(ValueError):
    """An attention site the Ascend ops cannot serve; the message cites each violated limit."""


@dataclass(frozen=True)
class AttentionShape:
    """What one attention site looks like to FIA (caches are ``[num_blocks, block_size, Hkv, D]``),
    with the site's attention parameters (:class:`pagedpack.kernels.attention_params.AttentionParams`;
    the tensor ones only as whether they are set)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    value_head_dim: int
    dtype: torch.dtype
    block_size: int
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    alibi: bool = False
    sinks: bool = False
    attention_chunk_size: int | None = None


def violations(s: AttentionShape, b: StepBounds) -> list[str]:
    """Every documented limit ``s`` and ``b`` break, each with its source."""
    dtype = str(s.dtype).removeprefix("torch.")
    out = []
    if s.dtype != torch.bfloat16:
        out.append(f"dtype {dtype}: TND supports bfloat16 only [{FIA}, TND limits; {FIA_V2}, TND limits]; "
                   "serve the model in bfloat16 (dtype='bfloat16')")
    mha = s.num_heads == s.num_kv_heads
    if s.value_head_dim == 192:
        out.append(f"value head_dim 192: not supported with paging or grouped-query attention "
                   f"[{FIA_V2}, TND limits (newest revision)]")
    elif not (s.head_dim == 128 or (s.head_dim == 64 and mha) or s.head_dim == 192):
        out.append(f"head_dim={s.head_dim}: TND needs 128, or 64 without grouped-query heads "
                   f"(num_heads={s.num_heads}, num_key_value_heads={s.num_kv_heads}) "
                   f"[{FIA_V2}, TND limits; {MHA_64}]")
    if s.head_dim != s.value_head_dim:
        out.append(f"key head_dim {s.head_dim} != value head_dim {s.value_head_dim}: paged key and value caches "
                   f"must have the same shape [{FIA}, constraints, page attention]")
    if s.num_heads % s.num_kv_heads:
        out.append(f"num_heads={s.num_heads} is not divisible by num_key_value_heads={s.num_kv_heads} "
                   f"[{FIA}, parameter num_key_value_heads]")
    elif s.num_heads // s.num_kv_heads > MAX_GQA_RATIO:
        out.append(f"grouped-query ratio {s.num_heads // s.num_kv_heads} exceeds {MAX_GQA_RATIO} "
                   f"[{FIA}, parameter num_key_value_heads; {FIA_V2}, TND limits]")
    if s.num_heads > MAX_HEADS:
        out.append(f"num_heads={s.num_heads} exceeds {MAX_HEADS} [{FIA}, constraints Q_S > 1]")
    if not (128 <= s.block_size <= 512 and s.block_size % 128 == 0):
        out.append(f"block_size={s.block_size}: paged attention with multi-token queries needs 128..512, a "
                   f"multiple of 128 [{FIA}, constraints Q_S > 1, page attention]")
    # A windowed site appends a dummy sequence of WINDOW_DUMMY_ROWS rows (see pagedpack.lowering.ascend.lower).
    windowed = s.sliding_window is not None
    tokens = b.max_num_tokens + (WINDOW_DUMMY_ROWS if windowed else 0)
    seqs = b.max_num_seqs + (1 if windowed else 0)
    dummy = " with the sliding window's dummy sequence" if windowed else ""
    if tokens > MAX_TND_TOKENS:
        out.append(f"max_num_tokens={b.max_num_tokens} ({tokens} rows{dummy}): TND needs T <= {MAX_TND_TOKENS} "
                   f"[{FIA}, TND limits]")
    if seqs > MAX_TND_SEQS:
        out.append(f"max_num_seqs={b.max_num_seqs} ({seqs} sequences{dummy}): TND takes at most {MAX_TND_SEQS} "
                   f"sequence lengths [{FIA_V2}, TND limits]")
    out.extend(parameter_violations(s))
    return out


def unverified(s: AttentionShape) -> list[str]:
    """What the docs allow but production has not run: allowed, with a warning naming the evidence."""
    out = []
    if s.block_size != VERIFIED_BLOCK_SIZE and 128 <= s.block_size <= 512 and s.block_size % 128 == 0:
        out.append(f"block_size={s.block_size}: allowed by the docs [{FIA}, constraints Q_S > 1, page attention], "
                   f"but production runs {VERIFIED_BLOCK_SIZE} only [{PRODUCTION_BLOCK_SIZES}]")
    return out


def parameter_violations(s: AttentionShape) -> list[str]:
    """The attention parameters FIA (v1 or v2) cannot compute, each named with its documented reason."""
    out = []
    if s.logits_soft_cap is not None:
        out.append(f"logits_soft_cap={s.logits_soft_cap}: FIA computes softmax(scale*(query*key)+atten_mask)*value "
                   f"and has no soft-capping (tanh) of the scores [{FIA}, 计算公式 (formula) and parameters]")
    if s.alibi:
        out.append(f"alibi_slopes: FIA's only score bias is pse_shift, and the TND layout does not support pse "
                   f"[{FIA}, parameter input_layout: TND (不支持...pse...)]")
    if s.sinks and s.value_head_dim > 128:
        out.append(f"sinks with value head_dim {s.value_head_dim}: FIA v2's learnable_sink needs value head_dim "
                   f"<= 128 [{FIA_V2}, learnable_sink constraints]")
    if s.attention_chunk_size is not None:
        out.append(f"attention_chunk_size={s.attention_chunk_size}: FIA's masks are causal or a band of "
                   f"pre_tokens/next_tokens around each row (sparse_mode 0-4), and a chunk's first key moves with "
                   f"the row's chunk, which no mode expresses [{FIA}, parameter sparse_mode]")
    return out


class AscendUnverifiedWarning(UserWarning):
    """A configuration the docs allow but production code has not been seen to run."""


def check_supported(shape: AttentionShape, bounds: StepBounds) -> None:
    """Raise :class:`AscendLoweringError` listing every limit ``shape``/``bounds`` break; warn
    (:class:`AscendUnverifiedWarning`) for each :func:`unverified` choice."""
    for note in unverified(shape):
        warnings.warn(f"ascend lowering: {note}", AscendUnverifiedWarning, stacklevel=2)
    broken = violations(shape, bounds)
    if broken:
        mode = "sparse_mode=4 band" if shape.sliding_window is not None else "sparse_mode=3"
        raise AscendLoweringError(f"npu_fused_infer_attention_score (TND, paged, {mode}) cannot serve this "
                                  f"attention ({shape}):\n  " + "\n  ".join(broken))
