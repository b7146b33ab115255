"""A user target with a file format of its own, end to end. The rule for a fresh process: it knows a user
target once it has registered it (imported the module defining it, called ``register_target``)."""
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pagedpack import LLM, SamplingParams
from pagedpack.formats.files import atomic_write
from pagedpack.lowering import targets
from pagedpack.lowering.reference import pt2, target
from pagedpack.models.tiny import tiny_model

from conftest import hf_greedy, snapshot

MAGIC = b"PAGEDTOY\n"  # a .toy file: this marker, then a .pt2 archive


def export_toy(rewritten, path, description=None) -> str:
    with tempfile.TemporaryDirectory() as tmp, atomic_write(path) as out:
        Path(out).write_bytes(MAGIC + Path(pt2.export_pt2(rewritten, Path(tmp, "s.pt2"), description)).read_bytes())
    return str(path)


def load_toy(path, *, trust_file=False):
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "s.pt2").write_bytes(Path(path).read_bytes()[len(MAGIC):])
        return pt2.load_pt2(Path(tmp, "s.pt2"), trust_file=trust_file)


TOY = targets.FileFormat("toy", ".toy", MAGIC, export_toy, load_toy, description="a marker, then a .pt2 archive")


@dataclass
class ToyTarget(target.ReferenceTarget):  # lowers and serves as the reference target does; writes .toy files
    name: str = "toyfile"
    formats: tuple = (TOY,)


PROMPTS, PARAMS = [[5, 9, 2, 7], [11, 3, 3, 8, 1, 6, 40]], SamplingParams(temperature=0.0, max_tokens=6)
FRESH = ("import json, sys; sys.path.insert(0, {tests!r}); import test_toy_target as toy; "
         "toy.targets.register_target(toy.ToyTarget()); llm = toy.LLM({path!r}, num_blocks=16); "
         "print(json.dumps([o.outputs[0].token_ids for o in llm.generate(toy.PROMPTS, toy.PARAMS, use_tqdm=False)]))")


def test_a_user_target_writes_its_own_format_and_a_fresh_process_serves_it(tmp_path, monkeypatch):
    monkeypatch.setattr(targets, "_REGISTRY", dict(targets._REGISTRY))  # the registration ends with the test
    targets.register_target(ToyTarget())
    model = tiny_model("llama")
    reference, llm = snapshot(model), LLM(model, target="toyfile", num_blocks=16, keep_source_model=True)
    path = llm.export(tmp_path / "m.toy", format="toy")
    assert Path(path).read_bytes().startswith(MAGIC) and targets.format_of(path)[0] is TOY
    here = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert here == [hf_greedy(reference, prompt, 6) for prompt in PROMPTS]
    result = subprocess.run([sys.executable, "-c", FRESH.format(tests=str(Path(__file__).parent), path=path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == here
