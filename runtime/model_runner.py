"""Runs a step program over the paged KV caches it owns."""
from __future__ import annotations

import math

import numpy as np
import torch

from pagedpack.host.devices import is_cpu
from pagedpack.kernels.validation import checked_step
from pagedpack.runtime.cpu_threads import CpuThreads
from pagedpack.runtime.memory import trim_heap
from pagedpack.step.contract import METADATA_INPUTS, StepProgram
from pagedpack.step.metadata import StepMetadata

TRIM_AFTER_TOKENS = 256  # a prefill chunk's worth: its activations are MiBs, a decode step's KiBs


class ModelRunner:
    """A :class:`~pagedpack.step.contract.StepProgram` plus its KV caches.

    Caches are allocated once, ``[num_blocks, block_size, num_kv_heads, head_size]`` per cache pair
    (per layer owning one: a layer sharing an earlier layer's cache has none) for K and for V,
    with the dtypes and head shapes of ``program.kv_cache_specs``, plus the
    ``padding_blocks`` a program may ask for (blocks past the pool's, which no request owns, for
    the writes of padding sequences); ``cpu_threads`` sets the stepping thread's intra-op thread
    count before each step (:mod:`pagedpack.runtime.cpu_threads`). On the CPU their pages become
    resident as blocks are first written (:func:`_zeros`; a server commits them all at start,
    :meth:`commit_kv_memory`). An in-place program writes them during the step; a functional one
    (ONNX) returns ``(logits, *updated caches)``, which replace them.

    A program with recurrent layers (``state_specs``) also gets its state tensors,
    ``[num_state_slots, *spec.shape]`` each, zeroed once (a sequence's first chunk never reads its
    slot: ``has_initial_state``), passed after the KV caches with the step's state metadata.

    A program with LoRA inputs (``lora_specs``) gets its adapter slots, ``max_loras`` of rank
    ``max_lora_rank`` (``lora_slots``), zeroed (:attr:`lora_weights`, filled by
    :class:`~pagedpack.runtime.lora.LoRAManager`), passed last with the step's ``lora_indices``.

    On the CPU, the first step of fewer than :data:`TRIM_AFTER_TOKENS` tokens after longer ones hands
    the heap pages their activations freed back to the OS (``malloc_trim``) before it runs: glibc
    keeps them, and the small allocations of the decode steps that follow would scatter over them, so
    the next long step could not reuse them and the heap grew. Long steps in a row reuse each other's
    pages untrimmed (W1: a third of its page faults gone, median time 1.98 -> 1.85 s, peak RSS
    586 -> 600 MiB; ``docs/cpu-kernels.md``).
    """

    def __init__(self, program: StepProgram, *, num_blocks: int, block_size: int,
                 device: torch.device | str = "cpu", cpu_threads: CpuThreads | None = None, workers=None,
                 num_state_slots: int = 0, lora_slots: tuple[int, int] = (1, 1)):
        self.program, self.cpu_threads, self.workers = program, cpu_threads, workers
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, torch.device(device)
        self._trim_due = False  # the last step was a long one: trim before the next short one
        self.kv_caches: list[torch.Tensor] = []
        allocated = num_blocks + getattr(program, "padding_blocks", 0)
        for spec in program.kv_cache_specs:
            for shape in spec.cache_shapes(allocated, block_size):
                self.kv_caches.append(_zeros(shape, spec.dtype, self.device))
        self.kv_cache_bytes = sum(c.numel() * c.element_size() for c in self.kv_caches)
        self.state_specs = list(getattr(program, "state_specs", ()))
        self.states = [torch.zeros(spec.state_shape(num_state_slots), dtype=spec.dtype, device=self.device)
                       for spec in self.state_specs]
        self.lora_specs = list(getattr(program, "lora_specs", ()))
        self.lora_weights = [torch.zeros(shape(*lora_slots), dtype=spec.dtype, device=self.device)
                             for spec in self.lora_specs for shape in (spec.a_shape, spec.b_shape)]
        if workers is not None:
            workers.start(num_blocks)

    @torch.inference_mode()
    def execute(self, batch: StepMetadata, *state: torch.Tensor, lora_indices: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Run one step; returns ``logits [R, vocab]``, the ``batch.logits_indices`` rows (one per
        sequence, its last token, then any prompt rows). ``state``: for a program with recurrent
        layers, the step's ``state_indices, has_initial_state``
        (:func:`pagedpack.step.metadata.state_metadata`); ``lora_indices``: for a program with LoRA
        inputs, each token's slot (None: the base model for all)."""
        inputs = batch.as_inputs()  # values checked by build_batch; caches allocated to the specs
        states = [*state, *self.states] if self.state_specs else []
        if self.lora_specs:
            if lora_indices is None:
                lora_indices = torch.full((batch.num_tokens,), -1, dtype=torch.int32, device=self.device)
            states += [lora_indices, *self.lora_weights]
        if is_cpu(self.device):
            long_step = batch.num_tokens >= TRIM_AFTER_TOKENS
            if self._trim_due and not long_step:
                trim_heap()
            self._trim_due = long_step
        if self.workers is not None:
            self.workers.step(batch)
        if self.cpu_threads is not None:
            self.cpu_threads.apply()
        with checked_step():
            try:
                out = self.program(*(inputs[name] for name in METADATA_INPUTS), *self.kv_caches, *states)
            except RuntimeError as err:  # an all-reduce of a tensor-parallel step: say which rank failed
                if self.workers is None:
                    raise
                raise self.workers.failure(err) from err
        if self.program.functional:
            out, *self.kv_caches = out
        return out

    def layer_kv_caches(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The caches by a KV connector's layer name: ``"layer.<i>"`` -> ``(K, V)`` of cache pair ``i``
        (:mod:`pagedpack.runtime.kv_connector.base`)."""
        return {f"layer.{i}": (self.kv_caches[2 * i], self.kv_caches[2 * i + 1])
                for i in range(len(self.kv_caches) // 2)}

    @torch.inference_mode()
    def commit_kv_memory(self) -> None:
        """Make every page of the caches resident now (a server claims its whole pool at start, as
        vLLM's up-front allocation does: a pool the machine cannot hold fails here, not under load,
        and the RSS no longer grows as blocks are first written)."""
        if self.workers is not None:
            self.workers.commit_kv_memory()
        for cache in self.kv_caches:
            cache.zero_()

    @torch.inference_mode()
    def copy_blocks(self, blocks_to_copy: list[tuple[int, int]]) -> None:
        """Copy KV block ``src`` into block ``dst`` in every cache, for each ``(src, dst)``
        (copy-on-write of a shared block, as vLLM's ``copy_blocks``)."""
        if self.workers is not None:
            self.workers.copy_blocks(blocks_to_copy)
        src, dst = (torch.tensor(ids, device=self.device) for ids in zip(*blocks_to_copy))
        for cache in self.kv_caches:
            cache[dst] = cache[src]

    @torch.inference_mode()
    def copy_states(self, states_to_copy: list[tuple[int, int]]) -> None:
        """Copy recurrent-state slot ``src`` into slot ``dst`` in every state tensor (a fork's)."""
        src, dst = (torch.tensor(ids, device=self.device) for ids in zip(*states_to_copy))
        for state in self.states:
            state[dst] = state[src]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU from ``numpy.zeros`` (``calloc``: the OS maps zero pages on first
    touch), so a pool sized for the worst case costs memory only for the blocks in use, as
    ``torch.zeros`` (which writes every byte) would not. An empty one (a key-only cache's value
    cache, :func:`~pagedpack.step.contract.indexer_cache_spec`) has no bytes to view."""
    if not is_cpu(device) or math.prod(shape) == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
