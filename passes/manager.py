"""One interface for the passes, and the manager that runs a pipeline of them.

A pass is a callable on a shared :class:`PassContext` (the graph module, the report, what earlier
passes found) that returns a :class:`PassResult`. It names the context fields it reads
(``requires``) and fills (``provides``); :class:`PassManager` refuses a pipeline in which a pass
reads what no earlier pass provides, runs the passes in order, times each and appends one
:class:`~pagedpack.passes.report.PassRecord` per pass to the report. ``Pass.uuid()`` (name,
version, options) identifies a pass in cache keys (``PassManager.uuid()`` the pipeline's). The
first pass that refuses anything stops the pipeline, and the graph module is put back as it was
before the first pass that mutates it. A pass that raises refuses: the report names the pass, the
exception and, when a graph's generated code raised it, the node (never a raw exception to the user).
With ``PAGEDPACK_DUMP_GRAPHS=DIR`` set, the graph is written before and after each pass as readable
code: ``DIR/NN-<pass>-before.txt`` and ``DIR/NN-<pass>-after.txt`` (a later run overwrites them).
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.fx
from torch.fx import Node

from pagedpack.formats.files import atomic_write
from pagedpack.passes.attention_sites import AttentionSite
from pagedpack.passes.report import PassRecord, PassReport, SiteRecord, op_counts, op_name
from pagedpack.step.contract import KVCacheSpec, StateSpec

DUMP_GRAPHS_ENV = "PAGEDPACK_DUMP_GRAPHS"


@dataclass
class PassContext:
    """What the passes of one pipeline share.

    Given: the graph module (rewritten in place), the report, and ``sample_inputs``: one sequence of
    ``num_tokens`` tokens in the graph's calling convention, for the checks on a sample. The other
    fields are filled in by the passes named, in pipeline order.
    """

    graph_module: torch.fx.GraphModule
    report: PassReport
    sample_inputs: tuple = ()
    num_tokens: int = 0
    sites: list[AttentionSite] = field(default_factory=list)  # find_attention
    records: list[SiteRecord] = field(default_factory=list)  # verify_attention: sites[i]'s report entry
    kinds: list[str | None] = field(default_factory=list)  # verify_attention: sites[i]'s mask kind
    values: dict[Node, torch.Tensor] = field(default_factory=dict)  # verify_attention: sampled values
    # kv_sharing: sites[i] reads the KV cache of sites[cache_owners[i]] (i itself: its own cache)
    cache_owners: list[int] = field(default_factory=list)
    inputs: dict[str, Node] = field(default_factory=dict)  # the step's inputs by name (the *_inputs passes)
    kv_cache_specs: list[KVCacheSpec] = field(default_factory=list)  # paged_attention: one per owned cache
    state_specs: list[StateSpec] = field(default_factory=list)  # recurrent_state: one per state input
    reference: torch.fx.GraphModule | None = None  # the captured graph, kept apart (parameters shared)
    make_sample: Callable[[int], tuple] | None = None  # inputs of one sequence of n tokens (mask probes)
    window_hint: int | None = None  # the model config's sliding window or attention chunk (models.config.mask_reach)

    @property
    def graph(self) -> torch.fx.Graph:
        return self.graph_module.graph


# The context fields a pipeline starts with; the others are analyses some pass provides.
GIVEN = ("graph_module", "report", "sample_inputs", "num_tokens", "reference", "make_sample", "window_hint")


@dataclass(frozen=True)
class PassResult:
    """What one pass did: things it matched, rewrote and refused (any refusal stops the pipeline)."""

    matched: int = 0
    rewritten: int = 0
    refused: int = 0


class Pass:
    """A pass: called on the context, it returns its :class:`PassResult`.

    ``name`` names its report row and dump files; ``mutates`` says whether it may change the graph
    (the manager snapshots the graph before the first pass that does); ``requires`` / ``provides``
    name the :class:`PassContext` fields it reads and fills (beyond :data:`GIVEN`); ``version``
    changes when what it does changes (its :meth:`uuid`).
    """

    name: str = ""
    mutates: bool = True
    requires: tuple[str, ...] = ()
    provides: tuple[str, ...] = ()
    version: int = 1

    def __call__(self, ctx: PassContext) -> PassResult:
        raise NotImplementedError

    def uuid(self) -> str:
        """``name:version:<digest of the options>`` (the instance's attributes), stable across runs."""
        options = repr(sorted(vars(self).items())).encode()
        return f"{self.name}:{self.version}:{hashlib.sha256(options).hexdigest()[:12]}"


class SiteRewritePass(Pass):
    """A pass that rewrites each site in turn (:meth:`rewrite_one`) and marks it rewritten in the report.

    Counts: matched = rewritten = the sites.
    """

    requires = ("sites", "records", "inputs")

    def __call__(self, ctx: PassContext) -> PassResult:
        for index, (site, record) in enumerate(zip(ctx.sites, ctx.records)):
            self.rewrite_one(ctx, index, site)
            record.rewritten = True
        return PassResult(matched=len(ctx.sites), rewritten=len(ctx.sites))

    def rewrite_one(self, ctx: PassContext, index: int, site: AttentionSite) -> None:
        raise NotImplementedError


class PassManager:
    """Runs ``passes`` in order on one :class:`PassContext` (see the module docstring).

    ``ValueError`` at construction for a pipeline whose order is wrong: a pass that requires a field
    no earlier pass provides (naming the pass and the one that provides it later, if any), or a
    name that is no field of :class:`PassContext`."""

    def __init__(self, passes: Sequence[Pass]):
        self.passes = list(passes)
        check_order(self.passes)

    def uuid(self) -> list[str]:
        """The passes' :meth:`Pass.uuid`, in order."""
        return [p.uuid() for p in self.passes]

    def run(self, ctx: PassContext) -> bool:
        """Run the pipeline; fills ``ctx.report`` (a row per pass run, op counts before and after).

        Returns True if every pass ran, False if one refused: then ``ctx.graph_module`` is as it was
        before the run and ``ctx.report.stopped_at`` names the pass.
        """
        gm, report = ctx.graph_module, ctx.report
        report.ops_before = op_counts(gm.graph)
        dump_dir = Path(os.environ[DUMP_GRAPHS_ENV]) if os.environ.get(DUMP_GRAPHS_ENV) else None
        if dump_dir:
            dump_dir.mkdir(parents=True, exist_ok=True)
        snapshot = None
        for index, p in enumerate(self.passes, 1):
            if p.mutates and snapshot is None:
                snapshot = _Snapshot(gm)
            if dump_dir:
                _dump(gm, dump_dir / f"{index:02d}-{p.name}-before.txt")
            start = time.perf_counter()
            try:
                result = p(ctx)
            except Exception as err:  # a check that cannot run on this graph (e.g. its own packed sample)
                report.notes.append(_raised_note(p.name, err))
                result = PassResult(refused=1)
            ms = (time.perf_counter() - start) * 1e3
            report.passes.append(PassRecord(p.name, result.matched, result.rewritten, result.refused, ms))
            if dump_dir:
                _dump(gm, dump_dir / f"{index:02d}-{p.name}-after.txt")
            if result.refused:
                report.stop(p.name)
                if snapshot is not None:
                    snapshot.restore(gm)
                break
        else:
            if snapshot is not None:
                gm.graph.lint()
                gm.recompile()
        report.ops_after = op_counts(gm.graph)
        return report.stopped_at is None


def _raised_note(pass_name: str, err: Exception) -> str:
    """``"<pass> raised <Error>: <first line> (at node <name> = <op>)"``: the node is the innermost
    graph-module node whose generated ``forward`` line the traceback passes through."""
    message = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
    node = raising_node(err)
    where = f" (at node {node.name} = {op_name(node.target)})" if node is not None else ""
    return f"{pass_name} raised {type(err).__name__}: {message}{where}"


def raising_node(err: BaseException) -> Node | None:
    """The fx node whose line of a ``GraphModule``'s generated ``forward`` (innermost in ``err``'s
    traceback) raised ``err``, or None: read off the generated code's line map, as torch.fx's own
    error message (``_WrappedCall``) reads it."""
    found, tb = None, err.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        module = frame.f_locals.get("self")
        if (isinstance(module, torch.fx.GraphModule) and frame.f_code is getattr(type(module).forward, "__code__", None)
                and module._lineno_map is not None):
            index = module._lineno_map.get(tb.tb_lineno - module._prologue_start)
            if index is not None:
                found = list(module.graph.nodes)[index]
        tb = tb.tb_next
    return found


def check_order(passes: Sequence[Pass]) -> None:
    """``ValueError`` unless each pass's ``requires`` are :data:`GIVEN` or provided by an earlier pass."""
    fields = {f.name for f in dataclasses.fields(PassContext)}
    available = set(GIVEN)
    for index, p in enumerate(passes):
        if not isinstance(p, Pass) or not p.name:
            raise ValueError(f"passes: expected Pass instances with a name, got {p!r} at position {index}")
        for name in (*p.requires, *p.provides):
            if name not in fields:
                raise ValueError(f"passes: {p.name!r} names {name!r}, which is no field of PassContext")
        for name in p.requires:
            if name not in available:
                later = next((q.name for q in passes[index + 1:] if name in q.provides), None)
                by = f"{later!r} provides it later" if later else "no pass provides it"
                raise ValueError(f"passes: {p.name!r} requires {name!r} before any pass provides it ({by})")
        available.update(p.provides)


class _Snapshot:
    """A graph module's graph and submodule tree, to put back; parameters are shared, not copied."""

    def __init__(self, gm: torch.fx.GraphModule):
        self.graph = copy.deepcopy(gm.graph)
        self.children = [(m, dict(m._modules)) for m in gm.modules()]

    def restore(self, gm: torch.fx.GraphModule) -> None:
        for module, children in self.children:
            module._modules.clear()
            module._modules.update(children)
        gm.graph = self.graph  # the setter recompiles


def _dump(gm: torch.fx.GraphModule, path: Path) -> None:
    with atomic_write(path) as tmp:
        Path(tmp).write_text(gm.print_readable(print_output=False))
