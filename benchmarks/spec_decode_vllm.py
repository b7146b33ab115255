"""vLLM CPU's side of ``spec_decode.py``: the same cells through vLLM's ``LLM(speculative_config=...)``,
run by the vLLM venv's interpreter. usage: ``python spec_decode_vllm.py MODEL_DIR < {"args": ..., "prompts":
...}`` (``spec_decode.py``'s arguments and token ids, as JSON on stdin); prints, after each configuration, a
JSON line of the configurations so far (``spec_decode.py``'s rows, without the ratios; a configuration vLLM
will not build: ``refused``, its error) and vLLM's version: a run cut short keeps what it measured.
Statistics logging is on in every configuration (``get_metrics()`` needs it): the speculation counters."""
import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from spec_decode import CONFIGS, run_configs  # noqa: E402  (after the path: spec_decode.py imports no pagedpack at top)


def spec_counters(llm) -> dict:
    """vLLM's ``vllm:spec_decode_*`` metrics (Prometheus, over the process's life), summed over labels."""
    found = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            value = list(metric.values) if hasattr(metric, "values") else metric.value
            old = found.get(metric.name)
            found[metric.name] = value if old is None else (
                [x + y for x, y in zip(old, value)] if isinstance(value, list) else old + value)
    return found


def main() -> None:
    model_dir, given = sys.argv[1], json.load(sys.stdin)
    args, prompts = type("Args", (), given["args"]), given["prompts"]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    import vllm
    from vllm import LLM, SamplingParams

    common = dict(model=model_dir, dtype=args.dtype, skip_tokenizer_init=True, max_model_len=2048, seed=0,
                  enable_prefix_caching=False, max_num_seqs=max(args.streams), disable_log_stats=False)
    configs = {}
    for name in args.configs:
        spec = CONFIGS[name]
        try:
            llm = LLM(**common, **({"speculative_config": spec} if spec else {}))
        except Exception as err:  # noqa: BLE001  (whatever vLLM says: the answer sought)
            if spec is None:
                raise
            configs[name] = {"config": spec, "refused": f"{type(err).__name__}: {err}"}
        else:
            engines = {name: (llm, spec_counters if spec else None)}  # one at a time: each takes its KV space
            configs[name] = {"config": spec, "rows": run_configs(engines, SamplingParams, prompts, args)[name]}
            del llm
            gc.collect()
        print(json.dumps({"configs": configs, "version": vllm.__version__}), flush=True)  # the configurations so far


if __name__ == "__main__":
    main()
