"""The ``pagedpack`` command (``generate``, ``serve``, ``inspect``, ``export``, ``plan``) and the KV
plot ``generate --kv-plot`` draws."""
from pagedpack.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
