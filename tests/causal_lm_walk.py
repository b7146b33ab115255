"""Every ``...ForCausalLM`` class the installed ``transformers`` registers
(``MODEL_FOR_CAUSAL_LM_MAPPING``), built from a tiny random config and served on one short batched
case: exact greedy tokens against ``transformers``' ``generate`` per prompt, or refused with a
reason. ``tests/test_causal_lm_walk.py`` asserts it; ``python tests/causal_lm_walk.py`` prints the
support table of docs/models.md (one row per class: its outcome and, for a refusal, the reason).

A family whose config does not construct with the tiny sizes below, or whose model would still be
large (more than :data:`MAX_PARAMETERS`), is "not constructed": nothing is claimed about it.
"""
from __future__ import annotations

import argparse
import copy
import json
import re
import resource
import subprocess
import sys
from dataclasses import dataclass

import torch
import transformers as T
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from conftest import hf_last_logits

V = 258
MAX_PARAMETERS = 8_000_000
PROMPT_LENS = (1, 5, 19)  # a decode-sized prompt, and one crossing a block of 16 in two chunks
MAX_TOKENS = 3

# tiny sizes by config field (transformers' names, aliases included)
_SIZES = {
    64: ("hidden_size", "d_model", "n_embd", "hidden_dim", "dim", "embed_dim", "word_embed_proj_dim"),
    2: ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_key_value_heads", "n_kv_heads",
        "num_kv_heads", "num_experts_per_tok", "moe_topk", "num_experts_per_token"),
    4: ("num_attention_heads", "n_head", "n_heads", "num_heads", "num_experts", "num_local_experts",
        "n_routed_experts", "moe_num_experts"),
    16: ("head_dim", "v_head_dim", "kv_channels"),
    128: ("intermediate_size", "ffn_dim", "moe_intermediate_size", "shared_expert_intermediate_size",
          "ffn_hidden_size", "n_inner", "expert_intermediate_size", "d_ff"),
    512: ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"),
    32: ("kv_lora_rank", "q_lora_rank"),
    8: ("qk_rope_head_dim", "qk_nope_head_dim", "rotary_dim"),
    1: ("n_shared_experts", "first_k_dense_replace", "num_shared_experts", "n_group", "topk_group"),
    V: ("vocab_size",),
}
_TINY = {name: size for size, names in _SIZES.items() for name in names}
# fields the generic shrinking cannot derive, by class
EXTRA = {"gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
         "mamba2": dict(num_heads=8)}  # num_heads * head_dim = expand * hidden_size


@dataclass
class Outcome:
    model_type: str
    class_name: str
    status: str  # "exact", "refused", "not constructed", "differs", "raised", "crashed"
    detail: str = ""


_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def tiny_overrides(config: T.PretrainedConfig, *, keep_layers: bool = False) -> dict:
    """The fields of ``config`` (a default instance) set to :data:`_TINY` sizes: token ids kept
    inside the tiny vocabulary, per-layer lists and layer-indexed dicts cut to two layers
    (``layer_types``: one of each kind where there are several), nested configs likewise. With
    ``keep_layers``, the layer count and the per-layer fields stay the config's own (a hybrid whose
    layer kinds follow from fields the cut would lose: indices, periods, patterns)."""
    fields = config.to_dict()
    layers = next((fields[k] for k in _LAYER_COUNTS if isinstance(fields.get(k), int)), None)
    out = {}
    for key, value in fields.items():
        if keep_layers and (key in _LAYER_COUNTS or key == "layer_types" or isinstance(value, (list, dict))
                            and not isinstance(getattr(config, key, None), T.PretrainedConfig)):
            continue
        if key in _TINY and isinstance(value, int) and not isinstance(value, bool):
            out[key] = _TINY[key]
        elif key.endswith("token_id") and isinstance(value, int) and value >= V:
            out[key] = V - 1
        elif key.endswith("token_id") and isinstance(value, list):
            out[key] = [min(v, V - 1) for v in value if isinstance(v, int)]
        elif key == "layer_types" and isinstance(value, list) and value:
            out[key] = (list(dict.fromkeys(value)) * 2)[:2]
        elif isinstance(value, list) and layers and len(value) == layers:
            out[key] = value[:2]
        elif isinstance(value, dict) and isinstance(getattr(config, key, None), T.PretrainedConfig):
            out[key] = {**value, **tiny_overrides(getattr(config, key), keep_layers=keep_layers)}
        elif isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
            out[key] = {k: v for k, v in value.items() if int(k) < 2}
    if "qk_rope_head_dim" in out and "head_dim" in out:  # multi-head latent attention: head_dim is the rotary part
        out["head_dim"] = out["qk_rope_head_dim"]
    if "kv_lora_rank" in out and "num_key_value_heads" in out:  # and its keys have every query head
        out["num_key_value_heads"] = out.get("num_attention_heads", _TINY["num_attention_heads"])
    return out


def tiny_model(model_type: str) -> torch.nn.Module:
    """The model of ``model_type`` from a tiny random config (seed 0): two layers, or, where two
    layers lose a layer class or do not run, the config's own layer count and per-layer fields
    (:func:`tiny_overrides`); raises the two-layer attempt's error if neither works."""
    try:
        return _tiny_model(model_type, keep_layers=False)
    except Exception as two_layers:
        try:
            return _tiny_model(model_type, keep_layers=True)
        except Exception:
            raise two_layers from None


def _tiny_model(model_type: str, *, keep_layers: bool) -> torch.nn.Module:
    """The tiny model; raises if it does not construct, is larger than :data:`MAX_PARAMETERS`
    (counted on the meta device first: some defaults the walk cannot shrink would take the
    machine's memory) or does not run a forward on three tokens."""
    config_class = T.CONFIG_MAPPING[model_type]
    default = config_class()
    config = config_class(**{**tiny_overrides(default, keep_layers=keep_layers), **EXTRA.get(model_type, {})})
    with torch.device("meta"):
        tiny, full = (T.AutoModelForCausalLM.from_config(c) for c in (config, default))
    lost = {type(m).__name__ for m in full.modules()} - {type(m).__name__ for m in tiny.modules()}
    if lost:  # e.g. a hybrid whose config derives its layer kinds from fields the walk shrank
        raise ValueError(f"the tiny config loses the layer classes {sorted(lost)}")
    size = sum(p.numel() for p in tiny.parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"{size / 1e6:.1f}M parameters with the tiny sizes")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = T.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))  # the unmodified model runs on the tiny sizes
    return model


def walk_one(model_type: str) -> Outcome:
    """Build, serve and compare one registered class (see the module docstring)."""
    from pagedpack import LLM, SamplingParams
    from pagedpack.step.contract import UnsupportedModelError

    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    try:
        model = tiny_model(model_type)
    except Exception as err:  # a config this walk cannot shrink: no claim either way
        return Outcome(model_type, class_name, "not constructed", f"{type(err).__name__}: {_line(err)}")
    reference = copy.deepcopy(model)
    vocab = min(V, model.get_output_embeddings().weight.shape[0] if model.get_output_embeddings() is not None else V)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    try:
        llm = LLM(model, block_size=16, num_blocks=64, max_num_batched_tokens=16)
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    except UnsupportedModelError as err:
        why = err.report.refusal() if err.report is not None else None
        return Outcome(model_type, class_name, "refused", why or _line(err))
    except ValueError as err:  # the LLM's own checks (not a causal LM that generates, attention form)
        return Outcome(model_type, class_name, "refused", _line(err))
    except Exception as err:
        return Outcome(model_type, class_name, "raised", f"{type(err).__name__}: {_line(err)}")
    for prompt, out in zip(prompts, outputs):
        expected = greedy(reference, prompt)
        if out.error is not None or out.outputs[0].token_ids != expected:
            return Outcome(model_type, class_name, "differs",
                           f"prompt of {len(prompt)}: {out.outputs[0].token_ids} != {expected} ({out.error})")
    return Outcome(model_type, class_name, "exact")


def greedy(model, prompt: list[int]) -> list[int]:
    """The unmodified model's greedy tokens on ``prompt`` alone: the whole sequence run again for
    each token, without a cache, stopping at the checkpoint's eos ids as pagedpack does (``generate``
    would apply the checkpoint's logits processors too: BART's forces an eos at the last position)."""
    from pagedpack.models.loading import eos_token_ids

    eos, tokens = set(eos_token_ids(model)), list(prompt)
    for _ in range(MAX_TOKENS):
        tokens.append(int(hf_last_logits(model, tokens).argmax()))
        if tokens[-1] in eos:
            break
    return tokens[len(prompt):]


def _line(err: BaseException) -> str:
    """The first line of ``err``'s message that says something (not a heading ending in a colon)."""
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    said = [line for line in lines if not line.endswith(":")]
    return (said or lines or [""])[0][:300]


def table(rows: list[dict]) -> str:
    """The support table of docs/models.md (markdown) of walked outcomes, by ``model_type``: the exact ones
    in one row, then a row per refusal reason (the classes that share it), then those the walk did
    not construct."""
    exact = sorted(r["model_type"] for r in rows if r["status"] == "exact")
    reasons: dict[str, list[str]] = {}
    for r in rows:
        if r["status"] not in ("exact", "not constructed"):
            why = re.sub(r"^the rewrite stopped at [a-z_]+: (\w+ refused: )?", "", r["detail"])
            why = re.sub(r" \([^()]*(\([^()]*\)[^()]*)*\)", "", why)  # the layer, node, sample: per class
            reasons.setdefault(f"{r['status']}: {why[:200]}", []).append(r["model_type"])
    lines = ["| model types | outcome |", "|---|---|", f"| {', '.join(exact)} | exact ({len(exact)}) |"]
    lines += [f"| {', '.join(sorted(names))} | {why} |" for why, names in sorted(reasons.items())]
    skipped = sorted(r["model_type"] for r in rows if r["status"] == "not constructed")
    lines.append(f"| {', '.join(skipped)} | not constructed by the walk's tiny config ({len(skipped)}): no claim |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """``python tests/causal_lm_walk.py [MODEL_TYPE ...]``: one JSON line per class (all by
    default), each walked in a subprocess of its own (at most 8 GB, 10 minutes: a class that
    takes more is "crashed"). ``--table FILE``: :func:`table` of such lines."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_types", nargs="*", metavar="MODEL_TYPE",
                        help="model types of MODEL_FOR_CAUSAL_LM_MAPPING (default: all)")
    parser.add_argument("--table", metavar="FILE", help="print docs/models.md's table of a walk's JSON lines")
    parser.add_argument("--one", metavar="MODEL_TYPE", help=argparse.SUPPRESS)  # the subprocess of one class
    args = parser.parse_args(argv)
    unknown = [t for t in args.model_types + [args.one] if t is not None and t not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
    if unknown:
        parser.error(f"MODEL_TYPE: expected model types of MODEL_FOR_CAUSAL_LM_MAPPING, got {', '.join(unknown)}")
    if args.one:
        print(json.dumps(walk_one(args.one).__dict__), flush=True)
        return
    if args.table:
        with open(args.table) as f:
            print(table([json.loads(line) for line in f if line.strip()]))
        return
    for model_type in args.model_types or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))  # noqa: E731
        try:
            done = subprocess.run([sys.executable, __file__, "--one", model_type], capture_output=True, text=True,
                                  timeout=600, preexec_fn=limit)
            line = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
        except subprocess.TimeoutExpired:
            line, done = "", None
        if not line.startswith("{"):
            why = "timed out" if done is None else f"exit status {done.returncode}: {done.stderr.strip()[-200:]}"
            line = json.dumps(Outcome(model_type, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type], "crashed",
                                      why).__dict__)
        print(line, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
