"""``pagedpack serve``: the OpenAI-compatible HTTP server (:mod:`pagedpack.serve.server`)."""
