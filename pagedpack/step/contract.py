"""The step program's contract: what the rewrite produces and what the runtime calls.

A leaf module (it imports nothing of pagedpack): the passes, the lowerings, the exporters and
the runtime all meet here and nowhere else. A *step program* runs one packed, paged step::

    program(input_ids [T] int64, positions [T] int64, cu_seqlens_q [B+1] int32,
            seq_lens [B] int32, block_table [B, max_blocks_per_seq] int32,
            slot_mapping [T] int64, logits_indices [R] int64,
            key_cache_0, value_cache_0, ..., key_cache_{L-1}, value_cache_{L-1})
        -> logits [R, vocab]                          (in-place programs: caches written in place)
        -> (logits [R, vocab], *updated caches)       (functional programs, e.g. ONNX)

``R`` logits rows: each sequence's last (``B``), then the prompt rows of the requests asking for
``prompt_logprobs`` (:mod:`pagedpack.runtime.prompt_logprobs`); a program that takes ``R == B`` only
says why in ``one_logits_row_per_seq`` (:class:`LoweredStep`).

Caches are ``[num_blocks, block_size, num_kv_heads, head_size]`` (docs/design.md, "Terms"), one pair per
layer that owns one: a layer attending over an earlier layer's K/V reads that layer's pair (KV sharing,
:mod:`pagedpack.passes.kv_sharing`), so ``L`` counts the owner layers.

A program with recurrent layers (``state_specs``, :class:`StateSpec`) takes, after its KV caches,
``state_indices [B] int32, has_initial_state [B] bool`` and one state tensor per spec,
``[num_slots, *spec.shape]``, written in place (``conv_state_0, ...``; :func:`state_input_names`):
sequence ``b`` continues from and writes slot ``state_indices[b]`` (:mod:`pagedpack.kernels.recurrent`).

A program with LoRA (``lora_specs``, :class:`LoRASpec`, :mod:`pagedpack.passes.lora`) takes, last,
``lora_indices [T] int32`` (each token's adapter slot, ``-1``: the base model) and, per spec, the slots'
stacked adapter weights ``lora_a_i [max_loras, S * max_rank, in_features]`` and
``lora_b_i [max_loras, out_features, max_rank]`` (:func:`lora_input_names`): the linear's output gains
``(x A_slot^T) B_slot^T`` per slice (:mod:`pagedpack.kernels.lora`; the scaling is folded into B).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

METADATA_INPUTS = ("input_ids", "positions", "cu_seqlens_q", "seq_lens", "block_table",
                   "slot_mapping", "logits_indices")


STATE_INPUTS = ("state_indices", "has_initial_state")


def cache_input_names(num_layers: int, suffix: str = "") -> list[str]:
    """``key_cache_0, value_cache_0, key_cache_1, ...`` (with ``suffix``: ``key_cache_out_0``, ...)."""
    return [f"{kind}_cache{suffix}_{i}" for i in range(num_layers) for kind in ("key", "value")]


# Cache dtypes whose rows carry a scale: each (token, KV head) row holds its head_size quantized
# values, then its fp32 scale in the row's last KV_SCALE_BYTES elements (one byte each), so the
# value is ``values * scale`` (docs/design.md, "Quantized KV").
SCALED_KV_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
KV_SCALE_BYTES = 4


def kv_row_size(head_size: int, dtype: torch.dtype) -> int:
    """Elements of one (token, KV head) row of a cache of ``dtype``: the head, plus its scale if scaled."""
    return head_size + (KV_SCALE_BYTES if dtype in SCALED_KV_DTYPES else 0)


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape and dtype of one layer's cache pair, read off the captured K/V tensors (``dtype``: the
    caches' dtype, the model's unless ``kv_cache_dtype`` chose another; a :data:`SCALED_KV_DTYPES`
    cache's rows carry their scale)."""

    num_kv_heads: int
    key_head_size: int
    value_head_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K plus V for one token in this layer (scales included)."""
        rows = kv_row_size(self.key_head_size, self.dtype) + kv_row_size(self.value_head_size, self.dtype)
        return self.num_kv_heads * rows * self.dtype.itemsize

    def cache_shapes(self, num_blocks: int, block_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(key_cache shape, value_cache shape)`` in the NHD block layout."""
        return ((num_blocks, block_size, self.num_kv_heads, kv_row_size(self.key_head_size, self.dtype)),
                (num_blocks, block_size, self.num_kv_heads, kv_row_size(self.value_head_size, self.dtype)))


def indexer_cache_spec(index_head_dim: int, dtype: torch.dtype) -> KVCacheSpec:
    """The cache of a sparse-attention layer's lightning indexer (DeepSeek-V3.2, GLM-MoE-DSA): one
    key row of ``index_head_dim`` per token and no value (``value_head_size`` 0), paged by the same
    blocks and slots as the layer's K/V, as vLLM's ``DeepseekV32IndexerCache`` is one more (key-only)
    cache of the KV manager. It takes one cache pair of the step signature like any layer's: the key
    cache ``[num_blocks, block_size, 1, index_head_dim]`` and an empty value cache
    (:mod:`pagedpack.kernels.sparse_attention`)."""
    return KVCacheSpec(num_kv_heads=1, key_head_size=index_head_dim, value_head_size=0, dtype=dtype)


# The kinds of recurrent state, each with the rank of its per-sequence shape (:class:`StateSpec`).
STATE_KINDS = {"conv_state": 2, "ssm_state": 3}


@dataclass(frozen=True)
class StateSpec:
    """One recurrent state tensor of one layer: ``kind`` (:data:`STATE_KINDS`; ``"conv_state"``: a
    causal conv's last ``width - 1`` inputs, ``[dim, width - 1]``; ``"ssm_state"``: a scan's,
    ``[heads, key or head dim, value or state dim]``), its per-sequence ``shape`` (the slot dimension
    left out) and ``dtype``; the ``layer`` it belongs to (the module path, for reports and refusals)."""

    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    layer: str = ""

    @property
    def bytes_per_slot(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def state_shape(self, num_slots: int) -> tuple[int, ...]:
        return (num_slots, *self.shape)


def state_input_names(specs: Sequence[StateSpec]) -> list[str]:
    """``conv_state_0, conv_state_1, ssm_state_2, ...``: the state inputs, numbered over all specs."""
    return [f"{spec.kind}_{i}" for i, spec in enumerate(specs)]


LORA_INDICES = "lora_indices"


@dataclass(frozen=True)
class LoRASpec:
    """One linear of the step graph that LoRA adapters may augment: a projection, or a merged one
    (``merge_linears``: QKV, gate-up) whose ``S = len(modules)`` slices each take their own adapter
    pair. ``modules``: the ``transformers`` module path of each slice (``model.layers.0.self_attn.q_proj``,
    as PEFT names them); ``slice_sizes``: each slice's output features, in the linear's output order;
    ``dtype``: the adapter weights' (the linear weight's)."""

    modules: tuple[str, ...]
    in_features: int
    slice_sizes: tuple[int, ...]
    dtype: torch.dtype

    @property
    def out_features(self) -> int:
        return sum(self.slice_sizes)

    def a_shape(self, max_loras: int, max_rank: int) -> tuple[int, int, int]:
        """``lora_a``: each slot's A of every slice stacked along the rank, ``[max_loras, S * max_rank, in]``."""
        return (max_loras, len(self.modules) * max_rank, self.in_features)

    def b_shape(self, max_loras: int, max_rank: int) -> tuple[int, int, int]:
        """``lora_b``: each slot's B of every slice stacked along the output, ``[max_loras, out, max_rank]``."""
        return (max_loras, self.out_features, max_rank)


def lora_input_names(specs: Sequence[LoRASpec]) -> list[str]:
    """``lora_indices, lora_a_0, lora_b_0, lora_a_1, ...``: the LoRA inputs (none without specs)."""
    return [LORA_INDICES, *(f"lora_{kind}_{i}" for i in range(len(specs)) for kind in "ab")] if specs else []


def step_input_names(num_layers: int, state_specs: Sequence[StateSpec] = (),
                     lora_specs: Sequence[LoRASpec] = ()) -> list[str]:
    """Every input of a step program, in order (module docstring): the metadata, the cache pairs of
    ``num_layers`` layers, then, with ``state_specs``, the state metadata and the states, then, with
    ``lora_specs``, the LoRA inputs."""
    states = [*STATE_INPUTS, *state_input_names(state_specs)] if state_specs else []
    return [*METADATA_INPUTS, *cache_input_names(num_layers), *states, *lora_input_names(lora_specs)]


def state_layers(specs: Sequence[StateSpec]) -> str:
    """The layers of ``specs``, once each, for messages: ``"model.layers.0.conv, model.layers.2.conv"``."""
    return ", ".join(dict.fromkeys(spec.layer for spec in specs))


def state_bytes_per_seq(program) -> int:
    """Recurrent-state bytes one sequence's slot takes over all of ``program``'s ``state_specs`` (0 without)."""
    return sum(spec.bytes_per_slot for spec in getattr(program, "state_specs", ()))


def bytes_per_token(specs: Sequence[KVCacheSpec]) -> int:
    """KV-cache bytes one token takes over all cache pairs of ``specs``."""
    return sum(spec.bytes_per_token for spec in specs)


class UnsupportedModelError(ValueError):
    """pagedpack cannot rewrite the model: ``reason`` says why (a capture failure, or the pass
    report with each refused site); ``report`` is that pass report, if the passes ran."""

    def __init__(self, reason: str, report=None):
        super().__init__("pagedpack cannot rewrite this model:\n" + reason)
        self.report = report


@runtime_checkable
class StepProgram(Protocol):
    """Anything that runs a step with the signature of the module docstring.

    ``kv_cache_specs``: one :class:`KVCacheSpec` per cache pair (per layer owning one), in cache-input order.
    ``state_specs`` (optional attribute, default none): the recurrent states, in state-input order.
    ``lora_specs`` (optional attribute, default none): the LoRA-augmented linears, in LoRA-input order.
    ``functional``: False if the program writes the caches in place and returns the logits
    alone; True if it returns ``(logits, *updated caches)``, which replace the caller's caches.
    """

    kv_cache_specs: Sequence[KVCacheSpec]
    functional: bool

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]: ...


@dataclass
class ModelDescription:
    """What serving a step program needs besides the program, and what an export stores.

    ``eos_token_ids``: every id generation stops on (0 is a valid id); ``max_model_len``: most
    tokens per request (None: unknown); ``vocab_size``: logits width (None: read it off the
    program); ``model_name``: where the weights came from; ``tokenizer``: a ``transformers``
    tokenizer or None (token-id prompts only).
    """

    eos_token_ids: list[int] = field(default_factory=list)
    max_model_len: int | None = None
    vocab_size: int | None = None
    model_name: str | None = None
    tokenizer: object | None = None


@dataclass
class LoweredStep:
    """A :class:`StepProgram` made by a target (``Target.lower``) or loaded from a file (a
    ``FileFormat``'s ``load``): ``run`` called with the step signature, plus the report line saying
    what was lowered to what and the model's ``description`` (set by whoever built or loaded it)."""

    run: Callable
    kv_cache_specs: list[KVCacheSpec]
    functional: bool = False
    state_specs: list[StateSpec] = field(default_factory=list)
    lora_specs: list[LoRASpec] = field(default_factory=list)
    note: str | None = None
    graphs: object | None = None  # what the graph mode did (a GraphStats with describe()), if any
    padding_blocks: int = 0  # KV blocks the runner allocates beyond the pool for padding writes
    # run uses nothing of the rewritten model's graph (a lowered copy, another runtime's session):
    # the LLM may let the rewritten model and the source model go (their shared tensors aside)
    standalone: bool = False
    description: ModelDescription | None = None
    # None: ``logits_indices`` may hold any rows (prompt_logprobs asks for more than one per sequence);
    # else why the program takes exactly one per sequence (the error refusing prompt_logprobs says it)
    one_logits_row_per_seq: str | None = None

    def __call__(self, *inputs: torch.Tensor):
        return self.run(*inputs)
