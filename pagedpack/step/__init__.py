"""The step program: its contract (signature, description, what a lowering returns) and its packed,
paged metadata. Leaves: the compile side, the lowerings, the kernels and the runtime meet here."""
