"""The models a server answers to, as vLLM's ``OpenAIServingModels``: the base model and its LoRA adapters.

A request's ``model`` names the base model (``--served-model-name``) or an adapter: those of
``--lora-modules`` (ids 1, 2, ... in their order, loaded at start) and, when
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true, those ``/v1/load_lora_adapter`` adds (the next ids,
never reused). An HTTP body's ``lora_path`` is untrusted: it is read only if it resolves, symlinks
followed, inside ``--lora-root``, and so do the files in it.
"""
from __future__ import annotations

import itertools
import json
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from pagedpack.runtime.lora import LoRARequest

RUNTIME_LORA_UPDATING = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating() -> bool:
    """Whether ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` are served (vLLM's test of its variable)."""
    return os.environ.get(RUNTIME_LORA_UPDATING, "0").strip().lower() in ("1", "true")


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry (vLLM's): the adapter's served ``name``, its PEFT directory ``path``
    and ``base_model_name`` (``/v1/models``' ``parent``; None: the served model's name)."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> "LoRAModulePath":
        """``name=path`` or the JSON object ``{"name", "path", "base_model_name"}``; ``ValueError`` naming the flag."""
        expected = 'expected name=path or a JSON object {"name": ..., "path": ..., "base_model_name": ...}'
        if text.lstrip().startswith("{"):
            try:
                fields = json.loads(text)
                entry = cls(**fields)
            except (json.JSONDecodeError, TypeError) as err:
                raise ValueError(f"--lora-modules: {expected}, got {text!r:.200} ({err})") from None
        else:
            name, sep, path = text.partition("=")
            entry = cls(name, path) if sep else None
        if entry is None or not all(isinstance(v, str) and v for v in (entry.name, entry.path)) or \
                not isinstance(entry.base_model_name, (str, type(None))):
            raise ValueError(f"--lora-modules: {expected}, got {text!r:.200}")
        return entry


def lora_requests(modules: Iterable[LoRAModulePath], base_name: str) -> list[LoRARequest]:
    """The adapters of ``--lora-modules``, ids 1, 2, ...; ``ValueError`` naming the flag for a bad or
    repeated name, or the served model's."""
    requests, names = [], {base_name}
    for lora_int_id, module in enumerate(modules, start=1):
        if module.name in names:
            raise ValueError(f"--lora-modules: the name {module.name!r} is given twice (or is --served-model-name); "
                             "expected one name per model")
        names.add(module.name)
        try:
            requests.append(LoRARequest(module.name, lora_int_id, module.path, module.base_model_name))
        except ValueError as err:
            raise ValueError(f"--lora-modules: {str(err).removeprefix('lora_request.')}") from None
    return requests


class ServingModels:
    """The served names: ``base_name`` and the adapters (``lora_modules``; runtime ones under
    ``lora_root``). Thread-safe: loading runs in the server's worker threads."""

    def __init__(self, base_name: str, lora_modules: Iterable[LoRAModulePath] = (), lora_root: str | None = None):
        self.base_name = base_name
        self.lora_root = None if lora_root is None else Path(lora_root).resolve()
        self._lock = threading.Lock()
        static = lora_requests(lora_modules, base_name)
        self._adapters: dict[str, LoRARequest | None] = {r.lora_name: r for r in static}  # None: being loaded
        self._ids = itertools.count(len(static) + 1)

    @property
    def adapters(self) -> list[LoRARequest]:
        with self._lock:
            return [r for r in self._adapters.values() if r is not None]

    def load_static(self, add_lora: Callable[[LoRARequest], object]) -> None:
        """Load every ``--lora-modules`` adapter with ``add_lora`` (the engine's); its ``ValueError``
        (the file and field) names the entry."""
        for request in self.adapters:
            try:
                add_lora(request)
            except (ValueError, OSError) as err:
                raise ValueError(f"--lora-modules {request.lora_name}={request.lora_path}: {err}") from err

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter ``model`` names (None: the base model, named or not); ``LookupError`` for a name
        this server does not serve, vLLM's message."""
        if model is None or model == self.base_name:
            return None
        with self._lock:
            request = self._adapters.get(model)
        if request is None:
            raise LookupError(f"The model `{model}` does not exist (this server serves `{self.base_name}`"
                              + (" and the LoRA adapters /v1/models lists" if self._adapters else "") + ").")
        return request

    def cards(self, created: int, max_model_len: int) -> list[dict]:
        """``/v1/models``' entries: the base model, then each adapter (vLLM's ``root``: its path,
        ``parent``: its base model)."""
        base = {"id": self.base_name, "object": "model", "created": created, "owned_by": "pagedpack",
                "max_model_len": max_model_len}
        return [base, *({**base, "id": r.lora_name, "root": r.lora_path, "parent": r.base_model_name or self.base_name}
                        for r in self.adapters)]

    def load(self, lora_name: str, lora_path: str, add_lora: Callable[[LoRARequest], object]) -> LoRARequest:
        """Serve the adapter in ``lora_path`` (relative to ``lora_root``, or absolute inside it) as
        ``lora_name``, loaded with ``add_lora`` (it reads files: call this in a worker thread).
        ``ValueError`` naming the field: no ``--lora-root``, a bad or taken name, a path outside the
        root, an adapter that cannot be served."""
        if self.lora_root is None:
            raise ValueError("lora_path: loading adapters at run time needs --lora-root DIR (the directory "
                             "adapters may be read from)")
        path = str(self._inside_root(lora_path))
        with self._lock:
            if lora_name == self.base_name or lora_name in self._adapters:
                raise ValueError(f"lora_name: The lora adapter '{lora_name}' has already been loaded.")
            try:
                request = LoRARequest(lora_name, next(self._ids), path)
            except ValueError as err:
                raise ValueError(str(err).removeprefix("lora_request.")) from None
            self._adapters[lora_name] = None  # taken while it loads
        try:
            add_lora(request)
        except BaseException as err:
            with self._lock:
                del self._adapters[lora_name]
            if isinstance(err, (ValueError, OSError)):
                raise ValueError(f"lora_path: {lora_path!r:.200} cannot be served: {err}") from err
            raise
        with self._lock:
            self._adapters[lora_name] = request
        return request

    def unload(self, lora_name: str | None, lora_int_id: int | None) -> LoRARequest:
        """Stop serving the adapter named ``lora_name`` (or of id ``lora_int_id``); its request.
        ``ValueError`` when neither is given, ``LookupError`` for an adapter not served."""
        if lora_name is None and lora_int_id is None:
            raise ValueError("lora_name: either 'lora_name' or 'lora_int_id' needs to be provided.")
        with self._lock:
            found = [name for name, r in self._adapters.items() if r is not None and lora_name in (None, name)
                     and lora_int_id in (None, r.lora_int_id)]
            if not found:
                raise LookupError(f"The lora adapter '{lora_name if lora_name is not None else lora_int_id}' "
                                  "cannot be found.")
            return self._adapters.pop(found[0])

    def _inside_root(self, lora_path: str) -> Path:
        """``lora_path`` resolved; ``ValueError`` unless it and the files in it resolve inside ``lora_root``."""
        root = self.lora_root
        try:
            path = (root / lora_path).resolve()
            inside = path.is_relative_to(root) and (not path.is_dir() or
                                                    all(p.resolve().is_relative_to(root) for p in path.iterdir()))
        except (ValueError, OSError):  # a NUL byte, a loop of links, a directory not to be listed
            inside = False
        if not inside:
            raise ValueError(f"lora_path: expected an adapter directory inside --lora-root (the directory adapters "
                             f"may be read from), got {lora_path!r:.200}")
        return path
