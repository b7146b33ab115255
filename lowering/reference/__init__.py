"""The ``reference`` target: the project's own ops on any device, native CPU kernels and prepacked
oneDNN linears on the CPU (:mod:`.cpu`); its :class:`~.target.ReferenceTarget` in :mod:`.target`."""
