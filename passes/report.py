"""What a pass run matched, rewrote and refused: the record every pass returns."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

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
    """One attention site: where it is and what happened to it."""

    name: str
    form: str  # "sdpa" or "eager"
    layer: int | None = None
    rewritten: bool = False
    reason: str | None = None  # why it was refused


@dataclass
class PassReport:
    """The pass pipeline's account of a rewrite (what ``pagedpack inspect`` prints)."""

    sites: list[SiteRecord] = field(default_factory=list)
    inputs_added: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    ops_before: Counter = field(default_factory=Counter)
    ops_after: Counter = field(default_factory=Counter)

    @property
    def num_found(self) -> int:
        return len(self.sites)

    @property
    def num_rewritten(self) -> int:
        return sum(s.rewritten for s in self.sites)

    @property
    def refused(self) -> list[SiteRecord]:
        return [s for s in self.sites if not s.rewritten]

    def format(self) -> str:
        """A plain-text summary: sites, refusals with reasons, added inputs, op-count changes."""
        lines = [f"attention sites: {self.num_found} found, {self.num_rewritten} rewritten, "
                 f"{len(self.refused)} refused"]
        for s in self.sites:
            state = "rewritten" if s.rewritten else f"REFUSED: {s.reason}"
            lines.append(f"  {s.name:<40} {s.form:<6} {state}")
        lines.append("graph inputs added: " + ", ".join(self.inputs_added))
        lines += [f"note: {n}" for n in self.notes]
        lines.append("op counts (before -> after), changed ops only:")
        for op in sorted(set(self.ops_before) | set(self.ops_after)):
            b, a = self.ops_before.get(op, 0), self.ops_after.get(op, 0)
            if a != b:
                lines.append(f"  {op:<50} {b:>5} -> {a:<5}")
        return "\n".join(lines)
