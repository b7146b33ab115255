"""The compile side: the model source, the ``torch.compile`` backend, the program builder, its
compile cache and the memory planner. It imports no serving runtime."""
