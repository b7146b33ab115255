"""The seams: a leaf contract, no import cycles, targets known only to the registry."""
import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib
import torch

from pagedpack import LLM, SamplingParams
from pagedpack.lowering import targets
from pagedpack.lowering.targets import LoweredStep, Target, TargetOptions, register_target
from pagedpack.models.tiny import tiny_model
from pagedpack.step.contract import METADATA_INPUTS
from pagedpack.step.metadata import StepMetadata

from conftest import hf_greedy, random_prompts, snapshot

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    """Every module of the installed ``pagedpack`` namespace, from pyproject's package-dir map."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    out = {}
    for package, folder in package_dir.items():
        for path in (ROOT / folder).rglob("*.py"):  # the target packages under lowering/ too
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts))
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path, modules: dict[str, Path], *, typing_only: bool = False) -> set[str]:
    """The project modules ``path`` imports anywhere (module level or inside functions); under
    ``if TYPE_CHECKING:`` (which never runs) only with ``typing_only``."""
    tree = ast.parse(path.read_text())
    skipped = set() if typing_only else {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                                         and getattr(block.test, "id", None) == "TYPE_CHECKING"
                                         for n in ast.walk(block)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != "pagedpack":  # the package itself: every module imports it first
                found.add(name)
    return found


def test_no_module_imports_another_in_a_cycle():
    """Counting typing-only imports too: a cycle through annotations is a cycle of the design."""
    modules = _modules()
    graph = {name: _imports(path, modules, typing_only=True) - {name} for name, path in modules.items()}
    assert "pagedpack.passes.pipeline" in graph and "pagedpack.step.contract" in graph
    state, cycles = {}, []

    def visit(name, stack):
        state[name] = "open"
        for dep in sorted(graph[name]):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_contract_and_the_step_metadata_are_leaves():
    modules = _modules()
    assert _imports(modules["pagedpack.step.contract"], modules, typing_only=True) == set()
    assert _imports(modules["pagedpack.step.metadata"], modules, typing_only=True) == set()
    assert StepMetadata._fields == METADATA_INPUTS


# What every format shares (the step contract and metadata, the description, checksums, the archive
# checks, atomic writes, device types): the formats, in their targets' packages under lowering/,
# import these packages, never the other way.
FORMAT_NEUTRAL = ("pagedpack.step", "pagedpack.formats", "pagedpack.host")


def test_the_format_neutral_packages_import_no_lowering_and_no_runtime():
    modules = _modules()
    neutral = [name for name in modules if name.startswith(FORMAT_NEUTRAL)]
    assert len(neutral) >= 10, neutral
    upward = ("pagedpack.lowering", "pagedpack.runtime", "pagedpack.compiler", "pagedpack.llm", "pagedpack.passes",
              "pagedpack.serve", "pagedpack.cli")
    found = {name: sorted(m for m in _imports(modules[name], modules, typing_only=True) if m.startswith(upward))
             for name in neutral}
    assert not any(found.values()), found


def test_the_pagedpack_folder_shows_its_roles():
    """``pagedpack/`` holds the public API (the engine, its options, prompts) as modules; every other
    role is a subpackage docs/design.md draws."""
    folder = ROOT / "pagedpack"
    assert {p.stem for p in folder.glob("*.py")} == {"__init__", "llm", "async_llm", "engine_args", "inputs", "chat"}
    design = (ROOT / "docs" / "design.md").read_text()
    for package in sorted(p.name for p in folder.iterdir() if (p / "__init__.py").is_file()):
        assert f"pagedpack/{package}/" in design, package


@pytest.mark.parametrize("module", ["pagedpack.passes.pipeline", "pagedpack.passes.varlen",
                                    "pagedpack.compiler.backend", "pagedpack.formats.export",
                                    "pagedpack.lowering.reference.target",
                                    "pagedpack.lowering.ascend.target", "pagedpack.lowering.onnx.target",
                                    "pagedpack.lowering.onnx.export", "pagedpack.compiler.program"])
def test_the_compile_side_imports_no_serving_runtime(module):
    """Passes, lowerings, the exporters and the program builder build their sample steps with
    pagedpack.step.metadata, not the scheduler's requests."""
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.startswith('pagedpack.runtime')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("module, absent", [
    ("pagedpack.runtime.engine", ["pagedpack.passes.pipeline", "pagedpack.llm", "transformers"]),
    ("pagedpack.formats.export", ["pagedpack.llm", "onnx", "onnxruntime", "onnxscript",
                                  "pagedpack.lowering.onnx.functions"]),
])
def test_importing_one_part_does_not_import_the_others(module, absent):
    code = f"import sys, {module}; print([m for m in {absent!r} if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_python_started_in_the_clone_imports_the_installed_kernels_package():
    """Started in the clone (``python -c``, a REPL), Python sees ``kernels/`` as a bare package.
    transformers 5.25 depends on the ``kernels`` distribution and imports it with its first model
    class; before, the clone's folder answered and every model load failed with an ImportError."""
    pytest.importorskip("kernels", reason="the kernels distribution is not installed")
    code = "from transformers import LlamaConfig; import kernels; print(kernels.__file__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert Path(result.stdout.strip()) != ROOT / "kernels" / "__init__.py"


# Names that stand for a target or a format: a comparison with one of them outside the registry is a
# capability asked by name. ``x.target`` alone is not (FX nodes have targets); ``x.target`` of an
# object that is not a graph node (args, self, llm, ...) is.
_NAMED = {"format", "fmt", "file_format", "format_name", "target_name", "lowering_target", "DEFAULT_TARGET",
          "FILE_TARGETS", "FORMATS"}
_HOLDERS = {"args", "self", "llm", "engine_args", "program", "step", "builder", "served", "exported"}


def _names_a_target_or_format(node: ast.AST, names: set[str]) -> bool:
    """Whether the comparison (or ``match``) ``node`` compares with a target or format name: a string
    literal of one (also inside a tuple, list or set), a registry constant, or an operand that holds
    one (``fmt``, ``args.format``, ``self.target``, ``target.name``). An identity test (``is None``,
    ``is owner``) compares objects, not names, unless with a literal name."""
    if isinstance(node, ast.Match):
        patterns = [p for case in node.cases for p in ast.walk(case.pattern) if isinstance(p, ast.MatchValue)]
        return _holds_a_name(node.subject) or any(_literal(p.value, names) for p in patterns)
    if not isinstance(node, ast.Compare):
        return False
    operands = (node.left, *node.comparators)
    if any(_literal(operand, names) for operand in operands):
        return True
    identity = all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops)
    return not identity and any(_holds_a_name(operand) for operand in operands)


def _literal(node: ast.AST, names: set[str]) -> bool:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_literal(e, names) for e in node.elts)
    return isinstance(node, ast.Constant) and node.value in names


def _holds_a_name(node: ast.AST) -> bool:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(map(_holds_a_name, node.elts))
    if isinstance(node, ast.Name):
        return node.id in _NAMED
    if isinstance(node, ast.Attribute):
        base = getattr(node.value, "id", None)
        return node.attr in _NAMED or node.attr == "target" and base in _HOLDERS or \
            node.attr == "name" and base in {"target", "fmt", "owner", "format"}
    return False


def _in_the_registry(name: str) -> bool:
    """The registry and each target's own package (``pagedpack.lowering.<target>``)."""
    return name == "pagedpack.lowering.targets" or name.startswith("pagedpack.lowering.") and name.count(".") >= 3


def test_no_target_or_format_name_is_compared_outside_the_registry():
    """No ``target == "ascend"``, ``fmt in ("pt2", "tp")``, ``x.target != DEFAULT_TARGET``,
    ``args.format == ...`` or ``match fmt: case "onnx":`` outside the registry and the target packages:
    code asks a target or a format for a capability instead (``Target.supports_tensor_parallel``,
    ``FileFormat.world_size``, ...)."""
    names = {*targets.target_names(), *targets.file_formats()}
    found = []
    for name, path in _modules().items():
        if _in_the_registry(name):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if _names_a_target_or_format(node, names):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)[:100]}")
    assert not found, "compares a target or format name:\n" + "\n".join(found)


def test_the_name_check_catches_every_form():
    names = {*targets.target_names(), *targets.file_formats()}
    for code in ('target == "ascend"', 'fmt in ("pt2", "tp")', "target.name != DEFAULT_TARGET",
                 "args.format == other", "self.target != name", 'args.attention != "x" and args.format == "pt2"',
                 'kind == "onnx"', 'x is "reference"', 'match kind:\n    case "pt2": pass'):
        assert any(_names_a_target_or_format(node, names) for node in ast.walk(ast.parse(code))), code
    for code in ('node.target == "_guards_fn"', 'u.target == "item"', "n.target is torch.ops.aten.mm.default",
                 "fmt.world_size is not None", "self.target is None", "get_target(self.target) is not owner"):
        assert not _names_a_target_or_format(ast.parse(code).body[0].value, names), code


def test_device_types_are_compared_only_in_the_devices_module():
    """``x.device.type == "cpu"``-style tests go through pagedpack.host.devices (is_cpu, is_npu, device_type)."""
    device_names = {"cpu", "npu", "cuda", "meta", "mps", "xpu"}
    for name, path in _modules().items():
        if name == "pagedpack.host.devices":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                literals = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant)}
                assert not device_names & literals, f"{name}:{node.lineno} compares a device type"


@dataclass(frozen=True)
class ToyOptions(TargetOptions):
    label: str = "toy lowering"

    def __post_init__(self):
        if not self.label:
            raise ValueError("label: expected a non-empty str")


@dataclass
class ToyTarget(Target):
    """A target defined in a few lines: the reference graph, run through a wrapper that counts steps."""

    name: str = "toy"
    default_block_size: int = 8
    options_type: type = ToyOptions
    steps: int = 0

    def lower(self, rewritten, options, *, block_size, bounds, device):
        def run(*inputs):
            self.steps += 1
            return rewritten.graph_module(*inputs)
        return LoweredStep(run, rewritten.kv_cache_specs, note=options.label)


def test_a_registered_toy_target_runs_end_to_end(capsys):
    toy = register_target(ToyTarget())
    try:
        model = tiny_model("llama")
        prompts = random_prompts((3, 20, 41), seed=7)
        reference = snapshot(model)
        llm = LLM(model, target="toy", num_blocks=32, target_options={"label": "labelled toy"})
        assert llm.block_size == 8 and "labelled toy" in llm.report.notes
        assert llm.engine_args.target_options == ToyOptions("labelled toy")
        with pytest.raises(ValueError, match="label: expected a non-empty str"):
            LLM(model, target="toy", num_blocks=32, target_options={"label": ""})
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
        assert toy.steps > 0
        for prompt, out in zip(prompts, outputs, strict=True):
            assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 6)
        from pagedpack.cli import main
        with pytest.raises(SystemExit):  # the CLI offers it among --target's choices
            main(["generate", "--help"])
        assert "{ascend,onnx,reference,toy}" in capsys.readouterr().out
    finally:
        targets._REGISTRY.pop("toy")


def test_llm_and_from_exported_share_one_validation(tmp_path):
    llm = LLM(tiny_model("llama"), num_blocks=4, keep_source_model=True)
    path = llm.export(tmp_path / "m.pt2")
    for build in (lambda **kw: LLM(tiny_model("llama"), **kw), lambda **kw: LLM.from_exported(path, **kw)):
        with pytest.raises(ValueError, match="num_blocks, kv_cache_memory, memory_budget: expected at most one of "
                                             "them, got num_blocks, kv_cache_memory"):
            build(num_blocks=4, kv_cache_memory=1 << 20)
        with pytest.raises(ValueError, match="max_num_seqs: expected an int >= 1, got 0"):
            build(max_num_seqs=0)
    with pytest.raises(ValueError, match="an exported file runs on the CPU in the dtype it was exported with"):
        LLM.from_exported(path, dtype=torch.float16)


def test_llm_is_a_thin_client_of_the_program_builder_and_the_engine():
    """``LLM`` builds a program (pagedpack.compiler.program), an engine, and generates: it stays small and
    imports no lowering module."""
    modules = _modules()
    assert len(modules["pagedpack.llm"].read_text().splitlines()) <= 200
    assert not {m for m in _imports(modules["pagedpack.llm"], modules) if m.startswith("pagedpack.lowering")}
