"""The ``sequence_independence`` pass: sequences of a packed step must not leak into each other.

Any op outside attention that reduces over the token dimension (a statistic over all positions
of the call, a norm over tokens, a choice made from the longest position, ...) sees every
sequence of a packed step at once: a silent wrong answer whenever sequences of different lengths
share a step or a prompt is chunked. So the rewritten step runs on a packed sample (three
sequences of different lengths, one of them in two chunks beside a decode) and each sequence's
logits, at every position, are compared with the captured graph run on that sequence alone.

Tolerance, as FlashAttention's tests tie it to the precision at hand: the error of the packed
logits against a float64 run of the captured graph may be at most ``RTOL_FACTOR`` times the
error of the per-sequence run in the model's own dtype, plus a floor for exact ties. A model that
fails is refused with the first node (in graph order) whose per-sequence values differ.
"""
from __future__ import annotations

import copy

import torch
import torch.fx

from pagedpack.contract import METADATA_INPUTS
from pagedpack.passes.cleanup import strip_export_checks
from pagedpack.passes.manager import Pass, PassContext, PassResult
from pagedpack.passes.report import op_name
from pagedpack.passes.verify import sample_values
from pagedpack.runtime.batch import build_batch
from pagedpack.runtime.request import Request
from pagedpack.runtime.sampling import SamplingParams
from pagedpack.runtime.scheduler import ScheduledRequest

# Step 1 computes A[:5], B[:11], C[:4]; step 2 computes C[4:9] and A's sixth token (a decode).
_LENGTHS = {"A": 6, "B": 11, "C": 9}
_STEPS = ({"A": 5, "B": 11, "C": 4}, {"C": 5, "A": 1})
_BLOCK_SIZE = 4
RTOL_FACTOR = 8.0
_FLOOR = 1e-6  # relative to the logits' magnitude: ties of an exact computation


class SequenceIndependence(Pass):
    """``sequence_independence``: refuse the model if the packed step couples its sequences.

    Needs ``ctx.reference`` (the captured graph, sharing the parameters) and
    ``ctx.kv_cache_specs``. Counts: matched = sequences checked, refused = 1 on a coupling.
    """

    name = "sequence_independence"
    mutates = False

    def __call__(self, ctx: PassContext) -> PassResult:
        ctx.graph_module.recompile()
        sample = _Sample(ctx)
        packed = sample.run_packed()
        single = {name: sample.run_single(tokens) for name, tokens in sample.tokens.items()}
        worst = {name: (packed[name] - single[name]).abs().max().item() for name in single}
        if all(err <= _FLOOR * (1 + single[name].abs().max().item()) for name, err in worst.items()):
            return PassResult(matched=len(single))
        float64 = float64_copy(ctx.reference)
        exact = {name: sample.run_single(tokens, float64) for name, tokens in sample.tokens.items()}
        del float64
        coupled = [name for name in single if not _within(packed[name], single[name], exact[name])]
        if not coupled:
            return PassResult(matched=len(single))
        node = sample.first_coupled_node()
        where = f" (first differing node: {node})" if node else ""
        ctx.report.notes.append(
            f"sequence_independence: the packed step gives sequence(s) {', '.join(coupled)} other logits than the "
            f"captured graph run on each alone{where}: an op outside attention mixes the sequences of a step "
            "(e.g. a reduction over all positions of the call)")
        return PassResult(matched=len(single), refused=1)


def _within(packed: torch.Tensor, single: torch.Tensor, exact: torch.Tensor) -> bool:
    own_error = (single.double() - exact).abs().max().item()
    floor = _FLOOR * (1 + exact.abs().max().item())
    return (packed.double() - exact).abs().max().item() <= RTOL_FACTOR * own_error + floor


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
        requests = {name: Request(name, tokens, SamplingParams()) for name, tokens in self.tokens.items()}
        next_block, out = 0, []
        for step in _STEPS:
            scheduled = []
            for name, n in step.items():
                request = requests[name]
                needed = -(-(request.num_computed_tokens + n) // _BLOCK_SIZE)
                while len(request.block_ids) < needed:
                    request.block_ids.append(next_block)
                    next_block += 1
                scheduled.append(ScheduledRequest(request, n))
            batch = build_batch(scheduled, block_size=_BLOCK_SIZE, num_blocks=self.num_blocks, device=self.device)
            batch.logits_indices = torch.arange(batch.num_tokens, device=self.device)
            out.append((list(step), batch.as_inputs()))
            for s in scheduled:
                s.request.num_computed_tokens += s.num_new_tokens
        return out

    @property
    def num_blocks(self) -> int:
        return sum(-(-n // _BLOCK_SIZE) for n in _LENGTHS.values())

    def empty_caches(self) -> list[torch.Tensor]:
        """Zeroed KV caches for the sample, one pair per layer."""
        return [torch.zeros(shape, dtype=spec.dtype, device=self.device) for spec in self.ctx.kv_cache_specs
                for shape in spec.cache_shapes(self.num_blocks, _BLOCK_SIZE)]

    def run_packed(self) -> dict[str, torch.Tensor]:
        """Each sequence's ``[n, vocab]`` logits, assembled from the packed steps."""
        caches = self.empty_caches()
        rows: dict[str, list[torch.Tensor]] = {name: [] for name in self.tokens}
        for order, inputs in self.steps():
            with torch.no_grad():
                logits = self.ctx.graph_module(*(inputs[name] for name in METADATA_INPUTS), *caches)
            cu = inputs["cu_seqlens_q"].tolist()
            for b, name in enumerate(order):
                rows[name].append(logits[cu[b]:cu[b + 1]])
        return {name: torch.cat(parts) for name, parts in rows.items()}

    def first_coupled_node(self) -> str | None:
        """The first node of the rewritten graph, present in the captured one too, whose values on
        the first step differ from those of the sequences run alone (sliced along the token dim)."""
        order, inputs = self.steps()[0]
        lens = [_STEPS[0][name] for name in order]
        shared = {n.name for n in self.ctx.reference.graph.nodes} & {n.name for n in self.ctx.graph.nodes}
        wanted = lambda node: node.name in shared and node.op == "call_function"  # noqa: E731
        caches = self.empty_caches()
        packed = sample_values(self.ctx.graph_module, wanted,
                               (*(inputs[name] for name in METADATA_INPUTS), *caches))
        singles = []
        for name, n in zip(order, lens):
            ids = torch.tensor([self.tokens[name][:n]], device=self.device)
            singles.append({node.name: v for node, v in sample_values(
                self.ctx.reference, wanted, (ids, torch.arange(n, device=self.device)[None])).items()})
        total = sum(lens)
        for node, value in packed.items():
            if isinstance(value, torch.Tensor) and _differs(value, [s.get(node.name) for s in singles], lens, total):
                return f"{node.name} = {op_name(node.target)}"
        return None


def _differs(packed: torch.Tensor, singles: list, lens: list[int], total: int) -> bool:
    """Whether ``packed`` disagrees with the per-sequence values: equal shapes are compared whole,
    one dimension of size ``total`` (vs ``lens[b]``) is sliced per sequence; others are skipped."""
    if not all(isinstance(s, torch.Tensor) and s.dim() == packed.dim() for s in singles):
        return False
    if not packed.is_floating_point() and packed.dtype != torch.bool and packed.numel() == 0:
        return False
    if all(s.shape == packed.shape for s in singles) and all(n != total for n in lens):
        return any(not _close(packed, s) for s in singles)
    dims = [d for d in range(packed.dim()) if packed.shape[d] == total
            and all(s.shape[d] == n for s, n in zip(singles, lens))
            and all(s.shape[:d] + s.shape[d + 1:] == packed.shape[:d] + packed.shape[d + 1:] for s in singles)]
    if len(dims) != 1:
        return False
    parts = packed.split(lens, dim=dims[0])
    return any(not _close(p, s) for p, s in zip(parts, singles))


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not a.is_floating_point():
        return torch.equal(a, b)
    a, b = a.double(), b.double()
    return bool(((a - b).abs() <= 1e-3 * (1 + b.abs().max())).all())


def float64_copy(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A float64 copy of ``module`` (parameters copied, the model's stay as they are): casts the
    graph hard-codes to a floating dtype (``x.to(torch.float32)`` in RMSNorm, softmax's
    ``dtype=``) cast to float64 instead, and export's dtype asserts are dropped."""
    module = copy.deepcopy(module).double()
    strip_export_checks(module)
    for node in module.graph.nodes:
        node.args, node.kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), _as_float64)
    module.recompile()
    return module


def _as_float64(value):
    return torch.float64 if isinstance(value, torch.dtype) and value.is_floating_point else value


def _output_value(module: torch.fx.GraphModule) -> torch.Tensor:
    """The (fake) value export recorded for the captured graph's logits ``[1, T, vocab]``."""
    out = module.graph.output_node().args[0]
    return (out[0] if isinstance(out, (tuple, list)) else out).meta["val"]
