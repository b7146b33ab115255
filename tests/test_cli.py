"""The ``pagedpack`` command as a user runs it (the installed console script)."""
import re
import shutil
import subprocess

import pytest

from pagedpack import LLM
from pagedpack.models.tiny import tiny_model
from pagedpack.models.tokenizer import byte_level_tokenizer

from conftest import run_cli


def run(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("pagedpack")
    assert exe, "the pagedpack console script is not installed (pip install -e .)"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300)


@pytest.fixture
def refused(monkeypatch, capsys):
    """``refused(*args)``: ``pagedpack ARGS`` run in this process (``run_cli``), for the options
    refused before a model is loaded (loading one fails the test); ``(exit code, stderr)``."""
    def loaded(*_, **__):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(LLM, "from_engine_args", loaded)
    return lambda *args: run_cli(capsys, *args)[::2]


@pytest.fixture
def cli(capsys):
    """``cli(*args)``: ``pagedpack ARGS`` in this process (``run_cli``), as a ``CompletedProcess``; the
    console script itself, with its seconds of imports, runs once, in the first test."""
    def call(*args: str) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(args, *run_cli(capsys, *args))
    return call


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2")
    tiny_model("qwen2").save_pretrained(path)
    byte_level_tokenizer().save_pretrained(path)
    return str(path)


def test_generate_with_no_argument_uses_the_builtin_model():
    result = run("generate")
    assert result.returncode == 0, result.stderr
    for field in ("requests", "prompt tokens", "generated tokens", "tokens/s", "KV blocks", "KV memory",
                  "contiguous"):
        assert field in result.stdout
    assert "8 (0 failed)" in result.stdout


def test_generate_on_a_saved_model_directory(cli, model_dir):
    result = cli("generate", "--model", model_dir, "--prompt", "Hello there", "--max-tokens", "5")
    assert result.returncode == 0, result.stderr
    assert "1 (0 failed)" in result.stdout


def test_inspect_prints_the_pass_report(cli, model_dir):
    result = cli("inspect", "--model", model_dir)
    assert result.returncode == 0, result.stderr
    assert "attention sites: 2 found, 2 rewritten, 0 refused" in result.stdout
    assert "pagedpack.paged_attention.default" in result.stdout


def test_a_bad_argument_is_reported_without_traceback(refused):
    code, stderr = refused("generate", "--model", "tiny", "--block-size", "0")
    assert code == 2 and stderr == "pagedpack: error: block_size: expected an int >= 1, got 0\n"


def test_generate_on_the_ascend_target_runs_on_the_emulation(cli):
    result = cli("generate", "--model", "tiny", "--target", "ascend", "--prompt", "Hi", "--max-tokens", "4")
    assert result.returncode == 0, result.stderr
    assert "1 (0 failed)" in result.stdout and "x 128 tokens" in result.stdout


def test_generate_n_completions_and_a_kv_plot(cli, tmp_path):
    from matplotlib.image import imread

    from pagedpack.cli.kv_plot import DPI, FIGURE_SIZE

    plot = tmp_path / "kv.png"
    result = cli("generate", "--model", "tiny", "--n", "2", "--temperature", "0.7", "--seed", "3",
                 "--max-tokens", "6", "--kv-plot", str(plot))
    assert result.returncode == 0, result.stderr
    assert "completion 0" in result.stdout and "completion 1" in result.stdout
    assert "prefix cache" in result.stdout and f"KV plot: {plot}" in result.stdout.replace("\n", "")
    image = imread(plot)  # decodes as a PNG
    assert image.shape[:2] == (int(FIGURE_SIZE[1] * DPI), int(FIGURE_SIZE[0] * DPI))


def test_the_summary_says_prefix_caching_is_off_and_what_speculation_took(cli):
    """... and text of the user's (a prompt with rich's markup in it) is printed as it is, not parsed."""
    result = cli("generate", "--model", "tiny", "--max-tokens", "8", "--no-enable-prefix-caching", "--no-chat-template",
                 "--prompt", "a [/] [bold]c a [/] [bold]c", "--speculative-config", '{"num_speculative_tokens": 3}')
    assert result.returncode == 0, result.stderr
    assert "prompt: 'a [/] [bold]c a [/] [bold]c'" in result.stdout, result.stdout
    assert re.search(r"prefix cache\s*│\s*off\s*│", result.stdout), result.stdout
    row = re.sub(r"[\s│]+", " ", result.stdout[result.stdout.index("speculative decoding"):])
    assert re.match(r"speculative decoding ngram, up to 3 draft tokens per request and step \(5-gram prompt lookup\): "
                    r"\d+ of \d+ draft tokens accepted", row), row


@pytest.mark.parametrize("args, message", [
    (("--kv-plot-step", "3"), "--kv-plot-step: only with --kv-plot FILE.png"),
    (("--kv-plot", "x.png", "--kv-plot-step", "-1"), "--kv-plot-step: expected a step >= 0, got -1"),
    (("--n", "0"), "n: expected an int >= 1, got 0"),
    (("--kv-plot", "/tmp"), "--kv-plot: expected a .png file in an existing folder, got '/tmp'"),
    (("--kv-plot", "/missing/folder/kv.png"), "expected a .png file in an existing folder"),
    (("--kv-plot", "kv.txt"), "expected a .png file in an existing folder"),
])
def test_bad_generate_options_fail_before_loading(refused, args, message):
    code, stderr = refused("generate", "--model", "tiny", *args)
    assert code == 2 and message in stderr


def test_plan_prints_the_memory_plan(cli):
    result = cli("plan", "--model", "tiny", "--memory", "64MiB", "--max-model-len", "512")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    plan = LLM("tiny", num_blocks=8, max_model_len=512).plan_memory("64MiB", keep_source_model=False)
    served = dict(plan.rows())["weights"]  # the source let go, as `generate` serves it
    weights = f"weights │ {served.split(' resident')[0]} resident"
    for field in ("memory budget │ 64.0 MiB", weights, "KV bytes │ 1024*tokens", "activation peak(T, B) │ Max(",
                  "KV pool", "largest max_num_batched_tokens", "sequences of 512 tokens"):
        assert field in text, field
    # the KV pool per --kv-cache-dtype: the budget less weights and activations over each dtype's bytes a
    # block (int8: 4 layers x 2 KV heads x K and V x 16 values and a 4-byte scale)
    free = plan.memory - plan.weight_bytes - plan.activation_bytes
    for name, per_token in (("auto", 1024), ("bfloat16", 512), ("float16", 512), ("int8", 320)):
        blocks = free // (per_token * plan.block_size)
        ratio = blocks / (free // (1024 * plan.block_size))
        assert f"│ {name} │ {per_token} │ {blocks} │ {blocks * plan.block_size} │" in text, name
        assert f"{ratio:.2f}x" in text


def test_plan_s_dtype_table_says_n_a_where_auto_holds_no_block():
    """A budget where the model's own dtype fits no block but bfloat16 fits one: no ``nanx`` ratio."""
    from rich.console import Console

    from pagedpack.cli.commands import _kv_capacity

    llm = LLM("tiny", num_blocks=8, max_model_len=512)
    plan = llm.plan_memory("64MiB", keep_source_model=False)
    memory = plan.weight_bytes + plan.activation_bytes + 12 * 1024  # auto: 16 KiB a block; bfloat16: 8 KiB
    console = Console(record=True, width=200)
    console.print(_kv_capacity(llm, memory))
    text = " ".join(console.export_text().split())
    assert "│ auto │ 1024 │ 0 │ 0 │" in text and "│ bfloat16 │ 512 │ 1 │ 16 │" in text, text
    assert "nan" not in text and "n/a (auto: none)" in text


def test_plan_rejects_a_bad_budget_before_loading(refused):
    code, stderr = refused("plan", "--model", "tiny", "--memory", "a lot")
    assert code == 2 and "--memory: expected a positive number of bytes" in stderr
    code, stderr = refused("plan", "--model", "tiny", "--memory", "8MiB", "--num-blocks", "5",
                           "--memory-budget", "1GiB")
    assert code == 2 and "--num-blocks, --memory-budget: pagedpack plan sizes the KV pool from --memory" in stderr
