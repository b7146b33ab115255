"""Memory planning from the step graph's symbolic shapes (``pagedpack plan``, ``LLM(memory_budget=...)``).

A budget of ``memory`` bytes holds the weights, one step's activations and the KV pool:

    memory >= weights + activation_peak(T, B) + state_bytes_per_seq * max_num_seqs + draft_bytes
              + kv_bytes_per_token * block_size * num_blocks

``activation_peak`` is the sympy expression of :mod:`pagedpack.passes.activation_memory` (peak
live bytes of one step of ``T`` tokens over ``B`` sequences); ``kv_bytes_per_token`` is
``sum over layers of (num_kv_heads * (key_head_size + value_head_size) * itemsize)``. A step never
has more than ``T = max_num_batched_tokens`` tokens or ``B = min(T, max_num_seqs)`` sequences, so
the plan charges ``activation_peak`` there. A model with recurrent layers also holds a state slot per
sequence (``state_bytes_per_seq``: its conv and SSM states, :class:`pagedpack.step.contract.StateSpec`),
``max_num_seqs`` of them, whatever their lengths; a state-space model without attention has no KV
(its blocks are bookkeeping only: :func:`bookkeeping_blocks`). With a draft model (speculative
decoding), its KV takes the pool's blocks beside the target's (``kv_bytes_per_token`` is both
models'), and its weights and proposal scratch blocks are ``draft_bytes``
(:class:`pagedpack.compiler.program.Draft`; its steps run after the target's, so the target's
``activation_peak`` is charged, not the sum). This is what vLLM does by profiling one dummy step of
``max_num_batched_tokens`` before sizing its pool (``gpu_memory_utilization``); here it is read off
the graph instead of measured.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import sympy
import torch

from pagedpack.host.devices import is_cpu
from pagedpack.passes.activation_memory import ActivationPeak

# The default pool (neither num_blocks, kv_cache_memory nor memory_budget given): at least
# DEFAULT_KV_CACHE_MEMORY, and enough for one request of the model's whole context (vLLM refuses to
# start when one max_model_len request does not fit its KV cache), but never more than
# DEFAULT_KV_CACHE_LIMIT nor half the machine's memory (on the CPU): a 128k-context model does not
# take many GiB unasked; it gets the limit, and serving says what the full context needs and which
# option sets it (pool_notice). 4 GiB was vLLM CPU's fixed default VLLM_CPU_KVCACHE_SPACE.
DEFAULT_KV_CACHE_MEMORY = 256 << 20  # bytes
DEFAULT_KV_CACHE_LIMIT = 4 << 30  # bytes

MAX_TOKENS_SEARCHED = 1 << 24  # largest_batched_tokens is reported up to this


@dataclass
class MemoryPlan:
    """The plan for one model and budget (all sizes in bytes; see the module docstring).

    num_blocks: KV blocks that fit after the weights and the activation peak at
        ``max_num_batched_tokens`` (may be <= 0: the budget is too small).
    largest_batched_tokens: the largest ``max_num_batched_tokens`` whose activation peak still
        fits beside the weights and the KV of one ``max_model_len`` sequence (0 if none; the search
        stops at :data:`MAX_TOKENS_SEARCHED`).
    concurrent_seqs: sequences of ``max_model_len`` tokens the pool holds at once (with recurrent
        state, at most ``max_num_seqs``: a slot each).
    draft_bytes: a draft model's weights and proposal scratch (0 without one).
    """

    memory: int
    weight_bytes: int
    kv_bytes_per_token: int
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    peak: ActivationPeak
    activation_bytes: int
    num_blocks: int
    largest_batched_tokens: int
    concurrent_seqs: int
    state_bytes_per_seq: int = 0
    draft_bytes: int = 0

    @property
    def kv_pool_tokens(self) -> int:
        return max(0, self.num_blocks) * self.block_size

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) lines of the plan, as ``pagedpack plan`` prints them."""
        tokens = sympy.Symbol("tokens", integer=True, nonnegative=True)
        num_seqs = min(self.max_num_batched_tokens, self.max_num_seqs)
        capped = self.largest_batched_tokens >= MAX_TOKENS_SEARCHED
        return [
            ("memory budget", _mib(self.memory)),
            ("weights", f"{_mib(self.weight_bytes)} resident while serving (on the CPU the step program's: "
                        f"its linears on prepacked copies)"),
            ("KV bytes", f"{self.kv_bytes_per_token * tokens} ({self.kv_bytes_per_token} bytes per token, "
                         f"{_mib(self.kv_bytes_per_token * self.block_size)} per block of {self.block_size})"),
            *([("recurrent state", f"{self.state_bytes_per_seq} bytes per sequence, a slot for each of max_num_seqs = "
                                   f"{self.max_num_seqs}: {_mib(self.state_bytes_per_seq * self.max_num_seqs)}")]
              if self.state_bytes_per_seq else []),
            *([("draft model", f"{_mib(self.draft_bytes)}: its weights and proposal scratch blocks (its KV, in the "
                               f"KV bytes, takes the pool's blocks)")] if self.draft_bytes else []),
            ("activation peak(T, B)", str(self.peak.expr)),
            ("activation peak", f"{_mib(self.activation_bytes)} at T = max_num_batched_tokens = "
                                f"{self.max_num_batched_tokens}, B = {num_seqs}"),
            ("KV pool", f"{max(0, self.num_blocks)} blocks = {self.kv_pool_tokens} tokens = "
                        f"{_mib(max(0, self.num_blocks) * self.block_size * self.kv_bytes_per_token)}"),
            ("largest max_num_batched_tokens", f"{'at least ' if capped else ''}{self.largest_batched_tokens} (beside "
                                               f"the weights and one {self.max_model_len}-token sequence's KV)"),
            (f"sequences of {self.max_model_len} tokens", f"{self.concurrent_seqs} at once"),
        ]


def plan_memory(peak: ActivationPeak, *, bytes_per_token: int, memory: int, block_size: int,
                max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, weight_bytes: int,
                state_bytes_per_seq: int = 0, draft_bytes: int = 0) -> MemoryPlan:
    """The :class:`MemoryPlan` of a rewritten model whose step graph has activation peak ``peak``
    (:func:`pagedpack.passes.activation_memory.activation_peak`), whose KV cache takes
    ``bytes_per_token`` and whose recurrent state ``state_bytes_per_seq``, under a budget of
    ``memory`` bytes with ``weight_bytes`` of weights resident (:func:`resident_weight_bytes`) and
    ``draft_bytes`` of a draft model's (the module docstring).
    ``ValueError`` for a non-positive size."""
    for name, value in (("memory", memory), ("block_size", block_size), ("max_num_batched_tokens",
                        max_num_batched_tokens), ("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len)):
        if value < 1:
            raise ValueError(f"{name}: expected >= 1, got {value}")
    per_token = bytes_per_token
    per_block = per_token * block_size
    activation = peak.bytes(max_num_batched_tokens, min(max_num_batched_tokens, max_num_seqs))
    fixed = weight_bytes + state_bytes_per_seq * max_num_seqs + draft_bytes
    if per_block:
        num_blocks = (memory - fixed - activation) // per_block
    else:
        num_blocks = bookkeeping_blocks(block_size, max_model_len, max_num_seqs) if fixed + activation <= memory else 0
    one_sequence = math.ceil(max_model_len / block_size) * per_block

    def fits(tokens: int) -> bool:
        return fixed + peak.bytes(tokens, min(tokens, max_num_seqs)) + one_sequence <= memory

    largest, step = 0, MAX_TOKENS_SEARCHED // 2  # the peak grows with T: binary search for the last T that fits
    while step:
        if fits(largest + step):
            largest += step
        step //= 2
    if fits(MAX_TOKENS_SEARCHED):
        largest = MAX_TOKENS_SEARCHED
    seqs = max(0, num_blocks) // math.ceil(max_model_len / block_size)
    if state_bytes_per_seq:  # a sequence also needs one of the max_num_seqs state slots
        seqs = min(seqs, max_num_seqs)
    return MemoryPlan(memory, weight_bytes, per_token, block_size, max_num_batched_tokens, max_num_seqs,
                      max_model_len, peak, activation, num_blocks, largest, seqs, state_bytes_per_seq, draft_bytes)


def bookkeeping_blocks(block_size: int, max_model_len: int, max_num_seqs: int) -> int:
    """The pool of a model without KV (a state-space model: its blocks hold no bytes, the scheduler
    still counts tokens in them): ``max_num_seqs`` requests of ``max_model_len`` tokens."""
    return max_num_seqs * -(-max_model_len // block_size)


def resident_weight_bytes(*modules: torch.nn.Module) -> int:
    """Bytes of the distinct parameter and buffer storages of ``modules`` (shared ones once;
    oneDNN-packed weights by their element count)."""
    seen, total = set(), 0
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.is_mkldnn:
                key, nbytes = id(tensor), tensor.numel() * tensor.element_size()
            else:
                storage = tensor.untyped_storage()
                key, nbytes = (storage.device.type, storage.data_ptr()), storage.nbytes()
            if key not in seen:
                seen.add(key)
                total += nbytes
    return total


def _mib(num_bytes: int) -> str:
    if abs(num_bytes) < 2**20:
        return f"{num_bytes / 2**10:,.1f} KiB"
    return f"{num_bytes / 2**20:,.1f} MiB"


def default_kv_cache_limit(device) -> int:
    """The most bytes the default pool takes: :data:`DEFAULT_KV_CACHE_LIMIT`, on the CPU at most
    half the machine's memory (never below :data:`DEFAULT_KV_CACHE_MEMORY`)."""
    from pagedpack.runtime.memory import physical_memory

    ram = physical_memory() if is_cpu(device) else None
    limit = DEFAULT_KV_CACHE_LIMIT if ram is None else min(DEFAULT_KV_CACHE_LIMIT, ram // 2)
    return max(DEFAULT_KV_CACHE_MEMORY, limit)


def default_num_blocks(*, bytes_per_block: int, block_size: int, max_model_len: int, max_num_seqs: int,
                       limit: int) -> int:
    """Blocks of the default pool: those of one ``max_model_len`` request (whole blocks), at least
    what :data:`DEFAULT_KV_CACHE_MEMORY` holds, at most what ``limit`` bytes hold (but one block),
    and never more than ``max_num_seqs`` such requests use."""
    one_request = -(-max_model_len // block_size)
    blocks = max(DEFAULT_KV_CACHE_MEMORY // bytes_per_block, min(one_request, limit // bytes_per_block))
    return max(1, min(max_num_seqs * one_request, blocks))


def pool_num_blocks(args, *, bytes_per_token: int, max_model_len: int, plan) -> int:
    """KV blocks of the pool ``args`` (an ``EngineArgs``) asks for: ``num_blocks``; what
    ``memory_budget`` leaves (``plan(memory)`` is the :class:`MemoryPlan`); ``kv_cache_memory`` bytes;
    or by default :func:`default_num_blocks` (one request of ``max_model_len`` tokens, at least
    :data:`DEFAULT_KV_CACHE_MEMORY`, at most :func:`default_kv_cache_limit`). ``ValueError`` naming
    the argument when no block fits, or when the pool is larger than the CPU machine's memory."""
    block_size = args.block_size
    bytes_per_block = bytes_per_token * block_size
    if args.num_blocks is not None:
        num_blocks = args.num_blocks
    elif args.memory_budget is not None:
        memory_plan = plan(args.memory_budget)
        if memory_plan.num_blocks < 1:
            held = [f"the weights ({memory_plan.weight_bytes} bytes)",
                    f"one step's activation peak at max_num_batched_tokens={memory_plan.max_num_batched_tokens} "
                    f"({memory_plan.activation_bytes} bytes)"]
            if memory_plan.state_bytes_per_seq:
                held.append(f"the recurrent state of max_num_seqs={memory_plan.max_num_seqs} sequences "
                            f"({memory_plan.state_bytes_per_seq * memory_plan.max_num_seqs} bytes)")
            if memory_plan.draft_bytes:
                held.append(f"the draft model's weights and scratch blocks ({memory_plan.draft_bytes} bytes)")
            raise ValueError(f"memory_budget: {memory_plan.memory} bytes leave no room for a block of the KV pool "
                             f"({memory_plan.kv_bytes_per_token * block_size} bytes) after {', '.join(held)}")
        num_blocks = memory_plan.num_blocks
    elif not bytes_per_block:
        num_blocks = bookkeeping_blocks(block_size, max_model_len, args.max_num_seqs)
    elif args.kv_cache_memory is not None:
        if args.kv_cache_memory < bytes_per_block:
            raise ValueError(f"kv_cache_memory: expected at least one block ({bytes_per_block} bytes), "
                             f"got {args.kv_cache_memory}")
        num_blocks = int(args.kv_cache_memory // bytes_per_block)
    else:
        num_blocks = default_num_blocks(bytes_per_block=bytes_per_block, block_size=block_size,
                                        max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
                                        limit=default_kv_cache_limit(args.device))
    _check_pool_fits(args, num_blocks * bytes_per_block, num_blocks)
    return num_blocks


def pool_notice(args, *, num_blocks: int, bytes_per_token: int, max_model_len: int) -> str | None:
    """None when the pool holds one request of ``max_model_len`` tokens; otherwise one line: the
    tokens a request gets, the option that sized the pool (or the default's limit) with its numbers,
    and what the whole context needs (``pagedpack serve`` prints it at start)."""
    block_size = args.block_size
    tokens = num_blocks * block_size
    if tokens >= max_model_len:
        return None
    bytes_per_block = bytes_per_token * block_size
    needed_blocks = -(-max_model_len // block_size)
    needed = needed_blocks * bytes_per_block
    pool = f"{num_blocks} blocks of {block_size} tokens, {_mib(num_blocks * bytes_per_block)}"
    given = next((n for n in ("num_blocks", "kv_cache_memory", "memory_budget") if getattr(args, n) is not None),
                 None)
    if given == "num_blocks":
        sized = f"--num-blocks {args.num_blocks}: {pool}"
    elif given == "kv_cache_memory":
        sized = f"--kv-cache-memory {args.kv_cache_memory} bytes: {pool}"
    elif given == "memory_budget":
        sized = f"--memory-budget {args.memory_budget} bytes leave {pool}"
    else:
        sized = (f"the default pool: {pool}, its limit (at most {_mib(DEFAULT_KV_CACHE_LIMIT)}, on the CPU at most "
                 f"half the machine's memory)")
    return (f"the KV pool holds {tokens} tokens ({sized}), fewer than one request of the model's context "
            f"({max_model_len} tokens need {needed_blocks} blocks, {_mib(needed)}): requests get up to {tokens} "
            f"tokens. For the whole context: --kv-cache-memory {-(-needed // 2**20)}MiB (or --num-blocks "
            f"{needed_blocks}); or --max-model-len {tokens} to ask for no more")


def _check_pool_fits(args, pool: int, num_blocks: int) -> None:
    """A CPU pool larger than the machine's RAM would fail in the allocator (or swap): refuse it."""
    from pagedpack.runtime.memory import physical_memory

    ram = physical_memory() if is_cpu(args.device) else None
    if ram is not None and pool > ram:
        sizes = ("num_blocks", "kv_cache_memory", "memory_budget")
        given = next((n for n in sizes if getattr(args, n) is not None), "num_blocks")
        raise ValueError(f"{given}: a KV pool of {num_blocks} blocks ({pool} bytes) is more than this "
                         f"machine's memory ({ram} bytes)")
