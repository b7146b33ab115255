"""LoRA adapters at run time: the requests that name them, and the slots a step reads them from.

A step program rewritten with ``enable_lora`` (:mod:`pagedpack.passes.lora`) takes, per augmented
linear, the stacked weights of ``max_loras`` slots and each token's slot (``lora_indices``). As vLLM's
``LRUCacheWorkerLoRAManager`` does, :class:`LoRAManager` keeps

- up to ``max_cpu_loras`` adapters loaded in host memory (read and checked once from their PEFT
  directory, :func:`pagedpack.formats.lora_adapter.load_lora_adapter`; least recently used dropped
  first, and read again, checked against the sha256 of both files at their first load, when a later
  request names them; while a request still holds it, that copy is taken again, not the files). A
  request holds the adapter it was made with until it finishes, so the stepping thread never reads a
  file: a dropped or removed adapter's running requests run on;
- ``max_loras`` slots in the program's weight inputs, an adapter copied into the least recently used
  slot no request of the step needs when a step needs it (its scaling folded into B, its rank
  zero-padded to ``max_lora_rank``, the slices of a module it does not target zero). Slots are the
  stepping thread's alone and know adapters by identity: an id removed and added again with other
  files takes a slot of its own.

The scheduler lets at most ``max_loras`` adapters run at once (:class:`~pagedpack.runtime.scheduler.Scheduler`),
so a step always finds them slots.
"""
from __future__ import annotations

import math
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedpack.step.contract import LoRASpec

_MAX_NAME_CHARS = 256


@dataclass(frozen=True)
class LoRAConfig:
    """The engine's LoRA limits (``EngineArgs``' ``max_loras``, ``max_lora_rank``, ``max_cpu_loras``)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1

    @classmethod
    def of(cls, args) -> "LoRAConfig | None":
        """The config of ``EngineArgs`` ``args``; None without ``enable_lora``."""
        return cls(args.max_loras, args.max_lora_rank, args.max_cpu_loras) if args.enable_lora else None

    def check_slot_memory(self, specs: Sequence[LoRASpec]) -> None:
        """``ValueError`` naming ``max_loras`` and ``max_lora_rank`` if the slots of ``specs`` (allocated
        up front, as the KV pool) would take more than the machine's available memory."""
        from pagedpack.runtime.memory import available_memory

        size = sum(math.prod(shape(self.max_loras, self.max_lora_rank)) * spec.dtype.itemsize
                   for spec in specs for shape in (spec.a_shape, spec.b_shape))
        available = available_memory()
        if available is not None and size > available:
            raise ValueError(f"max_loras, max_lora_rank: {self.max_loras} slots of rank {self.max_lora_rank} take "
                             f"{size} bytes for this model's {len(specs)} LoRA linears, more than the {available} "
                             "bytes of memory available; expected fewer slots or a lower rank")


@dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs with, as vLLM's ``vllm.lora.request.LoRARequest``.

    ``lora_name``: its name (the served model name over HTTP; printable, at most 256 characters);
    ``lora_int_id``: its id, ``>= 1``, one per adapter; ``lora_path``: its PEFT directory
    (``adapter_config.json`` + ``adapter_model.safetensors``); ``base_model_name``: vLLM's, informative;
    ``sha256``: the expected sha256 of ``adapter_model.safetensors`` (None: not checked on first load).
    ``ValueError`` naming the field otherwise."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    sha256: str | None = None

    def __post_init__(self):
        name = self.lora_name
        if not isinstance(name, str) or not name or len(name) > _MAX_NAME_CHARS or not name.isprintable():
            raise ValueError(f"lora_request.lora_name: expected a printable name of 1 to {_MAX_NAME_CHARS} "
                             f"characters, got {name!r:.80}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_request.lora_int_id: expected an int >= 1, got {self.lora_int_id!r:.40}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_request.lora_path: expected the adapter's directory, got {self.lora_path!r:.120}")
        if self.sha256 is not None and not (isinstance(self.sha256, str) and len(self.sha256) == 64
                                            and all(c in "0123456789abcdefABCDEF" for c in self.sha256)):
            raise ValueError(f"lora_request.sha256: expected 64 hexadecimal digits or None, got {self.sha256!r:.80}")


def normalize_lora_requests(lora_request, num_prompts: int) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt, from one for all or a list of one per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if isinstance(lora_request, (list, tuple)) and all(r is None or isinstance(r, LoRARequest) for r in lora_request):
        if len(lora_request) != num_prompts:
            raise ValueError(f"lora_request: expected one per prompt ({num_prompts}), got {len(lora_request)}")
        return list(lora_request)
    raise ValueError(f"lora_request: expected a LoRARequest or a list of them, got {lora_request!r:.80}")


class LoRAManager:
    """The adapters an engine serves and the slots of its step program (module docstring).

    ``specs``: the program's :class:`LoRASpec` list; ``weights``: its LoRA weight inputs, ``lora_a_0,
    lora_b_0, ...``, ``[max_loras, ...]`` each (the runner's, written in place here). Thread-safe:
    :meth:`add_lora` / :meth:`adapter` read files in the caller's thread; :meth:`slots` runs in the
    stepping one and reads none."""

    def __init__(self, specs: Sequence[LoRASpec], weights: Sequence[torch.Tensor], *, max_loras: int,
                 max_lora_rank: int, max_cpu_loras: int):
        self.specs, self.weights = list(specs), list(weights)
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.module_shapes = {module: (spec.in_features, size) for spec in self.specs
                              for module, size in zip(spec.modules, spec.slice_sizes)}
        self._lock = threading.Lock()
        self._loaded: OrderedDict[int, tuple[LoRARequest, object]] = OrderedDict()  # id -> (request, LoRAAdapter)
        self._known: dict[int, tuple[LoRARequest, str]] = {}  # id -> (request, digest of its first load)
        # (id, path) -> the adapter while requests hold it: read again, it is that one (one copy, one slot)
        self._held: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._slots: OrderedDict[int, int] = OrderedDict()  # id() of an adapter -> slot, least recently used first
        self._in_slot: dict[int, object] = {}  # slot -> the adapter it holds

    def add_lora(self, request: LoRARequest) -> bool:
        """Load ``request``'s adapter into host memory unless loaded; True if it was loaded now.
        ``ValueError`` naming ``lora_request`` for an id already serving another name or path, or
        naming the file and field of an adapter that cannot be served."""
        return self._get(request)[1]

    def adapter(self, request: LoRARequest):
        """``request``'s adapter (a :class:`~pagedpack.formats.lora_adapter.LoRAAdapter`), loaded if it is
        not; for a request to hold (module docstring). Errors as :meth:`add_lora`."""
        return self._get(request)[0]

    def _get(self, request: LoRARequest):
        with self._lock:
            known = self._known.get(request.lora_int_id)
            if known is not None and (known[0].lora_name, known[0].lora_path) != (request.lora_name, request.lora_path):
                raise ValueError(f"lora_request.lora_int_id: {request.lora_int_id} serves {known[0].lora_name!r} "
                                 f"({known[0].lora_path}); expected a new id for {request.lora_name!r} "
                                 f"({request.lora_path})")
            if request.lora_int_id in self._loaded:
                self._loaded.move_to_end(request.lora_int_id)
                return self._loaded[request.lora_int_id][1], False
            adapter = self._held.get((request.lora_int_id, request.lora_path))
        if adapter is None:
            adapter = self._read(request, None if known is None else known[1])
        with self._lock:
            self._known.setdefault(request.lora_int_id, (request, adapter.digest))
            self._held[request.lora_int_id, request.lora_path] = adapter
            self._loaded[request.lora_int_id] = (request, adapter)
            self._loaded.move_to_end(request.lora_int_id)
            while len(self._loaded) > self.max_cpu_loras:
                self._loaded.popitem(last=False)
        return adapter, True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget the adapter ``lora_int_id``; False if it was not loaded. Requests running with it run on
        (they hold it); its id may then serve other files."""
        with self._lock:
            self._known.pop(lora_int_id, None)
            for key in [k for k in self._held if k[0] == lora_int_id]:
                self._held.pop(key, None)
            return self._loaded.pop(lora_int_id, None) is not None

    def list_loras(self) -> list[LoRARequest]:
        """The adapters loaded in host memory, least recently used first."""
        with self._lock:
            return [request for request, _ in self._loaded.values()]

    def token_indices(self, adapters: Sequence, num_tokens: Sequence[int], device: torch.device) -> torch.Tensor:
        """``lora_indices [T] int32`` of a step whose sequence ``b`` brings ``num_tokens[b]`` tokens and
        runs with the adapter ``adapters[b]`` (None: the base model, ``-1``), put in slots first."""
        slots = self.slots(adapters)
        return torch.tensor(slots, dtype=torch.int32).repeat_interleave(torch.tensor(list(num_tokens))).to(device)

    def slots(self, adapters: Sequence) -> list[int]:
        """The slot of each of ``adapters`` (``-1`` for None), copying those not in a slot into the least
        recently used slots this step does not need. ``RuntimeError`` if the step holds more than
        ``max_loras`` adapters (the scheduler admits no more)."""
        needed = {id(a): a for a in adapters if a is not None}
        if len(needed) > self.max_loras:
            raise RuntimeError(f"a step of {len(needed)} LoRA adapters, expected at most max_loras={self.max_loras}")
        for key in needed:
            if key in self._slots:
                self._slots.move_to_end(key)
        for key, adapter in needed.items():
            if key not in self._slots:
                self._swap_in(key, adapter, keep=needed)
        return [-1 if a is None else self._slots[id(a)] for a in adapters]

    def _swap_in(self, key: int, adapter, keep: dict) -> None:
        free = sorted(set(range(self.max_loras)) - set(self._slots.values()))
        slot = free[0] if free else self._slots.pop(next(k for k in self._slots if k not in keep))
        self._write(slot, adapter)
        self._in_slot[slot] = adapter  # alive while in the slot: its id() keys the slot
        self._slots[key] = slot

    @torch.inference_mode()
    def _write(self, slot: int, adapter) -> None:
        """Copy ``adapter`` into ``slot`` of every weight input (scaling folded into B, rank zero-padded)."""
        rank = self.max_lora_rank
        for spec, lora_a, lora_b in zip(self.specs, self.weights[0::2], self.weights[1::2]):
            lora_a[slot].zero_()
            lora_b[slot].zero_()
            offset = 0
            for s, (module, size) in enumerate(zip(spec.modules, spec.slice_sizes)):
                if module in adapter.weights:
                    a, b, scaling = adapter.weights[module]
                    lora_a[slot, s * rank:s * rank + a.shape[0]] = a
                    lora_b[slot, offset:offset + size, :b.shape[1]] = b * scaling
                offset += size

    def _read(self, request: LoRARequest, digest: str | None):
        """The adapter's folder read; ``digest``: what its first read computed (a folder changed since is
        refused: the prefix cache and the answers would mix two adapters under one id)."""
        from pagedpack.formats.lora_adapter import load_lora_adapter

        try:
            adapter = load_lora_adapter(request.lora_path, self.module_shapes, max_lora_rank=self.max_lora_rank,
                                        sha256=request.sha256)
        except ValueError as err:
            raise ValueError(f"lora_request {request.lora_name!r}: {err}") from None
        if digest is not None and adapter.digest != digest:
            raise ValueError(f"lora_request {request.lora_name!r}: {request.lora_path} changed since it was first "
                             f"loaded as id {request.lora_int_id} (its files' sha256); load it under a new id")
        return adapter
