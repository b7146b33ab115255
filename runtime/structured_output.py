"""Structured outputs: a request's :class:`~pagedpack.runtime.sampling_params.StructuredOutputsParams`
compiled to a grammar (xgrammar, vLLM's default engine) and a matcher per completion.

:class:`StructuredOutputManager` holds the grammar compiler of one model's tokenizer and a bounded
LRU cache of compiled grammars keyed by the constraint's text (:func:`grammar_key`). The engine
compiles at admission (``LLMEngine.make_request``, any thread), so a schema, regex or grammar
xgrammar cannot compile is a ``ValueError`` naming ``structured_outputs.<field>`` before any step.
Each completion (each of ``n``) gets its own ``xgrammar.GrammarMatcher`` (``Request.grammar``),
which accepts the tokens sampled for it; the token bitmask of each step is
:mod:`pagedpack.runtime.grammar_bitmask`'s. ``import xgrammar`` takes about 2 s, so the engine
imports this module on the first request that asks for structured outputs.

Speculative decoding, when it comes, rolls a matcher back with ``GrammarMatcher.rollback(n)``
(unlimited since xgrammar 0.2: ``max_rollback_tokens`` is deprecated and always -1).
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

import xgrammar as xgr

from pagedpack.runtime.grammar_bitmask import GrammarBitmasks
from pagedpack.runtime.sampling_params import StructuredOutputsParams

# compiled grammars kept (each holds its token-mask cache: tens of KB to a few MB for a large schema),
# and their bytes together (xgrammar's memory_size_bytes): whichever bound is met first evicts
DEFAULT_CACHE_SIZE = 256
DEFAULT_CACHE_BYTES = 256 << 20
_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # "[03:49:14] /project/cpp/regex_converter.cc:94: "


def grammar_key(params: StructuredOutputsParams) -> tuple[str, str, bool, bool]:
    """The cache key of a constraint: ``(kind, its canonical text, disable_any_whitespace,
    disable_additional_properties)``. A JSON value's text keeps its key order (a schema's property
    order is the output's), without whitespace."""
    value = getattr(params, params.kind)
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return params.kind, text, params.disable_any_whitespace, params.disable_additional_properties


class StructuredOutputManager:
    """Compiles constraints for one model and makes their matchers.

    ``tokenizer``: the model's ``transformers`` tokenizer; ``vocab_size``: the model's logits width
    (it may exceed the tokenizer's: the ids past it are never allowed); ``stop_token_ids``: the ids
    that end a completion (the model's EOS ids), the only ones a grammar allows once it is complete;
    ``cache_size``: compiled grammars kept (least recently used dropped first). Thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], *,
                 cache_size: int = DEFAULT_CACHE_SIZE, cache_bytes: int = DEFAULT_CACHE_BYTES):
        if cache_size < 1:
            raise ValueError(f"cache_size: expected an int >= 1, got {cache_size!r}")
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        # xgrammar's own cache is off: ours is bounded by entries and bytes, keyed by the constraint's text;
        # one compiler thread (xgrammar's default is 8): the cores are the model's
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_size, self.cache_bytes, self._bytes = cache_size, cache_bytes, 0
        self.bitmasks = GrammarBitmasks(vocab_size)

    def matchers(self, params: StructuredOutputsParams, n: int) -> list[xgr.GrammarMatcher]:
        """``n`` fresh matchers of ``params``' grammar (compiled, or taken from the cache).
        ``ValueError`` naming ``structured_outputs.<field>`` if xgrammar cannot compile it."""
        compiled = self.compile(params)
        return [xgr.GrammarMatcher(compiled) for _ in range(n)]

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """``params``' compiled grammar; the cache's if it holds the same constraint."""
        key = grammar_key(params)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        compiled = self._compile(params)  # outside the lock: another request's may compile meanwhile
        with self._lock:
            if key not in self._cache:
                self._cache[key] = compiled
                self._bytes += compiled.memory_size_bytes
            while self._cache and (len(self._cache) > self.cache_size or self._bytes > self.cache_bytes):
                self._bytes -= self._cache.popitem(last=False)[1].memory_size_bytes
        return compiled

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    @property
    def cached_bytes(self) -> int:
        """The compiled grammars' bytes the cache holds (xgrammar's ``memory_size_bytes``)."""
        return self._bytes

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        kind, compiler = params.kind, self._compiler
        try:
            if kind in ("json", "json_object"):  # json_object: any JSON object (OpenAI's, as vLLM compiles it)
                # xgrammar's strict mode: objects admit no keys beyond their properties unless the schema's
                # additionalProperties says so (what disable_additional_properties asks, always)
                schema = params.json if kind == "json" else {"type": "object"}
                return compiler.compile_json_schema(json.dumps(schema), strict_mode=True,
                                                    any_whitespace=not params.disable_any_whitespace)
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(params.choice))
            if kind == "grammar":
                return compiler.compile_grammar(params.grammar)
            return compiler.compile_structural_tag(*_structural_tag_args(params.structural_tag))
        except (RuntimeError, ValueError, TypeError, KeyError) as err:  # xgrammar's errors (RuntimeError) and ours
            why = _XGRAMMAR_PREFIX.sub("", str(err).strip()) or type(err).__name__
            raise ValueError(f"structured_outputs.{kind}: expected {_WHAT[kind]} xgrammar can compile, "
                             f"got one it refuses: {why}") from None


_WHAT = {"json": "a JSON schema", "json_object": "true", "regex": "a regular expression",
         "choice": "a list of choices", "grammar": "an EBNF grammar (GBNF)", "structural_tag": "a structural tag"}


def choice_grammar(choices: list[str]) -> str:
    """The EBNF grammar whose sentences are exactly ``choices`` (each a quoted literal: JSON's escapes
    are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _structural_tag_args(tag: dict) -> tuple:
    """``compile_structural_tag``'s arguments: xgrammar's structural tag as it is, or vLLM's older form
    (``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``) as xgrammar's tags and triggers."""
    if "structures" not in tag:
        return (json.dumps(tag),)
    tags = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
            for s in tag["structures"]]
    return tags, tag["triggers"]
