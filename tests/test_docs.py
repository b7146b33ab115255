"""The documentation cannot drift: the MkDocs site builds with ``--strict`` (no broken link or
anchor), the README's relative links resolve, the README keeps the commands ``.ci/run`` runs, and
every ```` ```python ```` block of ``README.md`` and ``docs/*.md`` runs.

A Python block runs as a script (``__name__ == "__main__"``), in a fresh namespace, in a temporary
folder, unless an HTML comment on the line right before its fence says otherwise:

- ``<!-- snippet: skip REASON -->``: not run (an NPU, a running server, a graph excerpt...); the
  test is reported skipped with the reason;
- ``<!-- snippet: continue -->``: run in the namespace the page's previous block left (the prose
  between them says "with the ``llm`` above").

The examples use the built-in tiny model (``"tiny"``), which loads offline in seconds. All blocks
run one after another in one child process (its imports paid once), and a block whose code, and
whose chain of ``continue`` blocks before it, is the same as one already run (the README repeats
the pages' first examples) is run once: both tests report that run. ``pytest -q`` prints, at the
end, how many blocks ran and how many were skipped (``tests/conftest.py``).
"""
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 250

_FENCE = re.compile(r"^(`{3,})(\S*)\s*$")
_MARKER = re.compile(r"^<!--\s*snippet:\s*(\S+)\s*(.*?)\s*-->$")


@dataclass
class Block:
    page: Path
    line: int  # the opening fence's, 1-based
    lang: str
    code: str
    marker: str | None  # "skip", "continue" or None
    reason: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:L{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of ``page`` (top level, not indented), each with its marker comment."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != m.group(1):
            j += 1
        marker = _MARKER.match(lines[i - 1].strip()) if i > 0 else None
        found.append(Block(page, i + 1, m.group(2), "\n".join(lines[i + 1:j]) + "\n",
                           marker.group(1) if marker else None, marker.group(2) if marker else ""))
        i = j + 1
    return found


PYTHON = [b for page in PAGES for b in blocks(page) if b.lang == "python"]


def _chains(snippets: list[Block]) -> tuple[dict[str, str], dict[str, str | None]]:
    """Each block's key (its code after its chain's: the ``continue`` blocks before it, back to the
    page's last block without one; equal keys run once) and its parent's key (None: a fresh namespace)."""
    keys, parents, previous = {}, {}, {}
    for b in snippets:
        if b.marker == "skip":
            continue
        parents[b.id] = previous.get(b.page) if b.marker == "continue" else None
        keys[b.id] = (parents[b.id] or "") + "\n#---\n" + b.code
        previous[b.page] = keys[b.id]
    return keys, parents


def test_every_python_block_has_a_known_marker():
    """A typo in a marker (``<!-- snippet: skp ... -->``) must not silently run or skip a block;
    a skip says why; ``continue`` follows a block of the same page that runs."""
    assert PYTHON, "no Python blocks found"
    bad = [b.id for b in PYTHON if b.marker not in (None, "skip", "continue")]
    bad += [f"{b.id}: skip without a reason" for b in PYTHON if b.marker == "skip" and len(b.reason) < 10]
    for page in PAGES:
        runnable = [b for b in PYTHON if b.page == page and b.marker != "skip"]
        if runnable and runnable[0].marker == "continue":
            bad.append(f"{runnable[0].id}: continue with no block before it")
    assert not bad, bad
    for page in PAGES:  # a marker that is not right before a fence attaches to nothing
        text = page.read_text().splitlines()
        for n, line in enumerate(text):
            if _MARKER.match(line.strip()):
                nxt = text[n + 1] if n + 1 < len(text) else ""
                assert _FENCE.match(nxt) and nxt.strip() != "```", f"{page.name}:L{n + 1}: marker not before a fence"


_RUNNER = textwrap.dedent("""
    import contextlib, io, json, os, sys, time, traceback
    jobs = json.load(open(sys.argv[1]))
    results, spaces = {}, {}
    for job in jobs:
        if job["key"] in results:
            continue
        space = spaces.get(job["parent"]) if job["parent"] else None
        space = space if space is not None else {"__name__": "__main__"}
        out, start = io.StringIO(), time.perf_counter()
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(job["code"], job["id"], "exec"), space)
            error = None
        except BaseException:
            error = traceback.format_exc()
        results[job["key"]] = {"id": job["id"], "error": error, "output": out.getvalue()[-4000:],
                               "seconds": round(time.perf_counter() - start, 2)}
        spaces[job["key"]] = space
        with open(sys.argv[2], "w") as f:  # after each block: a crash or a hang keeps what ran
            json.dump(results, f)
    sys.stdout.flush()
    os._exit(0)  # an engine's background thread must not hold the process
""")


@pytest.fixture(scope="module")
def snippet_results(tmp_path_factory):
    """Runs every Python block not skipped, in order, in one child process; ``{key: result}``."""
    keys, parents = _chains(PYTHON)
    jobs = [{"id": b.id, "key": keys[b.id], "parent": parents[b.id], "code": b.code}
            for b in PYTHON if b.marker != "skip"]
    work = tmp_path_factory.mktemp("snippets")
    (work / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "TQDM_DISABLE": "1"}  # no progress bars in the log
    timeout = 600
    try:
        done = subprocess.run([sys.executable, "-c", _RUNNER, str(work / "jobs.json"), str(work / "results.json")],
                              cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
        tail = done.stderr[-3000:]
    except subprocess.TimeoutExpired as e:
        tail = f"the snippet runner ran past {timeout} s; its stderr ends: {(e.stderr or b'')[-3000:]!r}"
    results = json.loads((work / "results.json").read_text()) if (work / "results.json").exists() else {}
    return keys, results, tail


@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_snippet(block, request, record_property):
    if block.marker == "skip":
        pytest.skip(f"{block.id}: {block.reason}")
    keys, results, tail = request.getfixturevalue("snippet_results")
    result = results.get(keys[block.id])
    assert result is not None, f"{block.id} did not run (the runner stopped before it):\n{tail}"
    ran = "" if result["id"] == block.id else f" (run as {result['id']}, the same code)"
    record_property("snippet_seconds", result["seconds"] if not ran else 0.0)  # tests/conftest.py sums them
    assert result["error"] is None, f"{block.id}{ran} raised:\n{result['error']}\nits output:\n{result['output']}"


def test_mkdocs_build_strict(tmp_path):
    """``mkdocs build --strict``: a broken link or anchor, a page missing from the nav or a bad
    config fails the suite."""
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install -e '.[test]' (mkdocs-material)")
    pytest.importorskip("material", reason="mkdocs-material is not installed: pip install -e '.[test]'")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
                          timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "WARNING" not in output, output
    assert (tmp_path / "site" / "index.html").exists(), output


def _github_slug(heading: str) -> str:
    """GitHub's anchor for a heading (markdown emphasis and code marks dropped)."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # no headings inside code
    return {_github_slug(h) for h in re.findall(r"^#{1,6}\s+(.*?)\s*#*$", text, flags=re.M)}


def test_readme_links_resolve():
    """Every relative link and image of README.md names a file of the repository and, with a
    ``#fragment``, a heading of it (as GitHub renders it; the README is not part of the site)."""
    text = re.sub(r"^```.*?^```", "", (ROOT / "README.md").read_text(), flags=re.S | re.M)
    links = re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text)
    assert links, "no links found"
    broken = []
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue
        path, _, fragment = link.partition("#")
        target = ROOT / path if path else ROOT / "README.md"
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif fragment and target.suffix == ".md" and fragment not in _anchors(target):
            broken.append(f"{link}: no heading '#{fragment}' in {target.relative_to(ROOT)}")
    assert not broken, broken


def test_readme_stays_short_and_keeps_the_two_commands():
    """The README is the front page (the rest is in docs/): at most 250 lines, with the two set-up
    commands, the second exactly as ``.ci/run`` runs it, and the warning about the clone's folder."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES, f"README.md: {len(readme.splitlines())} lines"
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("pip install")]
    assert ci and ci[-1] in readme, ci
    assert "pip install torch==2.13.0 -e . && pagedpack generate" in readme
    assert "ImportError: cannot import name 'LLM' from 'pagedpack' (unknown location)" in readme


def _cli_commands() -> list[tuple[str, str]]:
    """``(where, command)`` for each ``pagedpack ...`` command of a bash block."""
    found = []
    for page in PAGES:
        for b in blocks(page):
            if b.lang not in ("bash", "sh", "shell"):
                continue
            for line in b.code.replace("\\\n", " ").splitlines():
                for part in re.split(r"&&|\|\||;|\|", line):
                    if part.split()[:1] == ["pagedpack"]:
                        found.append((b.id, part.strip()))
    return found


def test_cli_commands_in_the_docs_parse():
    """The ``pagedpack`` commands of the pages' bash blocks name subcommands and flags the CLI has
    (parsed, not run)."""
    from pagedpack.cli import build_parser

    commands = _cli_commands()
    assert len(commands) >= 3, commands
    bad = []
    for where, command in commands:
        try:
            build_parser().parse_args(shlex.split(command, comments=True)[1:])
        except SystemExit:
            bad.append(f"{where}: {command}")
    assert not bad, bad


def test_the_models_page_keeps_the_walk_table_as_generated():
    """The walk's table (``python tests/causal_lm_walk.py --table``) is pasted whole: every name is a
    model type transformers registers, once, and each row's count matches its names."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    text = (DOCS / "models.md").read_text()
    start, end = text.index("<!-- generated: python tests/causal_lm_walk.py"), text.index("<!-- end of the generated")
    rows = [line.split("|") for line in text[start:end].splitlines() if line.startswith("| ")][1:]
    assert rows and rows[0][2].strip().startswith("exact ("), rows[:1]
    names = [n.strip() for row in rows for n in row[1].split(",")]
    assert len(names) == len(set(names)), "a model type in two rows"
    assert not set(names) - set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), set(names) - set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    for row in rows:
        count = re.search(r"\((\d+)\)", row[2])
        if count and ("exact" in row[2] or "not constructed" in row[2]):
            assert int(count.group(1)) == len(row[1].split(",")), row[2]
