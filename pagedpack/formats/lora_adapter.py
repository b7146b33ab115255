"""PEFT LoRA adapter folders (``save_pretrained``'s ``adapter_config.json`` and
``adapter_model.safetensors``), read as untrusted input.

:func:`load_lora_adapter` reads those two files only (never a name taken from them, never a link out
of the folder, never a pickle), follows PEFT's LoRA semantics for which modules are targeted and at
what rank and scaling (``target_modules`` as a list, a regex or ``"all-linear"``, ``exclude_modules``,
``layers_to_transform``, ``rank_pattern`` / ``alpha_pattern``, ``use_rslora``), and refuses anything
else by name: a ``ValueError`` naming the file and the field or tensor, what was expected and what
came (docs/lora.md, "Adapter files"). Regular expressions from the config run under
:mod:`regex` with a time budget, and list fields hold a bounded number of entries, so a config cannot
keep the loader busy for long.
"""
from __future__ import annotations

import hashlib
import math
import os
import re
import stat
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

import regex
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from pagedpack.formats.files import parse_json

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_FILES = ("adapter_model.bin", "adapter_model.pt")
MAX_CONFIG_BYTES = 1 << 20
# the weights file may hold the expected tensors at 8 bytes an element (float64) plus this much header
HEADER_SLACK_BYTES = 1 << 20
REGEX_BUDGET_S = 2.0  # for all the config's regular expressions together, on every module
MAX_PATTERN_CHARS = 4096  # PEFT's target patterns name modules: a few hundred characters at most
COMPILE_CHECK_BYTES = 512 << 20  # address space of the child that compiles a pattern with counted repetitions
_COMPILE_CHECK = ("import resource, sys; n = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_AS, (n, n)); "
                  "import regex; regex.compile(sys.stdin.read())")
EXTRA_ENTRIES = 64  # a list or object field may hold one entry per module LoRA may target, and this many more
INIT_LORA_WEIGHTS = (True, False, "gaussian", "eva", "orthogonal")  # initializations that leave the base weights

# adapter_config.json fields that must be absent, null, false or empty: what a set value would ask for
UNSUPPORTED_FIELDS = {
    "modules_to_save": "whole modules trained and saved beside the adapter (serve a merged model instead)",
    "use_dora": "DoRA: a per-column magnitude rescales the merged weight",
    "fan_in_fan_out": "weights stored transposed (GPT-2's Conv1D)",
    "lora_bias": "a bias on lora_B",
    "use_qalora": "QALoRA: A applied to pooled inputs",
    "alora_invocation_tokens": "activated LoRA: the adapter applies only after invocation tokens",
    "trainable_token_indices": "trained embedding rows",
    "target_parameters": "LoRA on parameters (MoE experts), not on linear modules",
    "layer_replication": "decoder layers replicated with their own adapters",
    "megatron_config": "Megatron parallel linears",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
    "arrow_config": "Arrow routing over adapters",
    "kasa_config": "KaSA",
    "use_bdlora": "block-diagonal LoRA",
}

_DEFAULT_LAYER = re.compile(r".*?\.[^.]*\.(?P<idx>\d+)\..*")  # PEFT's layer index without a layers_pattern
_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.(?P<kind>lora_[AB])(?:\.(?P<adapter>[^.]+))?\.weight")


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter read by :func:`load_lora_adapter`. ``weights``: module path -> ``(A [r_m, in_features]
    float32, B [out_features, r_m] float32, scaling)``, the module's output gaining
    ``scaling * x @ A.T @ B.T``; ``rank``: the largest ``r_m``; ``sha256``: of ``adapter_model.safetensors``;
    ``digest``: a sha256 over both files (what the adapter computes: the prefix cache's key for its blocks,
    and how a later read of the folder tells a change apart)."""

    path: str
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
    sha256: str
    digest: str


def lora_module_shapes(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Module path -> ``(in_features, out_features)`` of every ``nn.Linear`` inside ``model``'s decoder
    layers (the modules whose class ``model._no_split_modules`` names: not ``lm_head``, not the
    embeddings), the modules LoRA may target. ``ValueError`` if the model names no decoder layer class."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    if not layer_classes:
        raise ValueError(f"model: {type(model).__name__} names no decoder layer class (_no_split_modules)")
    return {f"{name}.{sub}": (linear.in_features, linear.out_features)
            for name, layer in model.named_modules() if type(layer).__name__ in layer_classes
            for sub, linear in layer.named_modules() if isinstance(linear, torch.nn.Linear)}


def load_lora_adapter(path: str, module_shapes: Mapping[str, tuple[int, int]], *, max_lora_rank: int,
                      sha256: str | None = None) -> LoRAAdapter:
    """Read the PEFT LoRA adapter folder ``path``: ``adapter_config.json`` and ``adapter_model.safetensors``
    (tensors ``base_model.model.<module>.lora_A.weight [r_m, in]`` and ``.lora_B.weight [out, r_m]``, any
    floating dtype, converted to float32; an adapter-name infix ``lora_A.<name>.weight`` is accepted).
    ``module_shapes``: every module LoRA may target -> ``(in_features, out_features)``
    (:func:`lora_module_shapes`); ``max_lora_rank``: the largest rank accepted; ``sha256``: if given,
    the weights file's expected sha256. ``ValueError`` naming the file and the field or tensor on
    anything that is not a plain LoRA adapter for those modules (module docstring)."""
    folder = os.path.realpath(path)
    if not os.path.isdir(folder):
        raise ValueError(f"path: expected an adapter folder, got {path!r} (not a directory)")
    config_path, weights_path = (os.path.join(path, name) for name in (CONFIG_FILE, WEIGHTS_FILE))
    config = config_bytes = _read_inside(folder, config_path, MAX_CONFIG_BYTES, "an adapter config may take")
    if config is None:
        raise ValueError(f"{config_path}: missing; a PEFT adapter folder holds {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        config = parse_json(config)
    except ValueError as err:
        raise ValueError(f"{config_path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
    ranks = _target_ranks(config, config_path, module_shapes, max_lora_rank)

    limit = HEADER_SLACK_BYTES + 8 * sum(r * sum(module_shapes[m]) for m, (r, _) in ranks.items())
    base = config.get("base_model_name_or_path")
    data = _read_inside(folder, weights_path, limit, "the targeted modules' tensors take at 8 bytes an "
                        "element, plus a header (is it an adapter of another base model"
                        + (f", {base!r:.120}?)" if isinstance(base, str) else "?)"))
    if data is None:
        pickled = [name for name in PICKLED_FILES if os.path.lexists(os.path.join(path, name))]
        hint = (f"; the folder holds {', '.join(pickled)}, a pickle, which pagedpack never loads: convert it to "
                "safetensors (PeftModel.from_pretrained, then save_pretrained(safe_serialization=True))")
        raise ValueError(f"{weights_path}: missing{hint if pickled else ''}")
    digest = hashlib.sha256(data).hexdigest()
    if sha256 is not None and sha256.lower() != digest:
        raise ValueError(f"{weights_path}: sha256: expected {sha256:.64}, got {digest}")
    try:
        tensors = load_safetensors(data)
    except (SafetensorError, ValueError, TypeError) as err:
        raise ValueError(f"{weights_path}: not a readable safetensors file ({err})") from None

    pairs = _pairs(tensors, weights_path, module_shapes, ranks)
    weights = {}
    for module, (r, alpha) in sorted(ranks.items()):
        (a_name, a), (b_name, b) = pairs[module]["lora_A"], pairs[module]["lora_B"]
        in_features, out_features = module_shapes[module]
        if (a.dim() == b.dim() == 2 and a.shape[1] == in_features and b.shape[0] == out_features
                and a.shape[0] != b.shape[1]):
            raise ValueError(f"{weights_path}: tensor {b_name!r:.200}: rank {b.shape[1]} (its columns), but "
                             f"{a_name!r:.200} has rank {a.shape[0]} (its rows); expected the same rank, {r}")
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        weights[module] = (_checked(a_name, a, (r, in_features), weights_path),
                           _checked(b_name, b, (out_features, r), weights_path), float(scaling))
        if not torch.isfinite(weights[module][1] * weights[module][2]).all():  # folded into B in the slots
            raise ValueError(f"{config_path}: lora_alpha: the scaling {scaling:.3g} of {module} times its "
                             f"{b_name!r:.200} overflows float32; expected an alpha that keeps B * scaling finite")
    both = hashlib.sha256(hashlib.sha256(config_bytes).digest() + bytes.fromhex(digest)).hexdigest()
    return LoRAAdapter(path=path, rank=max(r for r, _ in ranks.values()), weights=weights, sha256=digest,
                       digest=both)


def _target_ranks(config: dict, file: str, module_shapes: Mapping[str, tuple[int, int]],
                  max_lora_rank: int) -> dict[str, tuple[int, float]]:
    """The modules of ``module_shapes`` that ``config`` targets -> ``(r, lora_alpha)``, PEFT's defaults
    (``r`` 8, ``lora_alpha`` 8) and patterns applied; ``ValueError`` on a field pagedpack does not serve."""
    def refuse(field, message):
        raise ValueError(f"{file}: {field}: {message}")

    if config.get("peft_type") != "LORA":
        refuse("peft_type", f"expected 'LORA', got {config.get('peft_type')!r:.120}")
    for field, what in UNSUPPORTED_FIELDS.items():
        if config.get(field) not in (None, False, [], {}, ""):
            refuse(field, f"expected it unset, got {config[field]!r:.120} ({what}); pagedpack serves plain LoRA")
    if config.get("bias", "none") != "none":
        refuse("bias", f"expected 'none', got {config['bias']!r:.120} (trained biases of the base model)")
    init = config.get("init_lora_weights", True)
    if not any(init is ok or (isinstance(ok, str) and init == ok) for ok in INIT_LORA_WEIGHTS):
        refuse("init_lora_weights", f"expected one of {INIT_LORA_WEIGHTS}, got {init!r:.120}: the adapter needs base "
               "weights changed at initialization (PiSSA, OLoRA, CorDA, LoftQ) or a LoRA variant (MiCA); convert "
               "it to plain LoRA (PEFT's path_initial_model_for_weight_conversion)")
    if not isinstance(config.get("use_rslora", False), bool):
        refuse("use_rslora", f"expected true or false, got {config['use_rslora']!r:.120}")

    def rank(field, value):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            refuse(field, f"expected a LoRA rank (an integer >= 1), got {value!r:.120}")
        if value > max_lora_rank:
            refuse(field, f"LoRA rank {value} is greater than max_lora_rank {max_lora_rank}")
        return value

    def alpha(field, value):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            refuse(field, f"expected a finite number, got {value!r:.120}")
        return value

    def patterns(field, check):
        value = config.get(field) or {}
        if not isinstance(value, dict):
            refuse(field, f"expected an object of module pattern -> value, got {value!r:.120}")
        return {key: check(f"{field}[{key!r:.80}]", v) for key, v in value.items()}

    most = len(module_shapes) + EXTRA_ENTRIES
    for field in ("target_modules", "exclude_modules", "rank_pattern", "alpha_pattern", "layers_to_transform",
                  "layers_pattern"):
        if isinstance(config.get(field), (list, dict)) and len(config[field]) > most:
            refuse(field, f"expected at most {most} entries (one per module LoRA may target, and "
                   f"{EXTRA_ENTRIES} more), got {len(config[field])}")

    r, lora_alpha = rank("r", config.get("r", 8)), alpha("lora_alpha", config.get("lora_alpha", 8))
    rank_pattern, alpha_pattern = patterns("rank_pattern", rank), patterns("alpha_pattern", alpha)
    targets = config.get("target_modules")
    exclude = config.get("exclude_modules")
    layers, layers_pattern = config.get("layers_to_transform"), config.get("layers_pattern")
    for field, value in (("target_modules", targets), ("exclude_modules", exclude)):
        if not (isinstance(value, str) or (isinstance(value, list) and all(isinstance(t, str) for t in value))
                or (value is None and field == "exclude_modules")):
            refuse(field, f"expected a list of module names or a regular expression, got {value!r:.120}")
    if not (layers is None or _is_int(layers) or (isinstance(layers, list) and all(map(_is_int, layers)))):
        refuse("layers_to_transform", f"expected a layer index or a list of them, got {layers!r:.120}")
    if layers not in (None, []) and isinstance(targets, str):
        refuse("layers_to_transform", f"expected it unset with a regular expression as target_modules "
               f"({targets!r:.80}), got {layers!r:.120}")
    if not (layers_pattern is None or isinstance(layers_pattern, str)
            or (isinstance(layers_pattern, list) and all(isinstance(p, str) for p in layers_pattern))):
        refuse("layers_pattern", f"expected a name or a list of names, got {layers_pattern!r:.120}")

    compiled, deadline = {}, time.monotonic() + REGEX_BUDGET_S

    def fullmatch(field, pattern, key, around=("", "")):  # ``around``: what PEFT puts before and after the pattern
        try:
            if (pattern, around) not in compiled:
                compiled[pattern, around] = _compile(around[0] + pattern + around[1], deadline)
            return compiled[pattern, around].fullmatch(key, timeout=max(deadline - time.monotonic(), 1e-6))
        except (regex.error, RecursionError, OverflowError) as err:
            refuse(field, f"expected a regular expression, got {pattern!r:.120} ({type(err).__name__}: {err})")
        except TimeoutError:
            refuse(field, f"matching {pattern!r:.120} against {key!r} ran past the {REGEX_BUDGET_S} s that the "
                   "config's regular expressions may take in all")

    def listed(names, key):  # PEFT's list match: the module path, or its last dotted parts
        return key in names or any(key.endswith(f".{name}") for name in names)

    def in_layers(key):  # PEFT's layers_to_transform: the first number after a layers_pattern name
        names = [layers_pattern] if isinstance(layers_pattern, str) else layers_pattern if layers_pattern else []
        found = next(filter(None, (fullmatch("layers_pattern", p, key, (r"(?:|.*?\.)(?:", r")\.(?P<idx>\d+)\..*"))
                                   for p in names)), None) if names else _DEFAULT_LAYER.fullmatch(key)
        index = int(found["idx"]) if found else None
        return index == layers if _is_int(layers) else index in layers

    def targeted(key):
        if exclude and (fullmatch("exclude_modules", exclude, key) if isinstance(exclude, str)
                        else listed(exclude, key)):
            return False
        if isinstance(targets, str):
            return targets.lower() == "all-linear" or fullmatch("target_modules", targets, key) is not None
        if key in targets:
            return True
        return listed(targets, key) and (layers in (None, []) or in_layers(key))

    def pattern_value(field, values, key, default):  # PEFT's get_pattern_key: the first key whose match ends the path
        return next((v for p, v in values.items() if fullmatch(field, p, key, (r"(?:.*\.)?(?:", ")"))), default)

    ranks = {key: (pattern_value("rank_pattern", rank_pattern, key, r),
                   pattern_value("alpha_pattern", alpha_pattern, key, lora_alpha))
             for key in module_shapes if targeted(key)}
    if not ranks:
        refuse("target_modules", f"selects none of the modules LoRA may target in this model "
               f"({_leaf_names(module_shapes)}), got {targets!r:.120}")
    return ranks


def _pairs(tensors: dict[str, torch.Tensor], file: str, module_shapes: Mapping[str, tuple[int, int]],
           ranks: Mapping[str, tuple[int, float]]) -> dict[str, dict[str, tuple[str, torch.Tensor]]]:
    """``tensors`` by module and kind: ``{module: {"lora_A": (name, tensor), "lora_B": (name, tensor)}}``,
    one pair for each module of ``ranks`` and none else; ``ValueError`` naming the tensor otherwise."""
    allowed = _leaf_names(module_shapes)
    pairs, adapters = {}, set()
    for name in sorted(tensors):
        if "lora_embedding_" in name:
            raise ValueError(f"{file}: tensor {name!r:.200}: embedding LoRA is not supported; LoRA may target the "
                             f"linear modules of the decoder layers ({allowed})")
        match = _KEY.fullmatch(name)
        if match is None:
            raise ValueError(f"{file}: tensor {name!r:.200}: unexpected name; expected "
                             f"base_model.model.<module>.lora_A.weight or .lora_B.weight")
        module = match["module"]
        if module not in module_shapes:
            raise ValueError(f"{file}: tensor {name!r:.200}: module {module!r:.200} is not one LoRA may target in "
                             f"this model; LoRA may target the linear modules of the decoder layers ({allowed})")
        if module not in ranks:
            raise ValueError(f"{file}: tensor {name!r:.200}: module {module!r:.200} is not among the modules "
                             f"{CONFIG_FILE}'s target_modules selects")
        adapters.add(match["adapter"])
        if len(adapters) > 1:
            raise ValueError(f"{file}: tensor {name!r:.200}: expected the tensors of one adapter, got adapter names "
                             f"{sorted(map(str, adapters))}")
        pairs.setdefault(module, {})[match["kind"]] = (name, tensors[name])
    for module in sorted(ranks):
        kinds = pairs.get(module, {})
        if len(kinds) < 2:
            has = f"has {next(iter(kinds.values()))[0]!r:.200} but" if kinds else "has"
            raise ValueError(f"{file}: module {module!r:.200} {has} no "
                             f"{' or '.join(k for k in ('lora_A', 'lora_B') if k not in kinds)} tensor, "
                             f"though {CONFIG_FILE}'s target_modules selects it")
    return pairs


def _checked(name: str, tensor: torch.Tensor, shape: tuple[int, int], file: str) -> torch.Tensor:
    """``tensor`` as float32 if it has ``shape``, a floating dtype and finite values; ``ValueError`` naming it."""
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{file}: tensor {name!r:.200}: expected shape {list(shape)} (the module's features and "
                         f"the rank {CONFIG_FILE} gives it), got {list(tensor.shape)}")
    if not tensor.is_floating_point():
        raise ValueError(f"{file}: tensor {name!r:.200}: expected a floating dtype, got {tensor.dtype}")
    tensor = tensor.to(torch.float32)
    if not torch.isfinite(tensor).all():
        raise ValueError(f"{file}: tensor {name!r:.200}: holds non-finite values (inf or nan, in float32)")
    return tensor


def _leaf_names(module_shapes: Mapping[str, tuple[int, int]]) -> str:
    """The modules' last names, once each: ``"down_proj, gate_proj, k_proj, ..."``."""
    return ", ".join(sorted({m.rpartition(".")[2] for m in module_shapes})) or "none"


def _compile(pattern: str, deadline: float) -> regex.Pattern:
    """``pattern`` compiled. Compiling is not timed as matching is, and a counted repetition multiplies what
    it compiles (``(?:(?:a{1000}){1000}){1000}`` fills gigabytes, holding the GIL): a pattern longer than
    :data:`MAX_PATTERN_CHARS`, or one with a count that a child process (at most
    :data:`COMPILE_CHECK_BYTES` of memory, until ``deadline``) cannot compile, is a ``regex.error``."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise regex.error(f"{len(pattern)} characters, expected at most {MAX_PATTERN_CHARS}")
    if "{" in pattern:
        try:
            done = subprocess.run([sys.executable, "-I", "-c", _COMPILE_CHECK, str(COMPILE_CHECK_BYTES)],
                                  input=pattern.encode(), capture_output=True,
                                  timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            raise regex.error("compiling it took longer than the config's regular expressions may") from None
        if done.returncode:
            raise regex.error(f"compiling it in a bounded child process failed ({done.stderr.decode()[-200:]!r})")
    return regex.compile(pattern)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _read_inside(folder: str, path: str, limit: int, bound: str) -> bytes | None:
    """The bytes of the regular file ``path`` (None if there is none), which must resolve inside ``folder``
    and hold at most ``limit`` bytes (``bound``: why, for the message); ``ValueError`` naming it otherwise."""
    if not os.path.lexists(path):
        return None
    real = os.path.realpath(path)
    if os.path.commonpath([folder, real]) != folder:
        raise ValueError(f"{path}: a link to {real!r}, outside the adapter folder; expected a file inside it")
    try:
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as err:
        raise ValueError(f"{path}: cannot be opened ({err.strerror or err})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path}: expected a regular file, got another kind (mode {stat.filemode(info.st_mode)})")
        with os.fdopen(fd, "rb", closefd=False) as file:
            data = file.read(limit + 1) if info.st_size <= limit else b""
    finally:
        os.close(fd)
    if info.st_size > limit or len(data) > limit:
        raise ValueError(f"{path}: {max(info.st_size, len(data))} bytes, over the {limit} bytes {bound}")
    return data
