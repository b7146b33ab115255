"""Every ``...ForCausalLM`` class the installed ``transformers`` registers
(``MODEL_FOR_CAUSAL_LM_MAPPING``), built from a tiny random config and served on one short batched
case: exact greedy tokens against ``transformers``' ``generate`` per prompt, refused with a
reason, or "unrunnable": transformers' own model fails (on the tiny config, and on the meta device
from its default config too), with its error. ``tests/test_causal_lm_walk.py`` asserts it;
``python tests/causal_lm_walk.py`` prints the support table of docs/models.md (one row per class:
its outcome and, for a refusal, the reason).

The tiny config is derived from the config class itself: sizes by field name and by the shape of
a name, per-layer fields cut to layers that keep every layer kind, sub-configs alike, and what the
config's validation (or its model's construction) demands learned from its errors. A class whose
config still does not construct, or whose model would still be large (more than
:data:`MAX_PARAMETERS`), is "not constructed": nothing is claimed about it.
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
MAX_PARAMETERS = 16_000_000
PROMPT_LENS = (1, 5, 19)  # a decode-sized prompt, and one crossing a block of 16 in two chunks
MAX_TOKENS = 3

# tiny sizes by config field (transformers' names, aliases included)
_SIZES = {
    64: ("hidden_size", "d_model", "n_embd", "hidden_dim", "dim", "embed_dim", "word_embed_proj_dim"),
    2: ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_blocks", "num_key_value_heads", "n_kv_heads",
        "num_kv_heads", "num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k"),
    4: ("num_attention_heads", "n_head", "n_heads", "num_heads", "num_experts", "num_local_experts",
        "n_routed_experts", "moe_num_experts", "index_topk"),
    16: ("head_dim", "v_head_dim", "kv_channels"),
    128: ("intermediate_size", "ffn_dim", "moe_intermediate_size", "shared_expert_intermediate_size",
          "ffn_hidden_size", "n_inner", "expert_intermediate_size", "d_ff"),
    512: ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"),
    32: ("kv_lora_rank", "q_lora_rank"),
    8: ("qk_rope_head_dim", "qk_nope_head_dim", "rotary_dim"),
    1: ("n_shared_experts", "first_k_dense_replace", "num_shared_experts", "n_group", "topk_group", "num_expert_group"),
    V: ("vocab_size",),
}
_TINY = {name: size for size, names in _SIZES.items() for name in names}
# tiny sizes by the shape of a field's name, for the fields the table does not name (encoder_ffn_dim,
# index_n_heads, swa_head_dim, vocab_size_per_layer_input, encoder_hash_byte_group_vocab, emb_dim, ...); a Mamba
# mixer's heads stay (its heads times head dim follow from its expand and the hidden size), and so do Zamba's
# attention sizes (its attention reads the hidden state and the embeddings concatenated)
_PATTERNS = tuple((re.compile(pattern), size) for pattern, size in (
    (r"(?<!type_)vocab(_size)?(_per_layer_input)?$", V), (r"(intermediate_size|ffn_dim)$", 128),
    (r"^(encoder|decoder)_layers$", 2), (r"(key_value|kv)_heads$", 2),
    (r"(?<!mamba_)(attention_heads|n_heads|num_heads)$", 4), (r"(?<!^attention_)head_dim$", 16),
    (r"(?<!^attention_)(hidden_size|hidden_size_global|embed_dim|emb_dim|embedding_dim)$", 64)))
# fields the generic shrinking cannot derive, by class
EXTRA = {"gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
         "mamba2": dict(num_heads=8),  # num_heads * head_dim = expand * hidden_size
         "xlstm": dict(qk_dim_factor=1.0),  # its config rounds qk_dim up to a multiple of 64, its model does not
         "reformer": dict(axial_pos_embds_dim=[32, 32]),  # they sum to hidden_size
         # default layouts without an attention layer (transformers' own forward fails on them) or without any
         "bamba": dict(attn_layer_indices=[1]), "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
         "lfm2_moe": dict(layer_types=["conv", "full_attention"])}


@dataclass
class Outcome:
    model_type: str
    class_name: str
    status: str  # "exact", "refused", "unrunnable" (by transformers), "not constructed", "differs", "raised", "crashed"
    detail: str = ""


_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def _tiny_size(key: str) -> int | None:
    """The tiny size of field ``key``: by name (:data:`_TINY`), else by the shape of its name (:data:`_PATTERNS`)."""
    return _TINY.get(key, next((size for pattern, size in _PATTERNS if pattern.search(key)), None))


def _shrunk(fields: object) -> object:
    """A per-layer entry (a dict of fields, as in ``per_layer_config``) with its sizes tiny."""
    if not isinstance(fields, dict):
        return fields
    return _consistent({k: _tiny_size(k) if _tiny_size(k) and type(v) is int else v for k, v in fields.items()})


def _layer_indices(key: str, value: object, layers: int) -> bool:
    """Whether ``value`` holds layer indices rather than per-layer kinds: a list of ints, each a
    layer, under a key that names layers (``kv_source_layers``: the layer whose KV each layer
    reads; ``index_layers``, ``mlp_only_layers``: which layers are of a kind)."""
    if "layer" not in key or key.startswith("num_") or not isinstance(value, list) or not value:
        return False
    if not all(type(v) is int and 0 <= v < layers for v in value):
        return False
    if len(value) == layers:  # a layer's source, never a later layer; 0/1 flags are kinds (no_rope_layers)
        return not set(value) <= {0, 1} and all(v <= i for i, v in enumerate(value))
    return len(set(value)) == len(value)


def _kept_layers(fields: dict, layers: int) -> list[int]:
    """Indices of the layers a cut keeps: in order, each layer that brings a value of a per-layer list
    (``layer_types``, ``mlp_layer_types``, sparsity patterns ...) no kept layer has yet, so that every
    kind of layer and every combination the lists' first occurrences make survives; at least two. A
    per-layer list of layer indices (:func:`_layer_indices`) counts as whether the layer is its own
    source, and the sources of the kept layers are kept too; a list of indices of fewer layers marks
    those layers as a kind."""
    lists = []
    for key, value in fields.items():
        if _layer_indices(key, value, layers) and len(value) == layers:
            lists.append([v == i for i, v in enumerate(value)])
        elif _layer_indices(key, value, layers):
            lists.append([i in value for i in range(layers)])
        elif isinstance(value, list) and len(value) == layers:
            lists.append(value)
    kept, seen = [], set()
    for i in range(layers):
        new = {(n, repr(v[i])) for n, v in enumerate(lists)} - seen
        if new:
            kept.append(i)
            seen |= new
    kept = sorted(kept + [i for i in range(layers) if i not in kept][:max(0, 2 - len(kept))])
    sources = {v[i] for k, v in fields.items() if _layer_indices(k, v, layers) and len(v) == layers for i in kept}
    return sorted(set(kept) | sources)


def tiny_overrides(config: T.PretrainedConfig, *, keep_layers: bool = False, widths: set | None = None) -> dict:
    """The fields of ``config`` (a default instance) set to tiny sizes (:func:`_tiny_size`; a size
    field the default leaves None too, where the table names it): token ids kept inside the tiny
    vocabulary, per-layer lists and layer-indexed dicts cut to the layers :func:`_kept_layers` keeps
    (the layer count with them), counts of a subset of the layers (``num_kv_shared_layers``) scaled
    to the cut unless they partition the layers, nested configs likewise; a width field named by
    neither (``adapter_out_dim``) whose default is a hidden size of the config or of one nested in it
    (``widths``) is the tiny hidden size. With ``keep_layers``, the layer count and the per-layer
    fields stay the config's own (a hybrid whose layer kinds follow from fields the cut would lose:
    indices, periods, patterns)."""
    fields = config.to_dict()
    if widths is None:
        widths = {c.get("hidden_size") for c in (fields, *fields.values()) if isinstance(c, dict)} - {None}
    layer_key = next((k for k in _LAYER_COUNTS if isinstance(fields.get(k), int)), None)
    layers = fields[layer_key] if layer_key else None
    kept = _kept_layers(fields, layers) if layers and not keep_layers else list(range(2))
    out = {layer_key: len(kept)} if layer_key and not keep_layers else {}
    counts = {k: v for k, v in fields.items()
              if "layers" in k and k != layer_key and type(v) is int and layers and 0 < v <= layers}
    if keep_layers or len(counts) > 1 and sum(counts.values()) == layers:  # kept, or a partition (input, output)
        counts = {}
    for key, value in fields.items():
        if key == layer_key or keep_layers and (key in _LAYER_COUNTS or key == "layer_types" or isinstance(
                value, (list, dict)) and not isinstance(getattr(config, key, None), T.PretrainedConfig)):
            continue
        if _tiny_size(key) and isinstance(value, int) and not isinstance(value, bool) or value is None and key in _TINY:
            out[key] = _tiny_size(key)
        elif type(value) is int and value in widths and re.search("dim|size", key):
            out[key] = _TINY["hidden_size"]
        elif key.endswith("token_id") and isinstance(value, int) and value >= V:
            out[key] = V - 1
        elif key.endswith("token_id") and isinstance(value, list):
            out[key] = [min(v, V - 1) for v in value if isinstance(v, int)]
        elif layers and _layer_indices(key, value, layers):  # renumbered to the kept layers
            out[key] = ([kept.index(value[i]) for i in kept] if len(value) == layers
                        else [kept.index(v) for v in value if v in kept])
        elif isinstance(value, list) and layers and len(value) == layers:  # sizes per layer shrink too
            out[key] = [_tiny_size(key) if _tiny_size(key) and type(value[i]) is int else value[i] for i in kept]
        elif key in counts:
            out[key] = max(1, round(value * len(kept) / layers))
        elif isinstance(value, dict) and isinstance(getattr(config, key, None), T.PretrainedConfig):
            out[key] = {**value, **tiny_overrides(getattr(config, key), keep_layers=keep_layers, widths=widths)}
        elif isinstance(value, dict) and value and all(str(k).isdigit() for k in value):  # by layer index
            out[key] = {type(k)(str(kept.index(int(k))).zfill(len(str(k)))): _shrunk(v)
                        for k, v in value.items() if int(k) in kept}
    return _consistent(out)


def _consistent(out: dict) -> dict:
    """Shrunk fields made consistent where the tiny sizes alone are not: multi-head latent attention's
    head_dim is the rotary part, and its keys have every query head."""
    if "qk_rope_head_dim" in out and "head_dim" in out:
        out["head_dim"] = out["qk_rope_head_dim"]
    if "kv_lora_rank" in out and "num_key_value_heads" in out:
        out["num_key_value_heads"] = out.get("num_attention_heads", _TINY["num_attention_heads"])
    return out


_DEMAND = re.compile(r"`?(\w+)`? ?(?:=|must be(?: between)?|must equal|must match) ?(-?\d+|\w+(?: [+*] \w+)*)\b")


def make_config(config_class: type, overrides: dict, *, tries: int = 4) -> T.PretrainedConfig:
    """``config_class(**overrides)``, with what its own validation, or its model's construction (on
    the meta device), demands learned from the error ("head_dim must equal qk_nope_head_dim +
    qk_rope_head_dim", "`num_experts_per_tok=1` only", "make sure that `is_decoder=True`") and the
    config built again ("must be between 1 and ...": its lower bound); a model error that demands
    nothing is left to the caller."""
    overrides = dict(overrides)
    for _ in range(tries):
        config = None
        try:
            config = config_class(**overrides)
            with torch.device("meta"):
                T.AutoModelForCausalLM.from_config(config)
            return config
        except Exception as err:
            if not _learn(err, config_class, overrides):
                if config is not None:
                    return config
                raise
    return config_class(**overrides)


def _learn(err: Exception, config_class: type, overrides: dict) -> bool:
    """Whether ``err`` demands a field value that ``overrides`` lacks, now set there: the number, or
    the sum or product of the fields it names (in the sub-config that has the field, or
    ``text_config``, where the config has no such field of its own)."""
    demand = _DEMAND.search(str(err))
    if demand is None:
        return False
    subs = [v for v in overrides.values() if isinstance(v, dict) and demand[1] in v]
    own = hasattr(config_class, demand[1]) or "text_config" not in getattr(config_class, "sub_configs", {})
    target = overrides if own else subs[0] if subs else overrides.setdefault("text_config", {})
    try:
        names = {k: target.get(k, getattr(config_class, k, None)) for k in re.findall(r"[a-z_]\w*", demand[2])}
        value = eval(demand[2], {"__builtins__": {}}, names)  # a number, or field names joined by + and *
    except Exception:
        return False
    if not isinstance(value, int) or target.get(demand[1]) == value:
        return False
    target[demand[1]] = value
    return True


def tiny_model(model_type: str) -> torch.nn.Module:
    """The model of ``model_type`` from a tiny random config (seed 0): two layers, or, where two
    layers lose a layer class or do not run, the config's own layer count and per-layer fields
    (:func:`tiny_overrides`); raises the two-layer attempt's error, caused by the other's, if neither works."""
    errors = []
    for keep_layers in (False, True):
        try:
            return _tiny_model(model_type, keep_layers=keep_layers)
        except Exception as err:
            errors.append(err)
    raise errors[0] from errors[1]


def _tiny_model(model_type: str, *, keep_layers: bool) -> torch.nn.Module:
    """The tiny model; raises if it does not construct, is larger than :data:`MAX_PARAMETERS`
    (counted on the meta device first: some defaults the walk cannot shrink would take the
    machine's memory) or does not run a forward on three tokens."""
    config_class = T.CONFIG_MAPPING[model_type]
    default = make_config(config_class, {})
    overrides = tiny_overrides(default, keep_layers=keep_layers)
    config = make_config(config_class, {**overrides, **EXTRA.get(model_type, {})})
    with torch.device("meta"):
        tiny = T.AutoModelForCausalLM.from_config(config)
        try:
            full = T.AutoModelForCausalLM.from_config(default)
        except Exception:  # transformers cannot build its own default (a field it leaves None): none to compare
            full = tiny
    lost = _layer_classes(full) - _layer_classes(tiny)
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


def _layer_classes(model: torch.nn.Module) -> set[str]:
    """The names of ``model``'s module classes that transformers defines (not torch's ``Identity``)."""
    return {type(m).__name__ for m in model.modules() if type(m).__module__.startswith("transformers.")}


def default_fails(model_type: str) -> str | None:
    """How transformers' own model of ``model_type``'s default config fails, built and run on three
    tokens on the meta device (no memory for its real sizes), or None where it does not."""
    try:
        config = make_config(T.CONFIG_MAPPING[model_type], {})
        with torch.device("meta"), torch.no_grad():
            T.AutoModelForCausalLM.from_config(config)(torch.tensor([[1, 2, 3]]))
    except Exception as err:
        return _said(err)
    return None


def walk_one(model_type: str) -> Outcome:
    """Build, serve and compare one registered class (see the module docstring)."""
    from pagedpack import LLM, SamplingParams
    from pagedpack.step.contract import UnsupportedModelError

    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    try:
        model = tiny_model(model_type)
    except Exception as err:  # a config this walk cannot shrink, or a model transformers cannot run
        error, default = _said(err), default_fails(model_type)
        if default in (error, _said(err.__cause__)):
            return Outcome(model_type, class_name, "unrunnable",
                           f"transformers cannot run it on CPU, from its own default config either: {default}")
        return Outcome(model_type, class_name, "not constructed", error)
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


def _said(err: BaseException) -> str:
    """``err``'s type and the first line of its message that says something."""
    return f"{type(err).__name__}: {_line(err)}"


def _line(err: BaseException) -> str:
    """The first line of ``err``'s message that says something (not a heading ending in a colon)."""
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    said = [line for line in lines if not line.endswith(":")]
    return (said or lines or [""])[0][:300]


def table(rows: list[dict]) -> str:
    """The support table of docs/models.md (markdown) of walked outcomes, by ``model_type``: the exact ones
    in one row, then a row per refusal or transformers error (the classes that share it), then those
    the walk did not construct, if any."""
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
    if skipped:
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
