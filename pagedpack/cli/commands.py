"""``pagedpack`` command line: ``generate``, ``serve``, ``disagg-proxy``, ``inspect``, ``export`` and ``plan``."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pagedpack.chat import has_chat_template, render
from pagedpack.compiler.program import ProgramBuilder
from pagedpack.engine_args import EngineArgs
from pagedpack.inputs import KV_CACHE_DTYPES
from pagedpack.llm import LLM
from pagedpack.lowering.onnx.export import ATTENTIONS
from pagedpack.lowering.targets import (
    TargetUnavailableError,
    export_format_for,
    format_names,
    get_format,
    get_target,
)
from pagedpack.models.aliases import DEFAULT_MODEL, TINY_ALIAS
from pagedpack.runtime.engine_loop import EngineDeadError
from pagedpack.runtime.flow_control import MAX_UNSENT_TOKENS, FlowControl
from pagedpack.runtime.outputs import merge
from pagedpack.runtime.sampling import SamplingParams
from pagedpack.serve import DEFAULT_PREFILL_TIMEOUT_S

DEFAULT_PROMPTS = [
    "Hello",
    "What is the capital of France?",
    "Paged attention stores keys and values in fixed-size blocks, so",
    "Once upon a time, in a land far away, there lived a small team of engineers who wanted to "
    "serve language models without padding. They wrote a compiler pass that",
    "def fibonacci(n):",
    "Q: What is continuous batching?\nA:",
    "In a packed batch, all tokens of all sequences form one row, and the sequence boundaries "
    "travel as cumulative lengths. The attention kernel reads each sequence's keys and values "
    "through its block table, and the causal mask is aligned to the bottom right, so that a "
    "chunked prefill sees the tokens it cached in earlier steps. This means",
    "1, 2, 3, 4,",
]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless that is None or a flag's False (the
    help then says what happens)."""

    def _get_help_string(self, action):
        text = action.help or ""
        unshown = any(action.default is d for d in (None, False, argparse.SUPPRESS))
        if action.required or unshown or "%(default)" in text:
            return text
        return f"{text} (default: %(default)s)".lstrip()


def build_parser() -> argparse.ArgumentParser:
    """The ``pagedpack`` argument parser, every subcommand with its options."""
    parser = argparse.ArgumentParser(prog="pagedpack", description=__doc__.replace("``", ""))
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with the rewritten model",
                         formatter_class=_HelpFormatter)
    EngineArgs.add_cli_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable); default: built-in prompts")
    gen.add_argument("--max-tokens", type=int, default=32, help="new tokens per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this probability mass")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = all")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed; default: not seeded")
    gen.add_argument("--n", type=int, default=1, help="completions per prompt (the prompt's KV is computed once)")
    gen.add_argument("--stop", action="append", default=None, help="a stop string (repeatable); cut from the text")
    gen.add_argument("--no-chat-template", dest="chat_template", action="store_false",
                     help="send the prompts as raw text; by default a model whose tokenizer has a chat template "
                          "gets each prompt as a user message")
    gen.add_argument("--kv-plot", metavar="FILE.png", default=None,
                     help="draw the KV block pool over the run (needs matplotlib: pip install 'pagedpack[plot]')")
    gen.add_argument("--kv-plot-step", type=int, default=None,
                     help="the step whose block ownership --kv-plot shows; default: the step with most blocks in use")

    srv = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API (/v1/completions, "
                                       "/v1/chat/completions, /metrics)", formatter_class=_HelpFormatter)
    srv.add_argument("model_tag", nargs="?", default=None, metavar="MODEL_OR_FILE",
                     help="the model to serve, as --model takes it (default: --model's)")
    EngineArgs.add_cli_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    srv.add_argument("--port", type=int, default=8000, help="port to listen on")
    srv.add_argument("--api-key", default=os.environ.get("PAGEDPACK_API_KEY"),
                     help="require 'Authorization: Bearer KEY' on /v1/* (default: $PAGEDPACK_API_KEY; unset: no key)")
    srv.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the model "
                                                               "argument as given)")
    srv.add_argument("--chat-template", default=None, help="a Jinja chat template file, or the template itself "
                                                           "(default: the tokenizer's)")
    srv.add_argument("--trust-request-chat-template", action="store_true",
                     help="let a request bring its own chat_template (rendered in transformers' sandbox)")
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help='serve tool_choice "auto" (the default with tools): the model\'s text is read for calls by '
                          "--tool-call-parser (docs/tool-calling.md)")
    srv.add_argument("--tool-call-parser", default=None, metavar="NAME",
                     help="the format the model writes tool calls in: hermes (<tool_call>{...}</tool_call>: Qwen2.5, "
                          "Qwen3, Hermes, SmolLM3) or pythonic ([f(a=1)]: Llama 3.2, Gemma 3)")
    srv.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                     help='leave the tools out of the prompt when a request says tool_choice "none" (by default the '
                          "template gets them, as vLLM does)")
    srv.add_argument("--lora-modules", nargs="+", action="extend", default=None, metavar="NAME=PATH",
                     help="LoRA adapters served from the start, each a `model` of its own (needs --enable-lora): "
                          'name=path, or JSON {"name": ..., "path": ..., "base_model_name": ...}; repeatable '
                          "(docs/lora.md)")
    srv.add_argument("--lora-root", default=None, metavar="DIR",
                     help="the directory /v1/load_lora_adapter may read adapters from (with "
                          "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true; needs --enable-lora)")
    srv.add_argument("--max-queue", type=int, default=1024,
                     help="most requests waiting for their first step; more get HTTP 503 with Retry-After")
    srv.add_argument("--max-unsent-tokens", type=int, default=MAX_UNSENT_TOKENS,
                     help="a request whose client leaves more of its tokens unread is paused (its KV freed) "
                          "until the client reads again")
    srv.add_argument("--stream-stall-timeout", type=float, default=60.0, metavar="SECONDS",
                     help="a request paused this long for an unread stream is aborted")
    srv.add_argument("--max-tokenize-queue", type=int, default=256,
                     help="most requests being rendered and tokenized or waiting for it; more get HTTP 503 with "
                          "Retry-After")
    srv.add_argument("--metrics-namespace", default="pagedpack", choices=["pagedpack", "vllm"],
                     help="prefix of the /metrics names (vllm: vLLM's names exactly, for its dashboards)")
    srv.add_argument("--timeout-graceful-shutdown", type=float, default=5.0, metavar="SECONDS",
                     help="once SIGINT/SIGTERM comes, how long in-flight requests may finish before they are aborted")
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                     help="uvicorn's log level")
    srv.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                     help="engine replicas; above 1, served as a Ray Serve application (joins the Ray cluster of "
                          "RAY_ADDRESS, or one running on this host, else starts one): docs/scale-out.md")
    srv.add_argument("--request-router", default="prefix-aware",
                     choices=["prefix-aware", "round-robin", "power-of-two"],
                     help="with --data-parallel-size: which replica takes a request (prefix-aware: the one holding "
                          "the longest cached prefix of its prompt, else the least loaded)")
    srv.add_argument("--num-cpus-per-replica", type=float, default=1.0,
                     help="with --data-parallel-size: the Ray CPUs each engine replica reserves")

    proxy = sub.add_parser("disagg-proxy", help="one OpenAI endpoint over a prefill server and a decode server "
                                                 "(prefill/decode disaggregation: docs/disaggregation.md)",
                           formatter_class=_HelpFormatter)
    proxy.add_argument("--prefill", required=True, metavar="URL",
                       help="the prefill server (pagedpack serve --kv-transfer-config with kv_role kv_producer), "
                            "e.g. http://127.0.0.1:8100")
    proxy.add_argument("--decode", required=True, metavar="URL",
                       help="the decode server (kv_role kv_consumer), e.g. http://127.0.0.1:8200")
    proxy.add_argument("--host", default="127.0.0.1", help="address to listen on")
    proxy.add_argument("--port", type=int, default=8000, help="port to listen on")
    proxy.add_argument("--prefill-timeout", type=float, default=DEFAULT_PREFILL_TIMEOUT_S, metavar="SECONDS",
                       help="the prefill server's whole (one-token) answer; past it the client gets a 504 and the "
                            "prefill request is aborted")
    proxy.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                       help="uvicorn's log level")

    insp = sub.add_parser("inspect", help="print the pass report (and optionally the rewritten graph)",
                          formatter_class=_HelpFormatter)
    EngineArgs.add_cli_args(insp, engine=False)
    insp.add_argument("--graph", action="store_true", help="also print the rewritten graph's code")

    exp = sub.add_parser("export", help="export the rewritten step program (.pt2 archive or ONNX model)",
                         formatter_class=_HelpFormatter)
    EngineArgs.add_cli_args(exp, engine=False)
    exp.add_argument("--format", default=None, choices=format_names(),
                     help="default: the one --out's suffix names, else pt2; " + "; ".join(
                         f"{name}: {get_format(name)[0].description}" for name in format_names()))
    exp.add_argument("--attention", default=None, choices=ATTENTIONS,
                     help="onnx only: the pagedpack domain's functions (default; any onnxruntime provider) or "
                          "com.microsoft.PagedAttention (onnxruntime CUDA; needs --dtype float16/bfloat16)")
    exp.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                     help="write one .pt2 per rank of this many and a manifest naming them (--out NAME.json), "
                          "served with LLM('NAME.json') / pagedpack serve NAME.json")
    exp.add_argument("--enable-lora", action="store_true",
                     help="give the linears LoRA inputs, so that the .pt2 serves adapters (docs/lora.md)")
    exp.add_argument("--out", required=True, help="file to write, e.g. model.pt2 or model.onnx")

    plan = sub.add_parser("plan", help="plan memory: KV bytes per token, the symbolic activation peak, the blocks "
                                       "and sequences a budget holds", formatter_class=_HelpFormatter)
    EngineArgs.add_cli_args(plan)
    plan.add_argument("--memory", required=True, help="the budget in bytes, e.g. 4GiB or 512MB")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        commands = {"generate": _generate, "serve": _serve, "disagg-proxy": _disagg_proxy, "inspect": _inspect,
                    "export": _export, "plan": _plan}
        return commands[args.command](args)
    except BrokenPipeError:  # output piped into e.g. `head`, which stopped reading
        sys.stderr.close()
        return 0
    except (ValueError, OSError, TargetUnavailableError) as err:  # bad arguments, unsupported or missing model
        print(f"pagedpack: error: {err}", file=sys.stderr)
        return 2
    except EngineDeadError as err:  # e.g. a tensor-parallel worker died
        print(f"\npagedpack: error: {err}", file=sys.stderr)
        return 1


def _generate(args) -> int:
    console = Console()
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens, stop=args.stop)  # bad values fail first
    timeline = _kv_timeline(args)
    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM.from_engine_args(engine_args)
    if timeline is not None:
        llm.llm_engine.step_observers.append(timeline)
    prompts = args.prompt or DEFAULT_PROMPTS
    where = f", emulated on {args.device}" if get_target(llm.target).emulated(args.device) else ""
    tp_size = llm.engine_args.tensor_parallel_size
    where += f", {tp_size} tensor-parallel ranks (gloo)" if tp_size > 1 else ""
    builtin = args.model in (DEFAULT_MODEL, TINY_ALIAS)
    console.print(f"[bold]model:[/bold] {escape(str(args.model))}"
                  + (" (built-in, random weights: the text is noise by design)" if builtin else "")
                  + f"  [bold]target:[/bold] {llm.target}{where}")
    chat = args.chat_template and has_chat_template(llm.tokenizer)
    if chat:
        console.print("[bold]chat template:[/bold] each prompt is a user message (--no-chat-template: raw text)")
    start = time.perf_counter()
    requests = [render(llm.tokenizer, [{"role": "user", "content": p}])[1] for p in prompts] if chat else prompts
    shown = {tuple(r.content): p for r, p in zip(requests, prompts)} if chat else {}
    outputs = _stream(console, llm.generate(requests, params, stream=True), shown, params.n)
    elapsed = time.perf_counter() - start
    console.print(_summary(llm, outputs, elapsed))
    if timeline is not None:
        from pagedpack.cli.kv_plot import draw_kv_timeline

        step = args.kv_plot_step
        if step is not None and step >= timeline.num_steps:
            console.print(f"--kv-plot-step {step}: the run had {timeline.num_steps} steps; showing the busiest")
            step = None
        shown = draw_kv_timeline(timeline, args.kv_plot, step)
        console.print(f"[bold]KV plot:[/bold] {escape(str(args.kv_plot))} ({timeline.num_steps} steps; "
                      f"blocks of step {shown})")
    return 1 if all(o.error for o in outputs) else 0


def _stream(console: Console, deltas, prompts: dict[tuple, str], n: int) -> list:
    """Show each completion's text as it is generated, one completion at a time on screen (the
    others' text is held until their turn, in the order their first tokens came); ``prompts``:
    the prompt to show by prompt token ids (chat prompts), else each output's own; ``n``:
    completions per prompt. Returns the
    whole outputs, in request order."""
    whole, shown, turns, current = {}, {}, [], None
    for delta in deltas:
        whole[delta.request_id] = merge(whole.get(delta.request_id), delta)
        keys = [(delta.request_id, None)] if delta.error else [(delta.request_id, c.index) for c in delta.outputs]
        turns += [key for key in keys if key not in shown and key not in turns]
        while current is not None or turns:
            if current is None:
                current = turns.pop(0)
                shown[current] = 0
                out = whole[current[0]]
                console.rule(f"request {current[0]}" + (f", completion {current[1]}" if n > 1 else ""))
                prompt = prompts.get(tuple(out.prompt_token_ids), out.prompt)
                console.print(f"[bold]prompt:[/bold] {escape(repr(prompt))}")
                if current[1] is None:
                    console.print(f"[red]error:[/red] {escape(str(out.error))}")
                    current = None
                    continue
            completion = next(c for c in whole[current[0]].outputs if c.index == current[1])
            console.out(completion.text[shown[current]:], end="", highlight=False)
            shown[current] = len(completion.text)
            if not completion.finished:
                break
            console.print(f"\n[dim](finish reason: {completion.finish_reason})[/dim]")
            current = None
    return [whole[i] for i in sorted(whole, key=int)]


def _serve(args) -> int:
    from pagedpack.async_llm import check_online
    from pagedpack.serve.models import LoRAModulePath
    from pagedpack.serve.openai_serving import ServingConfig
    from pagedpack.serve.server import ServerOptions, serve

    if args.model_tag is not None:
        args.model = args.model_tag
    bounds = [("--port", args.port, 0, 65535), ("--max-queue", args.max_queue, 1, None),
              ("--max-unsent-tokens", args.max_unsent_tokens, 1, None),
              ("--max-tokenize-queue", args.max_tokenize_queue, 1, None)]
    for name, value, low, high in bounds:  # before the model is loaded
        if value < low or (high is not None and value > high):
            raise ValueError(f"{name}: expected an int in [{low}, {high if high is not None else 'inf'}], got {value}")
    if not args.timeout_graceful_shutdown >= 0:  # NaN too
        raise ValueError(f"--timeout-graceful-shutdown: expected seconds >= 0, got {args.timeout_graceful_shutdown}")
    if not args.stream_stall_timeout > 0:
        raise ValueError(f"--stream-stall-timeout: expected seconds > 0, got {args.stream_stall_timeout}")
    if args.data_parallel_size != 1 and args.kv_offload_dir is not None:  # each replica would lock it
        raise ValueError(f"--kv-offload-dir: a folder serves one live process (its lock); expected none with "
                         f"--data-parallel-size {args.data_parallel_size}, got {args.kv_offload_dir!r}")
    lora_modules = tuple(LoRAModulePath.parse(text) for text in args.lora_modules or ())
    for flag, given in (("--lora-modules", lora_modules), ("--lora-root", args.lora_root)):
        if given and not args.enable_lora:
            raise ValueError(f"{flag}: LoRA adapters are served with --enable-lora; expected it too")
        if given and args.data_parallel_size != 1:
            raise ValueError(f"{flag}: LoRA adapters are not served over --data-parallel-size replicas yet; "
                             "expected --data-parallel-size 1")
    template = args.chat_template
    if template is not None and Path(template).is_file():
        template = Path(template).read_text(encoding="utf-8")
    name = args.served_model_name or str(args.model)
    config = ServingConfig(model_name=name, chat_template=template,  # checked before the model is loaded
                           trust_request_chat_template=args.trust_request_chat_template, max_queue=args.max_queue,
                           max_tokenize_queue=args.max_tokenize_queue,
                           enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                           exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
                           lora_modules=lora_modules, lora_root=args.lora_root)
    engine_args = EngineArgs.from_cli_args(args)
    check_online(engine_args)
    flow_control = FlowControl(args.max_unsent_tokens, args.stream_stall_timeout)
    if args.data_parallel_size != 1:
        from pagedpack.serve.ray_app import RayServeOptions, pagedpack_app, run

        options = RayServeOptions(data_parallel_size=args.data_parallel_size, request_router=args.request_router,
                                  num_cpus=args.num_cpus_per_replica, api_key=args.api_key,
                                  metrics_namespace=args.metrics_namespace, flow_control=flow_control)
        return run(pagedpack_app(engine_args, config, options), host=args.host, port=args.port)
    llm = LLM.from_engine_args(engine_args)
    return serve(llm, config, ServerOptions(host=args.host, port=args.port, api_key=args.api_key,
                                            metrics_namespace=args.metrics_namespace, log_level=args.log_level,
                                            graceful_s=args.timeout_graceful_shutdown, flow_control=flow_control))


def _disagg_proxy(args) -> int:
    import uvicorn

    from pagedpack.serve.disagg_proxy import DisaggProxy, build_proxy_app

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port: expected an int in [0, 65535], got {args.port}")
    for name in ("prefill", "decode"):
        url = getattr(args, name)
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--{name}: expected an http:// or https:// URL, got {url!r}")
    app = build_proxy_app(DisaggProxy(args.prefill, args.decode, prefill_timeout_s=args.prefill_timeout))
    print(f"pagedpack: disagg-proxy on http://{args.host}:{args.port}/v1 (prefill {args.prefill}, decode "
          f"{args.decode})", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           access_log=False))
    server.run()
    return 0 if server.started else 1


def _kv_timeline(args):
    """A recorder for ``--kv-plot``, or None; checks its arguments before anything is loaded."""
    if args.kv_plot is None:
        if args.kv_plot_step is not None:
            raise ValueError("--kv-plot-step: only with --kv-plot FILE.png")
        return None
    if args.kv_plot_step is not None and args.kv_plot_step < 0:
        raise ValueError(f"--kv-plot-step: expected a step >= 0, got {args.kv_plot_step}")
    path = Path(args.kv_plot)
    if path.suffix.lower() != ".png" or not path.parent.is_dir():
        raise ValueError(f"--kv-plot: expected a .png file in an existing folder, got {args.kv_plot!r}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--kv-plot: needs matplotlib (pip install 'pagedpack[plot]')") from None
    from pagedpack.cli.kv_plot import KVTimeline

    return KVTimeline()


def _summary(llm: LLM, outputs, elapsed: float) -> Table:
    engine = llm.llm_engine
    kv = engine.scheduler.kv_cache_manager
    stats = llm.get_stats()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs if not o.error)
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    per_token = llm.bytes_per_token
    used = kv.peak_used_blocks * llm.block_size * per_token
    sequences = sum(len(o.outputs) for o in outputs)  # completions: n per prompt
    contiguous = sequences * llm.max_model_len * per_token
    table = Table(title="summary", show_header=False)
    rows = [
        ("requests", f"{len(outputs)} ({sum(bool(o.error) for o in outputs)} failed)"),
        ("prompt tokens", str(prompt_tokens)),
        ("generated tokens", str(generated)),
        ("generation time", f"{elapsed:.2f} s (after loading and capture)"),
        ("throughput", f"{generated / elapsed:.1f} generated tokens/s, "
                       f"{(prompt_tokens + generated) / elapsed:.1f} total tokens/s"),
        ("steps", f"{stats.num_steps} ({stats.num_preemptions} preemptions)"),
        ("prefix cache", f"{stats.prefix_cache_hits} of {stats.prefix_cache_queries} tokens looked up at admission "
                         f"were cached ({100 * stats.prefix_cache_hit_rate:.1f}%; re-admissions after preemption look "
                         f"up again); {stats.num_prompt_tokens_computed} prompt tokens computed; "
                         f"{stats.num_evictions} blocks evicted" if kv.enable_prefix_caching else "off"),
        ("KV blocks", f"peak {stats.kv_blocks_peak_used}, in use {stats.kv_blocks_used}, cached and free "
                      f"{stats.kv_blocks_cached_free}, free {stats.kv_blocks_free}, pool {stats.kv_blocks_total} "
                      f"x {llm.block_size} tokens"),
        ("KV memory", f"{stats.kv_cache_dtype} cache: peak {_mib(used)} used of a "
                      f"{_mib(kv.num_blocks * llm.block_size * per_token)} pool; "
                      f"a contiguous {sequences} x max_len={llm.max_model_len} preallocation takes "
                      f"{_mib(contiguous)} ({100 * used / contiguous:.1f}% of that used)"),
    ]
    if engine.proposer is not None:
        drafted, accepted = stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens
        share = f" ({100 * accepted / drafted:.0f}%)" if drafted else ""
        rows.append(("speculative decoding",
                     f"{engine.proposer.config.describe()}: {accepted} of {drafted} draft tokens accepted{share}"))
    graphs = getattr(llm.program, "graphs", None)
    if graphs is not None:
        rows.append(("graph mode", graphs.describe()))
    for key, value in rows:
        table.add_row(key, escape(value))  # text, not markup: model paths, prompts and errors are the user's
    return table


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.2f} MiB"


def _inspect(args) -> int:
    _, _, rewritten = ProgramBuilder(EngineArgs.from_cli_args(args)).capture()
    print(rewritten.report.format())
    if args.graph:
        print(rewritten.graph_module.code)
    return 0 if rewritten.ok else 1


def _plan(args) -> int:
    from pagedpack.inputs import parse_bytes

    memory = parse_bytes("--memory", args.memory)  # before the model is loaded
    sized = [f"--{n.replace('_', '-')}" for n in ("num_blocks", "kv_cache_memory", "memory_budget")
             if getattr(args, n) is not None]
    if sized:
        raise ValueError(f"{', '.join(sized)}: pagedpack plan sizes the KV pool from --memory; drop them")
    llm = LLM.from_engine_args(EngineArgs.from_cli_args(args, num_blocks=1, memory_budget=None,
                                                        kv_cache_memory=None, keep_source_model=True))
    table = Table(title=f"memory plan: {escape(str(args.model))} ({llm.target} target)", show_header=False)
    for key, value in llm.plan_memory(memory, keep_source_model=False).rows():  # as `generate` would serve
        table.add_row(key, escape(value))
    Console().print(table)
    Console().print(_kv_capacity(llm, memory))
    return 0


def _kv_capacity(llm: LLM, memory: int) -> Table:
    """The KV pool the same budget gives with each ``--kv-cache-dtype`` the target takes."""
    table = Table(title="KV pool by --kv-cache-dtype")
    for column in ("KV dtype", "bytes per token", "blocks", "tokens", f"sequences of {llm.max_model_len}",
                   "tokens vs auto"):
        table.add_column(column, justify="left" if column == "KV dtype" else "right")
    base = llm.plan_memory(memory, keep_source_model=False, kv_cache_dtype="auto")
    shown = set()
    for name, dtype in KV_CACHE_DTYPES.items():
        if dtype in shown:  # another name of a dtype listed already ("fp8")
            continue
        shown.add(dtype)
        try:
            plan = llm.plan_memory(memory, keep_source_model=False, kv_cache_dtype=name)
        except ValueError:  # a dtype the target does not take
            continue
        ratio = f"{plan.kv_pool_tokens / base.kv_pool_tokens:.2f}x" if base.kv_pool_tokens else "n/a (auto: none)"
        table.add_row(name, str(plan.kv_bytes_per_token), str(max(0, plan.num_blocks)), str(plan.kv_pool_tokens),
                      str(plan.concurrent_seqs), ratio)
    return table


def _export(args) -> int:
    from pagedpack.formats.export import check_output_path

    fmt = export_format_for(args.out, args.format)[0]
    options = {"attention": args.attention} if args.attention is not None else {}
    fmt.check_options(options)  # before the model is loaded
    check_output_path(args.out, "--out")
    llm = LLM.from_engine_args(EngineArgs.from_cli_args(args, num_blocks=1, keep_source_model=True,
                                                        tensor_parallel_size=1))
    path = llm.export(args.out, format=fmt.name, tensor_parallel_size=args.tensor_parallel_size, **options)
    what = f"a manifest of {args.tensor_parallel_size} {fmt.suffix} files beside it" \
        if args.tensor_parallel_size > 1 else fmt.name
    print(f"wrote {path} ({what}); run it with {fmt.hint(path, options)}")
    return 0
