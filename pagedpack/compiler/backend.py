"""The ``torch.compile`` backend ``"pagedpack"``: padding-free forward passes.

``torch.compile(model, backend="pagedpack")`` hands each Dynamo graph of a padded forward
(``input_ids [B, S]``, ``attention_mask [B, S]``, left or right padding) to
:func:`pagedpack_backend`. It re-traces the graph for one row of ``T`` tokens with
``torch.export`` (dynamic ``T``), rewrites it with :mod:`pagedpack.passes.varlen`, checks the
result on a sample against the original graph run per sequence (within FlashAttention's float64
rule, :mod:`pagedpack.passes.numerics`), and returns a callable that

1. packs the real tokens (``attention_mask == 1``) into one row, with ``positions =
   cumsum(attention_mask) - 1`` per row (or the caller's ``position_ids``) and ``cu_seqlens``;
2. runs the packed graph (optionally compiled by Inductor, custom ops kept opaque);
3. scatters each output back to the caller's padded shape, zeros under padding.

The role of each dimension (batch, tokens) comes from the symbols of Dynamo's dynamic shapes, never
from comparing sizes: the token dimension of an output is the one whose size is the sequence
length's symbol, so a model size equal to a sample's (heads, KV heads, head_dim) cannot be taken
for it. The sample sizes avoid every static size of the graph as well.

A graph the backend cannot pack (static shapes, an unsupported pattern, an output it cannot lay
out, a sequence-aware op) runs as Dynamo captured it; the warning and the report in
:data:`LAST_REPORTS` (``left_as_captured``) name the input, output, node or site that forced it.
Options (``options={...}``): ``inductor`` (bool, default False): compile the packed graph with
Inductor.
"""
from __future__ import annotations

import copy
import itertools
import logging
from dataclasses import dataclass

import torch
import torch.fx
import torch.utils._pytree as pytree

from pagedpack.models.recurrent import first_recurrent, recurrent_refusal
from pagedpack.models.sparse import first_indexer, indexer_refusal
from pagedpack.passes.cleanup import strip_export_checks
from pagedpack.passes.independence import first_differing_node
from pagedpack.passes.numerics import equal_to_floor, excess_error, float64_copy, float64_inputs
from pagedpack.passes.report import PassReport
from pagedpack.passes.varlen import rewrite_varlen

log = logging.getLogger(__name__)
LAST_REPORTS: list[PassReport] = []  # one per Dynamo graph compiled, newest last
_POSITIONAL = (None, "input_ids", "attention_mask")  # HF forward order after ``self``
# Dynamo's graphs carry no config: masks are checked past this many tokens, so that a sliding window
# or attention chunk up to it is seen (Mistral's 4096, Gemma's 512/1024/4096); a longer one would go
# unseen (Llama-4's 8192-position chunks: calls longer than that attend across a chunk boundary; LLM
# reads the chunk off the config and is exact).
PROBE_WINDOW = 4096


class Unpackable(Exception):
    """The graph cannot be packed; the message names the input, output, node or site that forced
    it. ``report``: the rewrite's, if it ran."""

    def __init__(self, reason: str, report: PassReport | None = None):
        super().__init__(reason)
        self.report = report


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
        modules = [(path.split("].", 1)[-1], kind) for node in gm.graph.nodes
                   for path, kind in (node.meta.get("nn_module_stack") or {}).values()]
        recurrent, indexer = first_recurrent(modules), first_indexer(modules)
        if recurrent is not None or indexer is not None:  # the re-trace below sees Dynamo's flat module
            report = PassReport(notes=[recurrent_refusal(*recurrent) if recurrent else indexer_refusal(*indexer)])
            self._leave_as_captured(Unpackable(report.notes[0]), report)
            return
        try:
            self.args, roles = _classify_inputs(gm, example_inputs)
            self.layouts = _output_layouts(gm, roles)
        except Unpackable as err:
            self._leave_as_captured(err)
            return
        self.shapes = [_describe(val) for val in _output_values(gm)]
        self.lens = sample_lengths(gm)
        self.token_args = [i for i, a in enumerate(self.args) if a.kind == "token"]
        self.position_arg = next((i for i, a in enumerate(self.args) if a.name == "position_ids"), None)
        self.scalar_args = [(i, a.value) for i, a in enumerate(self.args) if a.kind == "scalar"]
        self.original = _SingleSequence(_specialize_scalars(gm, self.args), self.args)

    def _leave_as_captured(self, err: Unpackable, report: PassReport | None = None) -> None:
        self.report = report or PassReport()
        if self.report.stopped_at is None and self.report.sites:  # rewritten, then refused on the sample
            self.report.stop("verify_packed")
        self.report.left_as_captured = str(err)
        LAST_REPORTS.append(self.report)
        log.warning("pagedpack: graph left as captured: %s", err)
        self.run = self.gm

    def _build(self, example_tokens) -> None:
        report = None
        try:
            self.program, report, reference = self._rewrite(example_tokens)
            self._verify(example_tokens, reference)
        except Unpackable as err:
            self._leave_as_captured(err, err.report or report)
            return
        self.report = report
        self.run, self.packed = self.program, True
        if self.inductor:
            self.run = torch.compile(self.program, backend="inductor", dynamic=True, fullgraph=True)
        LAST_REPORTS.append(self.report)

    def _rewrite(self, example_tokens):
        """The packed program, its report and a copy of the re-traced graph before the rewrite
        (parameters shared). Raises :class:`Unpackable` if the re-trace or the rewrite fails."""
        n = max(self.lens)
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
        reference = torch.fx.GraphModule(program, copy.deepcopy(program.graph))
        strip_export_checks(reference)  # it runs on each sequence of the sample, one of a single token
        report = rewrite_varlen(  # strips export's guards too
            program, tuple(sample), n, window_hint=PROBE_WINDOW,
            make_sample=lambda t: tuple(_sample_tokens(self.args, self.token_args, example_tokens, [t])))
        if not report.ok:
            raise Unpackable(report.refusal(), report)
        return program, report, reference

    def _verify(self, example_tokens, reference: torch.fx.GraphModule) -> None:
        """Run the packed program on a sample of sequences of ``self.lens`` tokens against the
        original graph run per sequence: each output laid out as :func:`_output_layouts` says, within
        the rule of :mod:`pagedpack.passes.numerics` against ``reference`` (the re-traced graph
        before the rewrite) run in float64. Raises :class:`Unpackable` naming the output, the
        sequence and the first node that differs."""
        lens = self.lens
        packed = _sample_tokens(self.args, self.token_args, example_tokens, lens)
        device = packed[0].device
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)
        positions = torch.cat([torch.arange(n) for n in lens]).to(device)
        singles = [tuple(t[:, a:b] for t in packed) for a, b in itertools.pairwise(cu.tolist())]
        try:
            with torch.no_grad():
                outs = self.program(*packed, positions, cu)
        except Exception as err:  # the rewrite misread the graph: report it, keep the graph
            raise Unpackable(f"the packed graph fails on a sample of {list(lens)} tokens: "
                             f"{type(err).__name__}: {str(err)[:200]}") from err
        with torch.no_grad():
            refs = [self.original(*inputs) for inputs in singles]
        pairs = [_per_sequence(i, out, [r[i] for r in refs], layout, lens, self.shapes[i])
                 for i, (out, layout) in enumerate(zip(outs, self.layouts))]
        if all(equal_to_floor(got, ref) for per_output in pairs for got, ref in per_output):
            return
        float64 = float64_copy(reference)
        with torch.no_grad():
            exact = [float64(*float64_inputs(inputs)) for inputs in singles]
        del float64
        for i, per_output in enumerate(pairs):
            for b, (got, ref) in enumerate(per_output):
                excess = excess_error(got, ref, exact[b][i])
                if excess:
                    node = first_differing_node(self.program, (*packed, positions, cu), reference, singles, lens)
                    raise Unpackable(
                        f"output {i} ({self.shapes[i]}) of sequence {b} ({lens[b]} tokens) of the packed "
                        f"sample is {excess}: a sequence-aware op the pass does not handle "
                        f"(first differing node: {node or 'none found'})")

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
        if not flat.numel():  # every row is padding: no token to pack (a packed step of 0 tokens fails)
            return self._as_captured(args)
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


def _output_layouts(gm: torch.fx.GraphModule, roles: _Roles) -> list[tuple[str, int | None]]:
    """Each output's layout, read off its symbolic shape in the Dynamo graph ``gm``:
    ("token", d): per token along dim ``d``, the one whose size is the sequence length's symbol
    (dim 0 is the batch); ("sequence", 1): per sequence (dim 0 is the batch, no dim is the sequence
    length: the packed graph has one row per sequence along dim 1, after the packed row's dim 0);
    ("seq_len", None): the sequence length; ("const", None): neither a batch nor a sequence-length
    dimension. Raises :class:`Unpackable` naming the output for any other use of the symbols."""
    return [_output_layout(i, val, roles) for i, val in enumerate(_output_values(gm))]


def _output_values(gm: torch.fx.GraphModule) -> list:
    """The example value (symbolic shapes) Dynamo recorded for each output of ``gm``."""
    return [o.meta.get("example_value") if isinstance(o, torch.fx.Node) else o
            for o in gm.graph.output_node().args[0]]


def _describe(val) -> str:
    return f"shape {tuple(val.shape)}" if isinstance(val, torch.Tensor) else repr(val)


def _output_layout(i: int, val, roles: _Roles) -> tuple[str, int | None]:
    where = f"output {i} ({_describe(val)})"
    if isinstance(val, torch.SymInt):
        if roles.is_seq(val):
            return "seq_len", None
        raise Unpackable(f"{where} is a size other than the sequence length")
    if not isinstance(val, torch.Tensor):
        return "const", None
    shape = tuple(val.shape)
    for d, size in enumerate(shape):
        if isinstance(size, torch.SymInt) and not roles.is_seq(size) and not (d == 0 and roles.is_batch(size)):
            raise Unpackable(f"{where}: dim {d} is {size}, neither the sequence length nor (dim 0) the batch size")
    token_dims = [d for d, size in enumerate(shape) if roles.is_seq(size)]
    batch_first = bool(shape) and roles.is_batch(shape[0])
    if len(token_dims) > 1:
        raise Unpackable(f"{where}: the sequence length in dims {token_dims} (token by token, as attention "
                         "weights are), a layout the packed call does not scatter back")
    if token_dims and not batch_first:
        raise Unpackable(f"{where}: per token (dim {token_dims[0]}) but dim 0 is not the batch")
    if token_dims:
        return "token", token_dims[0]
    return ("sequence", 1) if batch_first else ("const", None)


def _per_sequence(i: int, out, refs: list, layout: tuple[str, int | None], lens, described: str) -> list[tuple]:
    """Output ``i`` of the packed sample cut into ``(packed, unpacked)`` pairs per sequence (``refs``:
    the unpacked graph's, one per sequence) as ``layout`` says; non-tensor and constant outputs are
    checked here and give no pairs. Raises :class:`Unpackable` naming the output on a mismatch."""
    kind, dim = layout
    total, where = sum(lens), f"output {i} ({described})"
    if kind == "seq_len":
        if out != total or list(refs) != list(lens):
            raise Unpackable(f"{where} gives {out} for the packed sample (T={total}) and {refs} per sequence, "
                             "not the sequence length")
        return []
    if kind == "const":
        if not all(_same(r, out) for r in refs):
            raise Unpackable(f"{where} has no batch or sequence-length dimension but differs per sequence")
        return []
    if kind == "token" and out.dim() > dim and out.shape[dim] == total:
        got = out.split(list(lens), dim=dim)
    elif kind == "sequence" and out.dim() > 1 and out.shape[:2] == (1, len(lens)):
        got = out.unbind(1)
    else:
        got = ()
    if len(got) != len(refs) or any(g.shape != r.shape for g, r in zip(got, refs)):
        raise Unpackable(f"{where}: the packed graph gives shape {tuple(out.shape)} for {len(lens)} sequences of "
                         f"{list(lens)} tokens, the unpacked graph {[tuple(r.shape) for r in refs]}: a "
                         "sequence-aware op the pass does not handle")
    return list(zip(got, refs))


def _same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a == b


def _unpack(out, layout, flat, batch: int, seq: int):
    kind, dim = layout
    if kind == "const":
        return out
    if kind == "seq_len":
        return seq
    if kind == "sequence":
        return out[0]  # [1, B, ...] -> [B, ...]
    rows = out.movedim(dim, 1)[0]  # [T, ...]
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


@dataclass(frozen=True)
class _Roles:
    """The Dynamo graph's batch size and sequence length as its shapes carry them: the symbols
    (``sympy`` expressions) of each; a batch Dynamo specialised (to 1) is ``static_batch``."""

    batch: frozenset
    seq: frozenset
    static_batch: int | None

    def is_seq(self, size) -> bool:
        return isinstance(size, torch.SymInt) and size.node.expr in self.seq

    def is_batch(self, size) -> bool:
        return size.node.expr in self.batch if isinstance(size, torch.SymInt) else size == self.static_batch


def _classify_inputs(gm: torch.fx.GraphModule, example_inputs) -> tuple[list[_Arg], _Roles]:
    """How to produce each graph input in the packed call, and the roles of the symbols (read off
    ``input_ids``/``inputs_embeds`` and ``attention_mask``, ``[batch, seq_len, ...]``). Raises
    :class:`Unpackable` naming the input for static shapes, one symbol for both the batch size
    and the sequence length, or an input tied to neither."""
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
            raise Unpackable(f"static shapes: input {names[i]} {tuple(vals[i].shape)} is specialised to one "
                             "seq_len; pass dynamic=True to torch.compile to pack from the first call")
        seq_syms.add(s.node.expr)
        if isinstance(b, torch.SymInt):
            batch_syms.add(b.node.expr)
    if batch_syms & seq_syms:
        raise Unpackable(
            f"input {names[anchor]} {tuple(vals[anchor].shape)}: Dynamo gave the batch size and the sequence length "
            "one symbol (duck sizing: the call that compiled this graph had as many rows as tokens per row), so "
            "the graph cannot run one sequence of another length; a call with another shape compiles one that packs")
    batch = vals[anchor].shape[0]
    roles = _Roles(frozenset(batch_syms), frozenset(seq_syms), None if isinstance(batch, torch.SymInt) else batch)
    args = []
    for i, (name, val, example) in enumerate(zip(names, vals, example_inputs)):
        if isinstance(val, torch.SymInt):
            kind = "batch" if roles.is_batch(val) else "seq" if roles.is_seq(val) else None
            if kind is None:
                raise Unpackable(f"graph input {name} ({val}) is a size other than the batch size and seq_len")
            args.append(_Arg(kind, name))
        elif _is_scalar_input(placeholders[i], val):
            args.append(_Arg("scalar", name, float(example.item())))
        elif i == mask:
            args.append(_Arg("mask", name, val.dtype))
        elif (isinstance(val, torch.Tensor) and val.dim() >= 2 and roles.is_seq(val.shape[1])
              and roles.is_batch(val.shape[0])):
            args.append(_Arg("token", name))
        elif isinstance(val, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in val.shape):
            raise Unpackable(f"graph input {name} (shape {tuple(val.shape)}) is neither per-token nor fixed")
        else:
            args.append(_Arg("const", name, example))
    return args, roles


def sample_lengths(gm: torch.fx.GraphModule) -> tuple[int, ...]:
    """The sequence lengths of the packed sample the backend checks a graph on (the longest is also
    the length it re-traces at): at least three sequences, one of a single token; no other length,
    their count or their sum is a static size in ``gm``'s values (heads, KV heads, head_dim,
    hidden, vocabulary, ...). The roles of dimensions come from the symbols; this is the second
    line of defence, so that no check on values can take a model size for a token or sequence
    count."""
    taken = {size for node in gm.graph.nodes for val in pytree.tree_leaves(node.meta.get("example_value"))
             if isinstance(val, torch.Tensor) for size in val.shape if isinstance(size, int)}
    free = (k for k in itertools.count(3) if k not in taken)
    count = next(free)
    lens = [next(free) for _ in range(count - 1)]
    while sum(lens) + 1 in taken:
        lens[-1] = next(free)
    return (lens[0], 1, *lens[1:])


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
