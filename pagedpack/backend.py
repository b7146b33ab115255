"""The ``torch.compile`` backend ``"pagedpack"``: padding-free forward passes.

``torch.compile(model, backend="pagedpack")`` hands each Dynamo graph of a padded forward
(``input_ids [B, S]``, ``attention_mask [B, S]``, left or right padding) to
:func:`pagedpack_backend`. It re-traces the graph for one row of ``T`` tokens with
``torch.export`` (dynamic ``T``), rewrites it with :mod:`pagedpack.passes.varlen`, checks the
result on a sample against the original graph run per sequence, and returns a callable that

1. packs the real tokens (``attention_mask == 1``) into one row, with ``positions =
   cumsum(attention_mask) - 1`` per row (or the caller's ``position_ids``) and ``cu_seqlens``;
2. runs the packed graph (optionally compiled by Inductor, custom ops kept opaque);
3. scatters each output back to the caller's padded shape, zeros under padding.

A graph the backend cannot pack (static shapes, an unsupported pattern) runs as Dynamo
captured it, and the reason is kept in :data:`LAST_REPORTS`. Options (``options={...}``):
``inductor`` (bool, default False): compile the packed graph with Inductor.
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch
import torch.fx

from pagedpack.passes.report import PassReport
from pagedpack.passes.varlen import rewrite_varlen

log = logging.getLogger(__name__)
LAST_REPORTS: list[PassReport] = []  # one per Dynamo graph compiled, newest last
_POSITIONAL = (None, "input_ids", "attention_mask")  # HF forward order after ``self``
_VERIFY_LENS = (5, 1, 7)  # a sample packed batch: T=13, B=3
# Dynamo's graphs carry no config: masks are checked past this many tokens, so that a sliding window
# up to it is seen (Mistral's 4096, Gemma's 512/1024/4096); a longer one would go unseen.
PROBE_WINDOW = 4096


class Unpackable(Exception):
    """The graph cannot be packed; the message says why."""


def pagedpack_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None):
    """Dynamo backend entry point (registered as ``"pagedpack"``); ``options`` as in the module doc."""
    options = options or {}
    unknown = set(options) - {"inductor"}
    if unknown:
        raise ValueError(f"options: expected keys among ['inductor'], got {sorted(unknown)}")
    return PackedForward(gm, example_inputs, inductor=bool(options.get("inductor", False)))


@dataclass
class _Arg:
    """How to produce one input of the Dynamo graph in the packed call."""

    kind: str  # "token" (packed [B, S, ...] tensor), "mask", "batch", "seq", "scalar", "const"
    name: str
    value: object = None  # the constant, for "const"


class PackedForward:
    """The compiled forward: pack, run the rewritten graph, unpack (see the module docstring)."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs, *, inductor: bool = False):
        self.gm, self.inductor = gm, inductor
        names = [_name(n) for n in gm.graph.nodes if n.op == "placeholder"]
        self.mask_arg = names.index("attention_mask") if "attention_mask" in names else None
        self.run, self.packed = None, False  # built on the first call, outside Dynamo's tracing
        try:
            self.args = _classify_inputs(gm, example_inputs)
        except Unpackable as err:
            self._leave_as_captured(err)
            return
        self.token_args = [i for i, a in enumerate(self.args) if a.kind == "token"]
        self.position_arg = next((i for i, a in enumerate(self.args) if a.name == "position_ids"), None)
        self.scalar_args = [(i, a.value) for i, a in enumerate(self.args) if a.kind == "scalar"]
        self.original = _SingleSequence(_specialize_scalars(gm, self.args), self.args)

    def _leave_as_captured(self, err: Exception) -> None:
        self.report = PassReport(notes=[f"graph left as captured: {err}"])
        LAST_REPORTS.append(self.report)
        log.warning("pagedpack: %s", err)
        self.run = self.gm

    def _build(self, example_tokens) -> None:
        try:
            self.program, self.report = self._rewrite(example_tokens)
            self.layouts = self._verify(example_tokens)
        except Unpackable as err:
            self._leave_as_captured(err)
            return
        self.run, self.packed = self.program, True
        if self.inductor:
            self.run = torch.compile(self.program, backend="inductor", dynamic=True, fullgraph=True)
        LAST_REPORTS.append(self.report)

    def _rewrite(self, example_tokens):
        n = 7
        sample = _sample_tokens(self.args, self.token_args, example_tokens, [n])
        # DYNAMIC, not a named Dim: export may narrow the range (e.g. T <= 512 from a position
        # table), which the rewrite then makes moot; export's guards are stripped.
        num_tokens = torch.export.Dim.DYNAMIC
        try:
            exported = torch.export.export(self.original, tuple(sample),
                                           dynamic_shapes=(tuple({1: num_tokens} for _ in sample),))
        except Exception as err:  # export's own errors are many types; report and keep the graph
            raise Unpackable(f"re-tracing for one packed row failed: {type(err).__name__}: {err}") from err
        program = exported.module()
        program.graph._codegen = torch.fx.graph.CodeGen()
        program._forward_pre_hooks.clear()
        program.recompile()
        report = rewrite_varlen(  # strips export's guards too
            program, tuple(sample), n, window_hint=PROBE_WINDOW,
            make_sample=lambda t: tuple(_sample_tokens(self.args, self.token_args, example_tokens, [t])))
        if not report.ok:
            raise Unpackable(report.format())
        return program, report

    def _verify(self, example_tokens) -> list[tuple[str, int]]:
        """Run a packed sample against the original per sequence; each output's layout."""
        lens = _VERIFY_LENS
        packed = _sample_tokens(self.args, self.token_args, example_tokens, lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        positions = torch.cat([torch.arange(n) for n in lens]).to(packed[0].device)
        with torch.no_grad():
            outs = self.program(*packed, positions, cu.to(positions.device))
            singles = [self.original(*(t[:, a:b] for t in packed)) for a, b in zip(cu[:-1], cu[1:])]
        return [_output_layout(i, out, [s[i] for s in singles], lens) for i, out in enumerate(outs)]

    def __call__(self, *args):
        if self.run is None:
            self._build([args[i] for i in self.token_args])
        if not self.packed or any(float(args[i]) != v for i, v in self.scalar_args):
            return self._as_captured(args)
        token = args[self.token_args[0]]
        batch, seq = token.shape[:2]
        mask = (args[self.mask_arg] if self.mask_arg is not None
                else torch.ones(batch, seq, dtype=torch.long, device=token.device)).bool()
        flat = mask.reshape(-1).nonzero().squeeze(1)
        cu_seqlens = torch.zeros(batch + 1, dtype=torch.int32, device=token.device)
        cu_seqlens[1:] = mask.sum(1).cumsum(0)
        packed = [args[i].flatten(0, 1)[flat].unsqueeze(0) for i in self.token_args]
        positions = args[self.position_arg] if self.position_arg is not None else mask.long().cumsum(1) - 1
        positions = positions.reshape(-1)[flat]
        if self.inductor:
            outs = self._run_compiled(packed, positions, cu_seqlens)
        else:
            outs = self.run(*packed, positions, cu_seqlens)
        return tuple(_unpack(o, layout, flat, batch, seq) for o, layout in zip(outs, self.layouts))


    def _as_captured(self, args):
        """The Dynamo graph as captured; rows that are all padding are zeroed (dim 0 is the batch)."""
        outs = self.gm(*args)
        if self.mask_arg is None:
            return outs
        empty = ~args[self.mask_arg].bool().any(1)
        return tuple(o.masked_fill(empty.view(-1, *[1] * (o.dim() - 1)), 0)
                     if isinstance(o, torch.Tensor) and o.dim() and o.shape[0] == empty.shape[0] else o
                     for o in outs)

    def _run_compiled(self, packed, positions, cu_seqlens):
        """Inductor path: sizes marked dynamic; a step of fewer than 2 tokens gets a dummy
        sequence appended (its rows are dropped), so that sizes 0 and 1, which Dynamo would
        specialise, never reach the compiled graph and one graph serves every step."""
        num_tokens = positions.shape[0]
        pad = max(0, 2 - num_tokens)
        if pad:
            packed = [torch.cat([t, t.new_zeros(1, pad, *t.shape[2:])], 1) for t in packed]
            positions = torch.cat([positions, torch.arange(pad, device=positions.device)])
            cu_seqlens = torch.cat([cu_seqlens, cu_seqlens[-1:] + pad])
        for t in (*packed, positions, cu_seqlens):
            torch._dynamo.mark_dynamic(t, 1 if t.dim() > 1 else 0)
        outs = self.run(*packed, positions, cu_seqlens)
        if not pad:
            return outs
        return tuple(o.narrow(d, 0, o.shape[d] - (pad if kind == "token" else 1))
                     if kind in ("token", "sequence") else o for o, (kind, d) in zip(outs, self.layouts))


def _output_layout(i: int, out, refs: list, lens) -> tuple[str, int | None]:
    """How output ``i`` of the packed sample relates to the per-sequence outputs ``refs``:
    ("token", dim) / ("sequence", dim): per-token / per-sequence tensor along ``dim``;
    ("seq_len", None): the sequence length; ("const", None): the same for every call."""
    total, num = sum(lens), len(lens)
    if not isinstance(out, torch.Tensor):
        if out == total and list(refs) == list(lens):
            return "seq_len", None
        if all(r == out for r in refs):
            return "const", None
        raise Unpackable(f"output {i} ({out!r}) is neither the sequence length nor a constant")
    dims = [d for d, size in enumerate(out.shape) if size in (total, num)] if out.dim() >= 2 else []
    if not dims or out.shape[0] != 1:
        if all(isinstance(r, torch.Tensor) and torch.equal(r, out) for r in refs):
            return "const", None
        raise Unpackable(f"output {i} (shape {tuple(out.shape)}) has no token dimension and varies per sequence")
    if len(dims) != 1:
        raise Unpackable(f"output {i} (shape {tuple(out.shape)}): cannot tell its token dimension")
    d = dims[0]
    kind = "token" if out.shape[d] == total else "sequence"
    got = out.split(list(lens) if kind == "token" else 1, dim=d)
    refs = refs if kind == "token" else [r.unsqueeze(d) for r in refs]
    tol = 1e-3 if out.dtype == torch.float32 else 5e-2
    for b, (g, r) in enumerate(zip(got, refs)):
        if g.shape != r.shape or not torch.allclose(g.float(), r.float(), rtol=tol, atol=tol):
            raise Unpackable(f"output {i} of sequence {b} differs from the unpacked graph "
                             "(a sequence-aware op the pass does not handle)")
    return kind, d


def _unpack(out, layout, flat, batch: int, seq: int):
    kind, dim = layout
    if kind == "const":
        return out
    if kind == "seq_len":
        return seq
    rows = out.movedim(dim, 1)[0]  # [T or B, ...]
    if kind == "sequence":
        return rows.movedim(0, dim - 1)
    full = rows.new_zeros(batch * seq, *rows.shape[1:])
    full[flat] = rows
    return full.view(batch, seq, *rows.shape[1:]).movedim(1, dim)


class _SingleSequence(torch.nn.Module):
    """The Dynamo graph called for one sequence: ``(*token tensors [1, T]) -> outputs``."""

    def __init__(self, gm: torch.fx.GraphModule, args: list[_Arg]):
        super().__init__()
        self.gm, self.spec = gm, args
        for i, a in enumerate(args):
            if isinstance(a.value, torch.Tensor):
                name = f"const_{i}"
                if isinstance(a.value, torch.nn.Parameter):
                    self.register_parameter(name, a.value)
                else:
                    self.register_buffer(name, a.value, persistent=False)

    def forward(self, *tokens):
        num_tokens = tokens[0].shape[1]
        it, call = iter(tokens), []
        for i, a in enumerate(self.spec):
            if a.kind == "token":
                call.append(next(it))
            elif a.kind == "mask":
                call.append(torch.ones(1, num_tokens, dtype=a.value, device=tokens[0].device))
            elif a.kind == "batch":
                call.append(1)
            elif a.kind == "seq":
                call.append(num_tokens)
            elif a.kind == "scalar":
                call.append(None)  # specialised away
            else:
                call.append(getattr(self, f"const_{i}") if isinstance(a.value, torch.Tensor) else a.value)
        return tuple(self.gm(*call))


def _name(node: torch.fx.Node) -> str:
    name = node.target.removeprefix("L_").removesuffix("_")
    if name.startswith("kwargs_"):
        return name.removeprefix("kwargs_")
    if name.startswith("args_") and name[5:].isdigit() and int(name[5:]) < len(_POSITIONAL):
        return _POSITIONAL[int(name[5:])] or name
    return name


def _classify_inputs(gm: torch.fx.GraphModule, example_inputs) -> list[_Arg]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = [_name(n) for n in placeholders]
    vals = [n.meta.get("example_value") for n in placeholders]
    anchor = next((i for i, name in enumerate(names) if name in ("input_ids", "inputs_embeds")), None)
    if anchor is None:
        raise Unpackable(f"no input_ids/inputs_embeds among the graph inputs {names}")
    mask = next((i for i, name in enumerate(names) if name == "attention_mask"), None)
    batch_syms, seq_syms = set(), set()
    for i in (anchor, mask):
        if i is None:
            continue
        b, s = vals[i].shape[:2]
        if not isinstance(s, torch.SymInt):
            raise Unpackable("static shapes: the graph is specialised to one seq_len; "
                             "pass dynamic=True to torch.compile to pack from the first call")
        seq_syms.add(s.node.expr)
        if isinstance(b, torch.SymInt):
            batch_syms.add(b.node.expr)
    args = []
    for i, (name, val, example) in enumerate(zip(names, vals, example_inputs)):
        if isinstance(val, torch.SymInt):
            expr = val.node.expr
            kind = "batch" if expr in batch_syms else "seq" if expr in seq_syms else None
            if kind is None:
                raise Unpackable(f"graph input {name} is a size not tied to (batch, seq_len)")
            args.append(_Arg(kind, name))
        elif _is_scalar_input(placeholders[i], val):
            args.append(_Arg("scalar", name, float(example.item())))
        elif i == mask:
            args.append(_Arg("mask", name, val.dtype))
        elif isinstance(val, torch.Tensor) and val.dim() >= 2 and _is_sym(val.shape[1], seq_syms) \
                and (_is_sym(val.shape[0], batch_syms) or val.shape[0] == vals[anchor].shape[0]):
            args.append(_Arg("token", name))
        elif isinstance(val, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in val.shape):
            raise Unpackable(f"graph input {name} (shape {tuple(val.shape)}) is neither per-token nor fixed")
        else:
            args.append(_Arg("const", name, example))
    return args


def _is_scalar_input(node: torch.fx.Node, val) -> bool:
    """A 0-d tensor Dynamo made of a Python float attribute (``eps``, ``dropout_p``), read by ``.item()``."""
    return (isinstance(val, torch.Tensor) and val.dim() == 0 and bool(node.users)
            and all(u.op == "call_method" and u.target == "item" for u in node.users))


def _specialize_scalars(gm: torch.fx.GraphModule, args: list[_Arg]) -> torch.fx.GraphModule:
    """A copy of ``gm`` (sharing its parameters) with each scalar input's ``.item()`` replaced
    by the value it had at compile time; the packed call checks the values are unchanged."""
    graph = copy.deepcopy(gm.graph)
    for node, a in zip([n for n in graph.nodes if n.op == "placeholder"], args):
        if a.kind == "scalar":
            for user in list(node.users):
                user.replace_all_uses_with(a.value)
                graph.erase_node(user)
    return torch.fx.GraphModule(gm, graph)


def _is_sym(size, syms) -> bool:
    return isinstance(size, torch.SymInt) and size.node.expr in syms


def _sample_tokens(args, token_args, examples, lens) -> list[torch.Tensor]:
    """Sample token inputs of one packed row made of sequences of ``lens`` tokens."""
    g = torch.Generator().manual_seed(0)
    total = sum(lens)
    out = []
    for i, example in zip(token_args, examples):
        name = args[i].name
        shape = (1, total, *example.shape[2:])
        if name == "position_ids":
            t = torch.cat([torch.arange(n) for n in lens])[None]
        elif example.is_floating_point():
            t = torch.randn(shape, generator=g)
        elif name == "input_ids":
            t = torch.randint(0, 10, shape, generator=g)
        else:
            t = torch.zeros(shape, dtype=torch.long)
        out.append(t.to(device=example.device, dtype=example.dtype))
    return out
