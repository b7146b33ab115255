"""The ``recurrent_layers`` pass: refuse models whose layers carry a recurrent state
(:mod:`pagedpack.models.recurrent`), by name, before any check runs on a packed sample (which
such layers fail), except, with ``paged``, the layers whose state the step pipeline pages
(:mod:`pagedpack.passes.recurrent_state`). ``capture`` refuses the others before export already;
this pass covers the graphs that reach the passes another way (the ``torch.compile`` backend,
which pages no state, a user's own capture). The layers are read off the module each node was
traced in (``node.meta["nn_module_stack"]``).
"""
from __future__ import annotations

from pagedpack.models.recurrent import first_recurrent, recurrent_refusal
from pagedpack.passes.manager import Pass, PassContext, PassResult


class RecurrentLayers(Pass):
    """``recurrent_layers``: refuse the model if a node was traced inside a recurrent-state layer;
    the note names the first such module and its class. Counts: matched = refused = 1 then."""

    name = "recurrent_layers"
    mutates = False

    def __init__(self, paged: bool = False):
        self.paged = paged  # leave the layers whose state is paged to the recurrent_state pass

    def __call__(self, ctx: PassContext) -> PassResult:
        stacks = ((node.meta.get("nn_module_stack") or {}).values() for node in ctx.graph.nodes)
        found = first_recurrent(((path.removeprefix("model."), kind) for stack in stacks for path, kind in stack),
                                paged=self.paged)
        if found is None:
            return PassResult()
        ctx.report.notes.append(recurrent_refusal(*found))
        return PassResult(matched=1, refused=1)
