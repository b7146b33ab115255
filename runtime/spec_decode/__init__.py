"""Speculative decoding: a proposer guesses the next tokens of each decoding request, one step
computes them all after the request's last token, and the sampler keeps the longest run it would
have produced itself (vLLM's spec decode, docs/speculative-decoding.md).

- :mod:`.config`: :class:`~.config.SpeculativeConfig`, vLLM's ``speculative_config``.
- :mod:`.ngram`: the ``ngram`` proposer (prompt lookup).
- :mod:`.lookahead`: how many draft tokens each request gets, from its acceptance so far.
- :mod:`.proposer`: proposals after a step, for the requests it left decoding.
- :mod:`.verify`: the sampling of a step's rows position by position, which accepts drafts.
- :mod:`.stats`: the draft and acceptance counters (vLLM's metric names).
"""
