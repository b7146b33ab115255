"""The ``sequence_independence`` pass: sequences of a packed step must not leak into each other.

Any op outside attention that reduces over the token dimension (a statistic over all positions
of the call, a norm over tokens, a choice made from the longest position, ...) sees every
sequence of a packed step at once: a silent wrong answer whenever sequences of different lengths
share a step or a prompt is chunked. So the rewritten step runs on a packed sample (three
sequences of different lengths, one of them in two chunks beside a decode) and each sequence's
logits, at every position, are compared with the captured graph run on that sequence alone.

Tolerance, as FlashAttention's tests tie it to the precision at hand (:mod:`.numerics`): the
error of the packed logits against a float64 run of the captured graph may be at most
``RTOL_FACTOR`` times the error of the per-sequence run in the model's own dtype, plus a floor
for exact ties. A model that fails is refused with the first node (in graph order) whose
per-sequence values break the same rule (:func:`first_differing_node`).
"""
from __future__ import annotations

import torch
import torch.fx

from pagedpack.passes.find import token_sizes
from pagedpack.passes.manager import Pass, PassContext, PassResult
from pagedpack.passes.numerics import equal_to_floor, excess_error, float64_copy, float64_inputs
from pagedpack.passes.report import op_name
from pagedpack.passes.verify import sample_values
from pagedpack.step.contract import METADATA_INPUTS, STATE_INPUTS
from pagedpack.step.metadata import paged_metadata, state_metadata

# Step 1 computes A[:5], B[:11], C[:4]; step 2 computes C[4:9] and A's sixth token (a decode).
_LENGTHS = {"A": 6, "B": 11, "C": 9}
_STEPS = ({"A": 5, "B": 11, "C": 4}, {"C": 5, "A": 1})
_BLOCK_SIZE = 4


class SequenceIndependence(Pass):
    """``sequence_independence``: refuse the model if the packed step couples its sequences.

    Needs ``ctx.reference`` (the captured graph, sharing the parameters) and
    ``ctx.kv_cache_specs``. Counts: matched = sequences checked, refused = 1 on a coupling.
    """

    name = "sequence_independence"
    requires = ("kv_cache_specs",)
    mutates = False

    def __call__(self, ctx: PassContext) -> PassResult:
        ctx.graph_module.recompile()
        sample = _Sample(ctx)
        packed = sample.run_packed()
        single = {name: sample.run_single(tokens) for name, tokens in sample.tokens.items()}
        if all(equal_to_floor(packed[name], single[name]) for name in single):
            return PassResult(matched=len(single))
        float64 = float64_copy(ctx.reference)
        exact = {name: sample.run_single(tokens, float64) for name, tokens in sample.tokens.items()}
        del float64
        coupled = [name for name in single if excess_error(packed[name], single[name], exact[name])]
        if not coupled:
            return PassResult(matched=len(single))
        node = sample.first_coupled_node()
        where = f" (first differing node: {node})" if node else ""
        ctx.report.notes.append(
            f"sequence_independence: the packed step gives sequence(s) {', '.join(coupled)} other logits than the "
            f"captured graph run on each alone{where}: an op outside attention mixes the sequences of a step "
            "(e.g. a reduction over all positions of the call)")
        return PassResult(matched=len(single), refused=1)


class _Sample:
    """The packed sample of the module docstring for ``ctx``'s graphs."""

    def __init__(self, ctx: PassContext):
        self.ctx = ctx
        self.device = next(ctx.graph_module.parameters()).device
        vocab = _output_value(ctx.reference).shape[-1]
        g = torch.Generator().manual_seed(0)
        self.tokens = {name: torch.randint(0, vocab, (n,), generator=g).tolist() for name, n in _LENGTHS.items()}

    def run_single(self, tokens: list[int], module: torch.fx.GraphModule | None = None) -> torch.Tensor:
        """``[n, vocab]`` logits of the captured graph (or of ``module``, its float64 copy) on ``tokens`` alone."""
        module = module or self.ctx.reference
        ids = torch.tensor([tokens], device=self.device)
        with torch.no_grad():
            out = module(ids, torch.arange(len(tokens), device=self.device)[None])
        return (out[0] if isinstance(out, (tuple, list)) else out)[0]

    def steps(self) -> list[tuple[list[str], dict]]:
        """Each step's sequence order and graph inputs (logits for every row: ``logits_indices`` = all)."""
        computed = dict.fromkeys(self.tokens, 0)
        block_ids: dict[str, list[int]] = {name: [] for name in self.tokens}
        next_block, out = 0, []
        for step in _STEPS:
            for name, n in step.items():
                needed = -(-(computed[name] + n) // _BLOCK_SIZE)
                while len(block_ids[name]) < needed:
                    block_ids[name].append(next_block)
                    next_block += 1
            batch = paged_metadata(list(step.values()), [computed[name] for name in step],
                                   [block_ids[name] for name in step], block_size=_BLOCK_SIZE,
                                   input_ids=[t for name, n in step.items()
                                              for t in self.tokens[name][computed[name]:computed[name] + n]])
            batch = batch._replace(logits_indices=torch.arange(batch.num_tokens)).to(self.device)
            inputs = batch.as_inputs()
            if self.ctx.state_specs:  # each sequence in its own slot (A 0, B 1, C 2), continuing its state
                slots = [list(self.tokens).index(name) for name in step]
                inputs.update(zip(STATE_INPUTS, state_metadata(slots, [computed[name] for name in step], self.device)))
            out.append((list(step), inputs))
            for name, n in step.items():
                computed[name] += n
        return out

    @property
    def num_blocks(self) -> int:
        return sum(-(-n // _BLOCK_SIZE) for n in _LENGTHS.values())

    def empty_caches(self) -> list[torch.Tensor]:
        """Zeroed KV caches for the sample, one pair per layer, then the zeroed recurrent states
        (a slot per sequence), if any."""
        return [*(torch.zeros(shape, dtype=spec.dtype, device=self.device) for spec in self.ctx.kv_cache_specs
                  for shape in spec.cache_shapes(self.num_blocks, _BLOCK_SIZE)),
                *(torch.zeros(spec.state_shape(len(self.tokens)), dtype=spec.dtype, device=self.device)
                  for spec in self.ctx.state_specs)]

    def arguments(self, inputs: dict, caches: list[torch.Tensor]) -> tuple:
        """The step graph's positional inputs: metadata, KV caches, then the state inputs, if any."""
        kv = 2 * len(self.ctx.kv_cache_specs)
        state = [inputs[name] for name in STATE_INPUTS] if self.ctx.state_specs else []
        return (*(inputs[name] for name in METADATA_INPUTS), *caches[:kv], *state, *caches[kv:])

    def run_packed(self) -> dict[str, torch.Tensor]:
        """Each sequence's ``[n, vocab]`` logits, assembled from the packed steps."""
        caches = self.empty_caches()
        rows: dict[str, list[torch.Tensor]] = {name: [] for name in self.tokens}
        for order, inputs in self.steps():
            with torch.no_grad():
                logits = self.ctx.graph_module(*self.arguments(inputs, caches))
            cu = inputs["cu_seqlens_q"].tolist()
            for b, name in enumerate(order):
                rows[name].append(logits[cu[b]:cu[b + 1]])
        return {name: torch.cat(parts) for name, parts in rows.items()}

    def first_coupled_node(self) -> str | None:
        """:func:`first_differing_node` on the first step."""
        order, inputs = self.steps()[0]
        lens = [_STEPS[0][name] for name in order]
        singles = [(torch.tensor([self.tokens[name][:n]], device=self.device),
                    torch.arange(n, device=self.device)[None]) for name, n in zip(order, lens)]
        packed_inputs = self.arguments(inputs, self.empty_caches())
        return first_differing_node(self.ctx.graph_module, packed_inputs, self.ctx.reference, singles, lens)


def first_differing_node(packed: torch.fx.GraphModule, packed_inputs: tuple, reference: torch.fx.GraphModule,
                         singles: list[tuple], lens: list[int]) -> str | None:
    """``"name = op"`` of the first ``call_function`` node of ``packed`` (graph order), present in
    ``reference`` too (by name), whose values on ``packed_inputs`` (sequences of ``lens`` tokens in
    one packed row) break the rule of :mod:`.numerics` against ``reference`` run on each sequence
    alone (``singles``: its inputs per sequence), or None. A node is compared per sequence, sliced
    along its token dimension (the one ``reference`` records as a symbolic input size), or whole
    if it has none; nodes with several symbolic dimensions are skipped. Runs ``reference`` in
    float64 too (a copy of its parameters)."""
    shared = ({n.name for n in reference.graph.nodes if n.op == "call_function"}
              & {n.name for n in packed.graph.nodes})
    wanted = lambda node: node.name in shared  # noqa: E731
    dims = _token_dims(reference, shared)
    got = sample_values(packed, wanted, packed_inputs)
    own = [_by_name(sample_values(reference, wanted, inputs)) for inputs in singles]
    float64 = float64_copy(reference)
    exact = [_by_name(sample_values(float64, wanted, float64_inputs(inputs))) for inputs in singles]
    del float64
    for node, value in got.items():
        if node.name not in dims or not isinstance(value, torch.Tensor):
            continue
        dim = dims[node.name]
        parts = [value] * len(lens) if dim is None else value.split(lens, dim=dim)
        for part, o, e in zip(parts, (s.get(node.name) for s in own), (s.get(node.name) for s in exact)):
            if (isinstance(o, torch.Tensor) and isinstance(e, torch.Tensor) and o.shape == part.shape
                    and excess_error(part, o, e)):
                return f"{node.name} = {op_name(node.target)}"
    return None


def _token_dims(reference: torch.fx.GraphModule, names: set[str]) -> dict[str, int | None]:
    """For each node of ``names`` with a tensor value recorded: its token dimension (the one whose
    size is a symbolic input size), or None if it has no symbolic size; nodes with another
    symbolic size are left out."""
    sizes, dims = token_sizes(reference.graph), {}
    for node in reference.graph.nodes:
        val = node.meta.get("val")
        if node.name not in names or not isinstance(val, torch.Tensor):
            continue
        symbolic = [d for d, s in enumerate(val.shape) if isinstance(s, torch.SymInt)]
        token = [d for d in symbolic if val.shape[d].node.expr in sizes]
        if symbolic == token and len(token) <= 1:
            dims[node.name] = token[0] if token else None
    return dims


def _by_name(values: dict) -> dict:
    return {node.name: value for node, value in values.items()}


def _output_value(module: torch.fx.GraphModule) -> torch.Tensor:
    """The (fake) value export recorded for the captured graph's logits ``[1, T, vocab]``."""
    out = module.graph.output_node().args[0]
    return (out[0] if isinstance(out, (tuple, list)) else out).meta["val"]
