"""vLLM CPU's side of ``lora.py``: the same configurations through vLLM's ``LLM(enable_lora=True)``,
run by the vLLM venv's interpreter. usage: ``python lora_vllm.py MODEL_DIR ARGS_JSON`` (``lora.py``'s
arguments); prints, after each configuration, a JSON line of the rows so far (``lora.py``'s, without the
ratios) and vLLM's version: a run cut short keeps what it measured."""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lora import ADAPTER_COUNTS, prompts, timed  # noqa: E402  (after the path: lora.py imports no pagedpack at top)


def main() -> None:
    model_dir, given = sys.argv[1], json.loads(sys.argv[2])
    args = type("Args", (), given)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    ids = [TokensPrompt(prompt_token_ids=p) for p in prompts(args)]
    common = dict(model=model_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=1024, seed=0,
                  enable_prefix_caching=False, max_num_seqs=args.num_seqs)

    def runner(llm, loras):
        return lambda n: llm.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                                      use_tqdm=False, lora_request=loras)

    import vllm

    plain = LLM(**common)
    rows = {"none": timed(runner(plain, None), args)}
    del plain
    llm = LLM(**common, enable_lora=True, max_loras=8, max_lora_rank=args.rank)
    for count in ADAPTER_COUNTS:
        adapters = [LoRARequest(f"a{i}", i + 1, str(Path(args.adapters, f"a{i}"))) for i in range(count)]
        loras = [adapters[i % count] for i in range(args.num_seqs)] if count else None
        rows[f"{count}_adapters"] = timed(runner(llm, loras), args)
        print(json.dumps({"rows": rows, "version": vllm.__version__}), flush=True)  # the rows so far


if __name__ == "__main__":
    main()
