"""What a pass run matched, rewrote and refused: the record every pipeline returns."""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field, fields, replace

import torch.fx


def op_counts(graph: torch.fx.Graph) -> Counter:
    """Count of ``call_function`` targets in ``graph``, keyed by a readable op name."""
    return Counter(op_name(n.target) for n in graph.nodes if n.op == "call_function")


def op_name(target) -> str:
    """``aten.linear.default`` / ``pagedpack.paged_attention.default`` / ``operator.getitem``."""
    if hasattr(target, "_schema") or hasattr(target, "overloadpacket"):
        return str(target)
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__name__', target)}"


@dataclass
class SiteRecord:
    """One attention site (or a softmax the model is refused for): where it is and what happened to it."""

    name: str
    form: str  # "sdpa" or "eager"; "softmax" for an attention-shaped softmax no pattern matched; "sparse": DSA
    layer: int | None = None
    rewritten: bool = False
    reason: str | None = None  # why it was refused
    params: str = ""  # the attention parameters read off the graph (window, soft-cap, ...)
    kv_cache_of: str | None = None  # the site whose KV cache it reads (kv_sharing); None: it has its own


@dataclass
class PassRecord:
    """One pass run: what it matched, rewrote and refused, and how long it took."""

    name: str
    matched: int
    rewritten: int
    refused: int
    ms: float


@dataclass
class UnmatchedSoftmax:
    """A softmax no attention pattern took, and why; ``refused``: it is attention-shaped, so the model is refused."""

    name: str
    reason: str
    refused: bool


@dataclass
class PassReport:
    """The pass pipeline's account of a rewrite (what ``pagedpack inspect`` prints)."""

    sites: list[SiteRecord] = field(default_factory=list)
    inputs_added: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    ops_before: Counter = field(default_factory=Counter)
    ops_after: Counter = field(default_factory=Counter)
    passes: list[PassRecord] = field(default_factory=list)
    unmatched_softmaxes: list[UnmatchedSoftmax] = field(default_factory=list)
    stopped_at: str | None = None  # the pass that refused; the graph was left as captured
    left_as_captured: str | None = None  # the torch.compile backend: what made it run the graph as captured

    def to_dict(self) -> dict:
        """The report as plain JSON data (what the compile cache stores; :meth:`from_dict` reads it)."""
        counts = {"ops_before": dict(self.ops_before), "ops_after": dict(self.ops_after)}
        return {**asdict(replace(self, ops_before=Counter(), ops_after=Counter())), **counts}

    @classmethod
    def from_dict(cls, data) -> "PassReport":
        """The report :meth:`to_dict` gave; ``ValueError`` for data of another shape (it comes from a file)."""
        records = {"sites": SiteRecord, "passes": PassRecord, "unmatched_softmaxes": UnmatchedSoftmax}
        try:
            if not isinstance(data, dict) or set(data) != {f.name for f in fields(cls)}:
                raise TypeError("not a PassReport record")
            report = cls(**{name: [_record(records[name], item) for item in value] if name in records else value
                            for name, value in data.items()})
            report.ops_before, report.ops_after = Counter(report.ops_before), Counter(report.ops_after)
            checks = [all(isinstance(x, str) for x in report.inputs_added + report.notes),
                      all(isinstance(k, str) and type(v) is int for c in (report.ops_before, report.ops_after)
                          for k, v in c.items()),
                      all(x is None or isinstance(x, str) for x in (report.stopped_at, report.left_as_captured))]
            if not all(checks):
                raise TypeError("a field of the wrong type")
        except (TypeError, AttributeError) as err:
            raise ValueError(f"report: expected a PassReport record, got {str(data)[:80]!r} ({err})") from err
        return report

    @property
    def num_found(self) -> int:
        return len(self.sites)

    @property
    def num_rewritten(self) -> int:
        return sum(s.rewritten for s in self.sites)

    @property
    def refused(self) -> list[SiteRecord]:
        """The sites refused, each with its reason."""
        return [s for s in self.sites if s.reason is not None]

    @property
    def ok(self) -> bool:
        """The pipeline ran to its end, and every attention site found was rewritten (at least one was
        found, or the model is a state-space model whose recurrent layers the ``recurrent_state`` pass
        rewrote)."""
        recurrent = any(p.name == "recurrent_state" and p.rewritten for p in self.passes)
        return self.stopped_at is None and bool(self.sites or recurrent) and all(s.rewritten for s in self.sites)

    def stop(self, pass_name: str) -> None:
        """The pipeline stopped at ``pass_name`` and the graph is as captured: nothing is rewritten or added."""
        self.stopped_at = pass_name
        self.inputs_added = []
        for s in self.sites:
            s.rewritten = False

    def refusal(self) -> str | None:
        """Why the pipeline did not rewrite the graph, in one line (the pass that stopped it and the
        first refused site with its reason, else that pass's last note); None if it did."""
        if self.ok:
            return None
        if self.refused:
            why = f"{self.refused[0].name} refused: {self.refused[0].reason}"
        else:
            why = self.notes[-1] if self.notes else "no attention site rewritten"
        return f"the rewrite stopped at {self.stopped_at}: {why}" if self.stopped_at else why

    def format(self) -> str:
        """A plain-text summary: why the graph was left as captured (if it was), then, if a pipeline
        ran, sites, refusals with reasons, added inputs, notes, passes, unmatched softmaxes and
        op-count changes."""
        lines = [] if self.left_as_captured is None else [f"graph left as captured: {self.left_as_captured}"]
        if not self.passes:  # no pipeline ran (the backend gave up before rewriting): nothing was looked for
            return "\n".join(lines + [f"note: {n}" for n in self.notes])
        lines.append(f"attention sites: {self.num_found} found, {self.num_rewritten} rewritten, "
                     f"{len(self.refused)} refused")
        for s in self.sites:
            if s.rewritten:
                state = "rewritten"
            else:
                state = f"REFUSED: {s.reason}" if s.reason else f"not rewritten (stopped at {self.stopped_at})"
            shared = f", reads the KV cache of {s.kv_cache_of}" if s.kv_cache_of else ""
            lines.append(f"  {s.name:<40} {s.form:<7} {state}" + (f" ({s.params})" if s.params else "") + shared)
        lines.append("graph inputs added: " + ", ".join(self.inputs_added))
        lines += [f"note: {n}" for n in self.notes]
        lines.append("passes: matched / rewritten / refused (in what each pass counts: sites, nodes, inputs, "
                     "sequences; see docs/design.md), time")
        for p in self.passes:
            lines.append(f"  {p.name:<24} {p.matched:>4} / {p.rewritten:>4} / {p.refused:>4} {p.ms:>9.1f} ms")
        if self.stopped_at is not None:
            lines.append(f"stopped at {self.stopped_at}: the graph is left as captured")
        if self.unmatched_softmaxes:
            lines.append("softmaxes no attention pattern matched:")
            for u in self.unmatched_softmaxes:
                lines.append(f"  {u.name:<24} {'REFUSED' if u.refused else 'kept':<7} {u.reason}")
        lines.append("op counts (before -> after), changed ops only:")
        for op in sorted(set(self.ops_before) | set(self.ops_after)):
            b, a = self.ops_before.get(op, 0), self.ops_after.get(op, 0)
            if a != b:
                lines.append(f"  {op:<50} {b:>5} -> {a:<5}")
        return "\n".join(lines)


def _record(kind, data):
    """A ``kind`` dataclass from its :func:`dataclasses.asdict` form, each field of its annotated type."""
    types = {"str": str, "int": int, "float": (int, float), "bool": bool}
    if not isinstance(data, dict) or set(data) != {f.name for f in fields(kind)}:
        raise TypeError(f"not a {kind.__name__} record")
    for f in fields(kind):
        allowed = tuple(t for name, t in types.items() if name in str(f.type).split(" | ")) + \
            ((type(None),) if "None" in str(f.type) else ())
        value = data[f.name]
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            raise TypeError(f"{kind.__name__}.{f.name}: {value!r:.40}")
    return kind(**data)
