"""Incremental detokenization: the text of a growing list of token ids, as deltas.

A delta never splits a multi-byte UTF-8 character or a piece the tokenizer merges with the
next token: fast (Rust) tokenizers go through ``tokenizers``' ``DecodeStream`` (the prefix /
read-offset algorithm vLLM and Hugging Face's text streaming use); any other tokenizer decodes
the whole list and holds back a trailing replacement character. :meth:`finish` adds what the full
``decode`` has beyond the deltas, so the concatenated deltas equal
``tokenizer.decode(token_ids, skip_special_tokens=...)`` whenever that decode extends its own
prefixes (byte-level BPE and SentencePiece do; tests hold it).
"""
from __future__ import annotations

import threading

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """``push(token_ids) -> str`` the new text; ``finish() -> str`` the rest; ``text`` all so far.

    ``lock`` guards the tokenizer: a ``transformers`` fast tokenizer must not encode in one thread
    while it decodes in another (its Rust core's borrow check raises "Already borrowed")."""

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True, lock: threading.Lock | None = None):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._lock = lock or threading.Lock()
        core = getattr(tokenizer, "_tokenizer", None)
        self._core = core if isinstance(core, Tokenizer) else None
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if self._core is not None else None

    def push(self, token_ids: list[int]) -> str:
        self.token_ids += token_ids
        with self._lock:
            if self._stream is not None:
                delta = ""
                for token_id in token_ids:  # a step pushes one token: no generator, no join
                    delta += self._stream.step(self._core, token_id) or ""
            else:
                stable = self._decode().rstrip(_REPLACEMENT)
                delta = stable[len(self.text):] if stable.startswith(self.text) else ""
        self.text += delta
        return delta

    def finish(self) -> str:
        """What the full decode holds beyond the deltas (a trailing incomplete character, as
        ``decode`` replaces it); nothing if the deltas are not its prefix."""
        with self._lock:
            full = self._decode()
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += delta
        return delta

    def _decode(self) -> str:
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
