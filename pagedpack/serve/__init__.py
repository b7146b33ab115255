"""``pagedpack serve``: the OpenAI-compatible HTTP server (:mod:`pagedpack.serve.server`)."""

DEFAULT_PREFILL_TIMEOUT_S = 120.0  # pagedpack disagg-proxy --prefill-timeout (here: the CLI reads it without the proxy)
