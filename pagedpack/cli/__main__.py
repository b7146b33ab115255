"""``python -m pagedpack.cli ARGS``: the ``pagedpack`` command (how tests and benchmarks start a server)."""
from pagedpack.cli.commands import main

raise SystemExit(main())
