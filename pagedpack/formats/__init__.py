"""Files and trust: the format-neutral description every export stores, the checks of a ``.pt2``
before it is loaded, checksums, atomic writes and checked names. Each file format itself lives
with its target (``pagedpack.lowering.<target>``)."""
