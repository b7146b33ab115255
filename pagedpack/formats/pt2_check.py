"""What in a ``.pt2`` archive can run code when ``torch.export.load`` reads it, refused before it does.

``torch.export.load`` (torch 2.13) runs code from the file in these ways, each refused here:

- members other than those of the one program pagedpack writes (``models/model.json``, its
  configs, ``weight_N`` / ``tensor_N`` payloads, ``extra/pagedpack.json``, ...): torch loads every
  ``models/*`` entry as another program with configs of its own, and finds names
  case-insensitively (a ``MODELS/model.json`` after the checked one is what it reads); compressed
  members (a zip bomb);
- members it unpickles: weights and constants marked ``use_pickle`` (a full ``torch.load``, not weights-only),
  opaque constants (``pickle.loads``), TorchScript objects, the legacy ``data/*/model.pt`` files,
  and the sample inputs, whose failed weights-only load falls back to a full unpickle (the load
  itself runs with ``TORCH_FORCE_WEIGHTS_ONLY_LOAD=1``: :func:`weights_only_loads`);
- AOTInductor members (``data/aotinductor/``: shared libraries it loads);
- graph nodes whose target is any attribute reachable from ``torch`` (the deserializer resolves
  ``"torch.os.system"``): only ``torch.ops.{aten, pagedpack, transformers}.*`` (but
  ``aten.from_file``, which maps a file the graph names), ``operator`` arithmetic, ``math`` and
  ``torch.sym_*`` are taken;
- symbolic expressions, parsed with ``sympy.sympify`` (an ``eval``): only sympy's constructors,
  torch's sympy functions, symbol names and numbers of at most 18 digits are taken, no power
  (``3**3**20`` never finishes evaluating);
- names of weights, buffers, constants and modules (the signature's and the payload configs'),
  which ``ExportedProgram.module()`` writes into the Python source of the module it ``exec``-s:
  only dotted names of letters, digits and ``_`` are taken (``layers.0.weight``);
- ``guards_code`` strings, which ``ExportedProgram.module()`` ``exec``-s: the loader clears them
  before building the module (the runtime checks the metadata itself).

``LLM(..., trust_file=True)`` / ``--trust-file`` skips these checks for a file the user trusts as
code (the checksum and the names read from the metadata are checked all the same).
"""
from __future__ import annotations

import contextlib
import os
import re
import threading
import zipfile

from pagedpack.formats.files import parse_json

_NAMESPACES = ("aten", "pagedpack", "transformers")
_DENIED_OPS = ("torch.ops.aten.from_file",)
# a tensor-parallel rank's collectives (pagedpack.lowering.reference.tp): out-of-place collectives on a named group
_COLLECTIVES = ("torch.ops._c10d_functional.all_reduce.default", "torch.ops._c10d_functional.wait_tensor.default",
                "torch.ops._c10d_functional.all_gather_into_tensor.default")
_OPERATORS = frozenset("getitem add sub mul truediv floordiv mod neg pos pow abs eq ne lt le gt ge and_ or_ xor "
                       "not_ invert lshift rshift matmul".split())
_SYMPY_NAMES = frozenset(
    "Symbol Integer Rational Float Add Mul Max Min Abs Eq Ne Lt Le Gt Ge StrictLessThan StrictGreaterThan "
    "LessThan GreaterThan Equality Unequality And Or Not Piecewise ExprCondPair BooleanTrue BooleanFalse true "
    "false True False oo zoo nan NegativeOne One Zero Half floor ceiling sqrt FloorDiv ModularIndexing Where "
    "PythonMod Mod CleanDiv CeilToInt FloorToInt CeilDiv IntTrueDiv FloatTrueDiv LShift RShift "
    "IsNonOverlappingAndDenseIndicator TruncToFloat TruncToInt RoundToInt RoundDecimal ToFloat "
    "Identity OpaqueUnaryFn_sqrt BitwiseFn_bitwise_and BitwiseFn_bitwise_or "
    "positive negative integer real nonnegative nonpositive finite infinite commutative".split())
# Numbers of at most 18 digits, no '**' nor 'Pow' (sympify evaluates 3**3**20 for ever), no '!' (factorial).
_TOKEN = re.compile(r"\s+|'[A-Za-z]+\d+'|[A-Za-z_][A-Za-z0-9_]*|\d{1,18}(?:\.\d{1,18})?(?:[eE][-+]?\d{1,3})?(?!\d)"
                    r"|\*(?!\*)|[-+/%(),=<>]")
# The members of the one program pagedpack exports (names after the archive's root folder).
_MEMBERS = frozenset(("archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id",
                      "models/model.json", "data/sample_inputs/model.pt", "data/weights/model_weights_config.json",
                      "data/constants/model_constants_config.json", "extra/pagedpack.json"))
_PAYLOAD = re.compile(r"data/weights/weight_\d+|data/constants/tensor_\d+")
_SYMBOL = re.compile(r"[A-Za-z]+\d+")
_FQN = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")  # torch.fx writes such a segment as getattr(self, "0")
# Keys of the serialized program whose values are module paths / attribute names ("fqn" may be "": the root).
_FQN_KEYS = ("parameter_name", "buffer_name", "tensor_constant_name", "custom_obj_name", "fqn")
_env_lock = threading.Lock()


class UntrustedFileError(ValueError):
    """An export holds something that would run code when loaded (refused unless ``trust_file``)."""


def check_pt2_archive(file, path: str) -> None:
    """Refuse the ``.pt2`` archive open as ``file`` (``path`` in messages) if loading it would run
    code from it (module docstring); ``ValueError`` if it is not a zip archive of one program."""
    try:
        archive = zipfile.ZipFile(file)
    except zipfile.BadZipFile as err:
        raise ValueError(f"path: {path!r} is not a .pt2 archive ({err})") from err
    with archive:
        names = archive.namelist()
        roots = {name.split("/", 1)[0] for name in names}
        if len(roots) != 1:
            raise ValueError(f"path: {path!r} is not a torch.export archive (members under {sorted(roots)[:4]})")
        root = roots.pop() + "/"
        members = {name[len(root):] for name in names}
        if len({name.lower() for name in names}) != len(names):  # which copy a reader takes differs
            raise ValueError(f"path: {path!r} is not a valid .pt2 archive (two members of one name)")

        def refuse(what: str) -> UntrustedFileError:
            return UntrustedFileError(
                f"path: {path!r} holds {what}, which would run code when loaded; pagedpack never writes "
                f"one. Load it only if you trust it as code: LLM(..., trust_file=True) / --trust-file")

        if "archive_format" not in members or archive.read(root + "archive_format") != b"pt2":
            raise ValueError(f"path: {path!r} is not a torch.export .pt2 archive (no archive_format 'pt2')")
        for info in archive.infolist():
            member = info.filename[len(root):]
            if member.startswith("data/aotinductor/"):
                raise refuse(f"an AOTInductor library ({member})")
            if not (member in _MEMBERS or _PAYLOAD.fullmatch(member)):  # torch reads names case-insensitively
                raise refuse(f"a member {member!r:.80} that is not one of the one program pagedpack exports")
            if info.compress_type != zipfile.ZIP_STORED:
                raise refuse(f"a compressed member ({member}; pagedpack stores every member as it is)")
        for config_name in ("data/weights/model_weights_config.json", "data/constants/model_constants_config.json"):
            config = _read_json(archive, root, config_name, path) if config_name in members else {}
            for fqn, payload in (config.get("config") or {}).items():
                _check_fqn(fqn, refuse)
                if not isinstance(payload, dict) or payload.get("use_pickle") is not False \
                        or not str(payload.get("path_name", "")).startswith(("weight_", "tensor_")):
                    raise refuse(f"a pickled or non-tensor member for {fqn!r:.80}")
        _check_program(_read_json(archive, root, "models/model.json", path), refuse)


@contextlib.contextmanager
def weights_only_loads():
    """Every ``torch.load`` in the block loads weights only (``TORCH_FORCE_WEIGHTS_ONLY_LOAD=1``),
    the sample inputs' fallback to a full unpickle included."""
    key = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
    with _env_lock:
        saved = os.environ.get(key)
        os.environ[key] = "1"
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = saved


def _read_json(archive: zipfile.ZipFile, root: str, member: str, path: str):
    try:
        value = parse_json(archive.read(root + member))
    except (ValueError, zipfile.BadZipFile) as err:
        raise ValueError(f"path: {path!r}: archive member {member} is not JSON ({err})") from err
    if not isinstance(value, dict):
        raise ValueError(f"path: {path!r}: archive member {member} is not a JSON object")
    return value


def _check_program(program: dict, refuse) -> None:
    """Every node target and symbolic expression of a serialized program is one the loader may take."""
    for key in (program.get("range_constraints") or {}):
        _check_expr(key, refuse)

    values = [program.get("graph_module")]  # a stack, not recursion: any depth JSON parses to
    while values:
        value = values.pop()
        if isinstance(value, dict):
            target = value.get("target")
            if isinstance(target, str) and "inputs" in value:
                _check_target(target, refuse)
            expr = value.get("expr_str")
            if isinstance(expr, str):
                _check_expr(expr, refuse)
            for key in _FQN_KEYS:
                if key in value and not (key == "fqn" and value[key] == ""):
                    _check_fqn(value[key], refuse)
            values.extend(value.values())
        elif isinstance(value, list):
            values.extend(value)


def _check_target(target: str, refuse) -> None:
    parts = target.split(".")
    ok = ((len(parts) == 5 and parts[:2] == ["torch", "ops"] and parts[2] in _NAMESPACES
           and ".".join(parts[:4]) not in _DENIED_OPS)
          or (len(parts) == 2 and parts[0] == "_operator" and parts[1] in _OPERATORS)
          or (len(parts) == 2 and parts[0] == "math" and parts[1].isidentifier() and not parts[1].startswith("_"))
          or (len(parts) == 2 and parts[0] == "torch" and parts[1].startswith(("sym_", "_sym_")))
          or target in _COLLECTIVES)
    if not ok:
        raise refuse(f"a graph node calling {target!r:.120} (not an operator of {list(_NAMESPACES)})")


def _check_fqn(name, refuse) -> None:
    if not (isinstance(name, str) and _FQN.fullmatch(name)):
        raise refuse(f"a weight or module name that is not dotted letters, digits and '_' ({name!r:.120})")


def _check_expr(expr: str, refuse) -> None:
    position = 0
    while position < len(expr):
        match = _TOKEN.match(expr, position)
        token = match.group(0) if match else expr[position]
        word = token[0].isalpha() or token[0] == "_"
        if match is None or (word and token not in _SYMPY_NAMES and not _SYMBOL.fullmatch(token)):
            raise refuse(f"a symbolic expression that is not plain arithmetic ({expr!r:.120})")
        position = match.end()
