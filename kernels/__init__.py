"""Custom ops of the ``pagedpack`` namespace (``torch.ops.pagedpack.*``).

``import pagedpack`` registers them (through :mod:`pagedpack.kernels.ops`). This file imports
nothing on purpose: run from the repository root, the folder is also visible as a bare
``kernels`` package, which ``transformers`` probes for, and that probe must stay harmless.
"""
