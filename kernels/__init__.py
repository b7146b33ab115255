"""Custom ops of the ``pagedpack`` namespace (``torch.ops.pagedpack.*``).

``import pagedpack`` registers them (through :mod:`pagedpack.kernels.ops`).

Run from the repository root (``python -c``, a REPL or notebook in the clone), this folder is
also visible as a bare ``kernels`` package, and it would shadow the ``kernels`` distribution that
``transformers`` (5.25 on) depends on and imports. Imported under that bare name, the file hands
the name over to the installed distribution; when there is none, it stays an empty package.
"""
if __name__ == "kernels":
    import sys
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec
    from pathlib import Path

    _clone = Path(__file__).resolve().parent.parent
    _spec = PathFinder.find_spec(__name__, [p for p in sys.path if Path(p or ".").resolve() != _clone])
    if _spec is not None and _spec.loader is not None:
        _installed = module_from_spec(_spec)
        sys.modules[__name__] = _installed  # the import statement returns this module, not the folder
        _spec.loader.exec_module(_installed)
