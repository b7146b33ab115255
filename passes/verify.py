"""Check on a sample input what the structural match of a site assumes.

A pattern match says *where* attention is; these checks confirm *what* it computes before the
site is rewritten: the mask is exactly the causal mask, the causal mask within a sliding window
(whose size is read off the mask, also at a sample longer than any window the model declares),
the causal mask within chunks of positions (Llama-4's chunked local attention, its chunk read off
the same way), or lets every key through; a score bias (the site's ``bias`` node, and the finite part of an
additive mask, where Falcon's sdpa attention carries it) is ALiBi, ``slope_h * key_pos`` plus a
constant per row on the keys the row sees, and its slopes are read off it (also at a sample past
:data:`ALIBI_PROBE_TOKENS`, where a bias rounded to bfloat16 stops being linear); ``repeat_kv``
maps query head ``h`` to KV head ``h // num_rep``; and the reference op with the site's
parameters (scale, window, soft-cap, slopes) reproduces the site's output on the sample, within
the float64 rule of :mod:`.numerics` (against the site's own nodes run in float64 on its sampled
inputs). A site that fails is refused, never approximated.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx
from torch import Tensor
from torch.fx import Node

import pagedpack.kernels.varlen  # noqa: F401  (registers torch.ops.pagedpack.varlen_attention)
from pagedpack.passes.attention_sites import BLOCKED, HEADS_FIRST, LAYOUT_RANK, AttentionSite, to_tokens_first
from pagedpack.passes.manager import Pass, PassContext, PassResult
from pagedpack.passes.numerics import equal_to_floor, excess_error, float64_copy, float64_inputs
from pagedpack.passes.report import SiteRecord

CAUSAL, BIDIRECTIONAL = "causal", "bidirectional"
PROBE_TOKENS = 64  # masks are also checked at a length past this (or past the model's declared window)
ALIBI_PROBE_TOKENS = 256  # score biases also past this: bfloat16's last exact integer (Falcon rounds to it)


class _Recorder(torch.fx.Interpreter):
    def __init__(self, module: torch.fx.GraphModule, wanted):
        super().__init__(module)
        self.wanted, self.values = wanted, {}

    def run_node(self, node):
        value = super().run_node(node)
        if self.wanted(node):
            self.values[node] = value
        return value


def sample_values(module: torch.fx.GraphModule, wanted, inputs: tuple) -> dict:
    """Run ``module`` on ``inputs`` and keep the values of the nodes for which ``wanted(node)``."""
    recorder = _Recorder(module, wanted)
    with torch.no_grad():
        recorder.run(*inputs)
    return recorder.values


class VerifyAttention(Pass):
    """``verify_attention``: check every site on ``ctx.sample_inputs`` and record it in the report.

    A site is refused for a structural problem found by its match, a failed check, or (with
    ``causal_only``) bidirectional attention. Fills ``ctx.records``, ``ctx.kinds`` (:data:`CAUSAL`,
    :data:`BIDIRECTIONAL`, or None if refused), ``ctx.values`` (the sites' sampled tensors and
    those of the nodes for which ``also(node, ctx.num_tokens)``) and each site's ``sliding_window``
    and ``alibi_slopes``. Counts: matched = sites that pass, refused = sites refused.
    """

    name = "verify_attention"
    requires = ("sites",)
    provides = ("records", "kinds", "values")
    mutates = False

    def __init__(self, *, causal_only: bool, also: Callable[[Node, int], bool] = lambda node, num_tokens: False):
        self.causal_only, self.also = causal_only, also

    def __call__(self, ctx: PassContext) -> PassResult:
        site_nodes = {n for s in ctx.sites for n in s.sampled_nodes}
        ctx.values = sample_values(ctx.graph_module, lambda n: n in site_nodes or self.also(n, ctx.num_tokens),
                                   ctx.sample_inputs)
        probe = probe_masks_and_biases(ctx) if ctx.make_sample is not None else None
        for site in ctx.sites:
            kind, reason = (None, site.refusal) if site.refusal else classify_site(site, ctx.values, ctx.num_tokens,
                                                                                 probe)
            if kind == BIDIRECTIONAL and self.causal_only:
                kind, reason = None, "bidirectional attention (no causal mask): the paged KV cache serves causal LMs"
            ctx.kinds.append(kind)
            ctx.records.append(SiteRecord(site.name, site.form, site.layer, reason=reason,
                                          params=site.params().describe() if kind else ""))
        ctx.report.sites += ctx.records
        refused = ctx.kinds.count(None)
        return PassResult(matched=len(ctx.sites) - refused, refused=refused)


@dataclass(frozen=True)
class Probe:
    """The sites' masks and biases (by node) on one sequence of ``num_tokens`` tokens."""

    num_tokens: int
    values: dict[Node, Tensor]


def probe_masks_and_biases(ctx: PassContext) -> Probe | None:
    """Each site's mask and bias at a sample longer than any sliding window the model may have
    (``ctx.window_hint``, else :data:`PROBE_TOKENS`) and, when a site has a score bias on the
    sample, than :data:`ALIBI_PROBE_TOKENS`: only the subgraph computing them runs. None if there
    is nothing to probe or the probe fails (a note says so)."""
    nodes = list(dict.fromkeys(n for s in ctx.sites if s.refusal is None for n in (s.mask, s.bias) if n is not None))
    if not nodes:
        return None
    longest = max(ctx.window_hint or 0, PROBE_TOKENS)
    if any(_has_bias(s, ctx.values) for s in ctx.sites if s.refusal is None):
        longest = max(longest, ALIBI_PROBE_TOKENS)
    num_tokens = longest + 5
    module = _subgraph(ctx.graph_module, nodes)
    try:
        with torch.no_grad():
            values = module(*ctx.make_sample(num_tokens))
    except (RuntimeError, IndexError, ValueError) as err:  # e.g. a position table shorter than the probe
        ctx.report.notes.append(f"masks not probed at T={num_tokens} ({type(err).__name__}: {str(err)[:120]}): "
                                f"a sliding window or a bias that changes past T={ctx.num_tokens} would go unseen")
        return None
    return Probe(num_tokens, dict(zip(nodes, values)))


def _has_bias(site: AttentionSite, values: dict) -> bool:
    """``site`` has a score bias on the sample: a ``bias`` node, or one its mask carries."""
    return site.bias is not None or (site.mask is not None
                                     and mask_parts(values[site.mask], site.mask_marks_blocked)[1] is not None)


def _subgraph(gm: torch.fx.GraphModule, outputs: list[Node]) -> torch.fx.GraphModule:
    """A module computing ``outputs`` (as a tuple) from ``gm``'s inputs with their ancestors only."""
    needed, stack = set(), list(outputs)
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    graph, env = torch.fx.Graph(), {}
    for node in gm.graph.nodes:
        if node in needed or node.op == "placeholder":
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[n] for n in outputs))
    return torch.fx.GraphModule(gm, graph)


def classify_site(site: AttentionSite, values: dict, num_tokens: int,
                  probe: Probe | None = None) -> tuple[str | None, str | None]:
    """``(kind, None)`` with kind :data:`CAUSAL` or :data:`BIDIRECTIONAL`, or ``(None, refusal)``.

    Reads the mask and the bias (at ``num_tokens``, and at the longer ``probe`` if given: the
    window and the ALiBi slopes come from the longest sample and must fit every one), sets
    ``site.sliding_window`` and ``site.alibi_slopes``, then checks the shapes, ``repeat_kv`` and
    that the reference op with the site's parameters computes the site's output on the sample."""
    samples = [score_terms(site, values, num_tokens)]
    if probe is not None and (site.mask is not None or site.bias is not None):
        samples.append(score_terms(site, probe.values, probe.num_tokens))
    reason = next((r for r in samples if isinstance(r, str)), None) or _changes_form(*samples)
    if reason:
        return None, reason
    longest = samples[-1]
    slopes, reason = read_alibi_slopes(samples, site.query.meta["val"].dtype)
    if reason:
        return None, reason
    site.sliding_window, site.attention_chunk_size, site.alibi_slopes = longest.window, longest.chunk, slopes
    if site.sinks is not None:
        site.sink_values, reason = read_sinks(site, values)
        if reason:
            return None, reason
    reason = (_shape_problem(site, values, num_tokens) or _repeat_problem(site, values)
              or _check_output(site, values, longest.kind))
    return (None, reason) if reason else (longest.kind, None)


@dataclass
class ScoreTerms:
    """What a site's mask and bias say on one sequence of ``n`` tokens: the mask ``kind``,
    ``window`` and ``chunk`` (:func:`mask_kind`), the score bias ``[H, n, n]`` float64 in
    softmax-input units and ``visible [n, n]``, the keys each row sees (both None: no bias)."""

    n: int
    kind: str
    window: int | None
    chunk: int | None = None
    bias: Tensor | None = None
    visible: Tensor | None = None

    def describe(self) -> str:
        chunk = f", chunk {self.chunk}" if self.chunk is not None else ""
        return f"{self.kind} (window {self.window}{chunk}{', a bias' if self.bias is not None else ''})"


def score_terms(site: AttentionSite, values: dict, n: int) -> ScoreTerms | str:
    """The :class:`ScoreTerms` of ``site`` from the ``values`` of its mask and bias on a sequence
    of ``n`` tokens, or the refusal: the mask is not causal, windowed or full, or a bias does not
    broadcast to the scores ``[H, n, n]``. The bias is the ``bias`` node times ``bias_factor``
    plus the bias the mask carries (Falcon's eager attention has both)."""
    kind, window, chunk, terms = CAUSAL if site.is_causal else BIDIRECTIONAL, None, None, []
    if site.mask is not None:
        allowed, mask_bias = mask_parts(values[site.mask], site.mask_marks_blocked)
        kind, window, chunk, reason = mask_kind(allowed, n)
        if reason:
            return reason
        terms += [] if mask_bias is None else [mask_bias]
    if site.bias is not None:
        terms.append(values[site.bias].double() * site.bias_factor)
    if not terms:
        return ScoreTerms(n, kind, window, chunk)
    try:
        bias = sum(t.double().reshape(-1, *t.shape[-2:]).expand(site.num_heads, n, n) for t in terms)
    except RuntimeError:
        return (f"score bias of shape(s) {[tuple(t.shape) for t in terms]} does not broadcast to the scores "
                f"[H={site.num_heads}, T={n}, T={n}]")
    return ScoreTerms(n, kind, window, chunk, bias, visible_keys(n, kind, window, bias.device, chunk))


def _changes_form(short: ScoreTerms, long: ScoreTerms | None = None) -> str | None:
    """A refusal if the longer sample's mask kind, window or chunk (one the short sample cannot
    show aside) or presence of a bias differ from the short one's."""
    if long is None:
        return None
    if (long.kind != short.kind or short.window not in (None, long.window) or short.chunk not in (None, long.chunk)
            or (long.bias is None) != (short.bias is None)):
        return (f"attention mask or bias changes form with the length: {short.describe()} at T={short.n}, "
                f"{long.describe()} at T={long.n}")
    return None


def mask_parts(mask: Tensor, marks_blocked: bool = False) -> tuple[Tensor, Tensor | None]:
    """``(allowed, bias)`` of a mask. A boolean mask is ``allowed`` (its negation if it
    ``marks_blocked``, as ``masked_fill``'s); an additive one blocks the entries at or below
    :data:`~pagedpack.passes.attention_sites.BLOCKED` (transformers' dtype min, -inf), and its
    other entries are a score bias: None when all are zero."""
    if mask.dtype == torch.bool:
        return (~mask if marks_blocked else mask), None
    allowed = mask > BLOCKED
    bias = torch.where(allowed, mask, 0)
    return allowed, (bias if bool(bias.any()) else None)


def mask_kind(allowed: Tensor, n: int) -> tuple[str | None, int | None, int | None, str | None]:
    """``(kind, sliding_window, attention_chunk_size, refusal)`` of a boolean ``[..., n, n]`` mask of
    the allowed keys: full (:data:`BIDIRECTIONAL`), causal, causal within a window of ``w < n`` keys
    (each row sees itself and the ``w - 1`` keys before it, as transformers' sliding-window masks),
    or causal within chunks of ``c < n`` positions (row ``i`` sees keys ``(i // c) * c .. i``, as
    transformers' chunked masks of Llama-4)."""
    if allowed.shape[-2:] != (n, n):
        return None, None, None, f"attention mask has shape {tuple(allowed.shape)}, expected [..., {n}, {n}] at T={n}"
    if bool(allowed.all()):
        return BIDIRECTIONAL, None, None, None
    first = allowed.reshape(-1, n, n)[0]
    window = int(first[-1].sum())  # the keys the last row sees
    window = window if window < n else None
    if bool((allowed == visible_keys(n, CAUSAL, window, allowed.device)).all()):
        return CAUSAL, window, None, None
    chunk = int(first[:, 0].sum())  # the rows that see key 0: the first chunk
    if 0 < chunk < n and bool((allowed == visible_keys(n, CAUSAL, None, allowed.device, chunk)).all()):
        return CAUSAL, None, chunk, None
    return None, None, None, (f"attention mask is neither causal, causal within a window or within chunks, nor "
                              f"full (checked at T={n})")


def visible_keys(n: int, kind: str, window: int | None, device: torch.device, chunk: int | None = None) -> Tensor:
    """``[n, n]`` bool: the keys ``j`` row ``i`` sees under a ``kind`` mask: all, or ``j <= i`` and,
    with a ``window``, ``j > i - window`` and, with a ``chunk``, ``j // chunk == i // chunk``."""
    rows, cols = torch.arange(n, device=device)[:, None], torch.arange(n, device=device)
    if kind == BIDIRECTIONAL:
        return torch.ones(n, n, dtype=torch.bool, device=device)
    visible = cols <= rows
    if window is not None:
        visible &= cols > rows - window
    if chunk is not None:
        visible &= cols // chunk == rows // chunk
    return visible


def fit_alibi_slopes(terms: ScoreTerms) -> Tensor:
    """float32 ``[H]``: the slopes ``s_h`` of ``bias[h, i, j] ~ s_h * j + c_{h,i}`` over the visible
    keys ``j`` of each row ``i`` (least squares in float64, a free constant per row: softmax is
    invariant to it, so BLOOM's ``slope * j`` and MPT's ``slope * (j - T + 1)`` read alike)."""
    keys, bias = _centred(terms)
    denominator = (keys * keys).sum()
    if denominator == 0:  # every row sees one key: the bias does not matter
        return torch.zeros(bias.shape[0], dtype=torch.float32, device=bias.device)
    return ((bias * keys).sum((-2, -1)) / denominator).float()


def read_alibi_slopes(samples: list[ScoreTerms], dtype: torch.dtype) -> tuple[Tensor | None, str | None]:
    """``(slopes, None)``: the ALiBi slopes of the longest of ``samples`` (shortest first), or None
    if they have no bias; ``(None, refusal)`` if a sample's bias is not ALiBi
    (:func:`alibi_misfit` of its own fit) or the longest one's slopes do not fit the shortest."""
    if samples[-1].bias is None:
        return None, None
    fits = [fit_alibi_slopes(terms) for terms in samples]
    reason = next(filter(None, (alibi_misfit(terms, slopes, dtype) for terms, slopes in zip(samples, fits))), None)
    if reason is None and alibi_misfit(samples[0], fits[-1], dtype):
        reason = (f"ALiBi slopes change with the length: {fits[0].tolist()} at T={samples[0].n}, "
                  f"{fits[-1].tolist()} at T={samples[-1].n}")
    return (None, reason) if reason else (fits[-1], None)


def alibi_misfit(terms: ScoreTerms, slopes: Tensor, dtype: torch.dtype) -> str | None:
    """A refusal if ``terms.bias`` is not ``slopes[h] * j`` plus a constant per row on the visible
    keys, to within the precision of ``dtype`` (the scores'); None if it is."""
    keys, bias = _centred(terms)
    misfit = (bias - slopes.double()[:, None, None] * keys).abs()
    tolerance = 4 * torch.finfo(dtype).eps * (1 + (terms.bias.abs() * terms.visible).max().item())
    worst = misfit.max().item()
    if worst <= tolerance:
        return None
    head, row, key = (int(i) for i in torch.unravel_index(misfit.argmax(), misfit.shape))
    hint = (f"; past {ALIBI_PROBE_TOKENS} positions a bias rounded to bfloat16, as Falcon's build_alibi_tensor "
            "rounds it, is not linear" if terms.n > ALIBI_PROBE_TOKENS else "")
    return (f"score bias is not ALiBi (slope_h * key_pos plus a constant per query row, on the visible keys) at "
            f"T={terms.n}: off by {worst:.3g} (tolerance {tolerance:.3g} in {str(dtype).removeprefix('torch.')}) at "
            f"head {head}, query {row}, key {key}{hint}")


def _centred(terms: ScoreTerms) -> tuple[Tensor, Tensor]:
    """The key positions ``[n, n]`` and the bias ``[H, n, n]`` minus their mean over each row's
    visible keys, zero at the keys a row does not see (float64)."""
    visible = terms.visible.double()
    count = visible.sum(-1, keepdim=True).clamp(min=1)
    keys = torch.arange(terms.n, dtype=torch.float64, device=visible.device).expand(terms.n, terms.n)
    keys = (keys - (keys * visible).sum(-1, keepdim=True) / count) * visible
    bias = (terms.bias - (terms.bias * visible).sum(-1, keepdim=True) / count) * visible
    return keys, bias


def _shape_problem(site: AttentionSite, values: dict, num_tokens: int) -> str | None:
    """None if the query, K and V before repeat, and the output are in the site's layout with
    ``T = num_tokens``."""
    rank = LAYOUT_RANK[site.layout]
    key = site.key_in_layout(values[site.key_source])
    for name, value in (("query", values[site.query]), ("key before repeat", key),
                        ("value before repeat", values[site.value_source]), ("output", values[site.output])):
        shape = value.shape
        if len(shape) != rank or shape[-2] != num_tokens or (site.layout == HEADS_FIRST and shape[0] != 1):
            return f"{name} has shape {tuple(shape)}, expected {site.layout} with T={num_tokens}"
    return None


def _repeat_problem(site: AttentionSite, values: dict) -> str | None:
    """None if K and V are their pre-repeat tensors with each KV head repeated ``num_rep`` times."""
    for name, seen, source in (("key", site.key, site.key_source), ("value", site.value, site.value_source)):
        if not torch.equal(values[seen], values[source].repeat_interleave(site.num_rep, dim=-3)):
            return (f"{name} is not the KV heads repeated {site.num_rep}x "
                    f"(query head h -> KV head h // {site.num_rep})")
    return None


def read_sinks(site: AttentionSite, values: dict) -> tuple[Tensor | None, str | None]:
    """``(sinks [num_heads], None)``: the site's sink logits on the sample, or ``(None, refusal)``
    if they are not one value per query head (whether they enter the softmax as sinks is what
    :func:`_check_output` proves)."""
    sinks = values[site.sinks]
    if not (isinstance(sinks, Tensor) and sinks.numel() == site.num_heads and sinks.is_floating_point()):
        shape = tuple(sinks.shape) if isinstance(sinks, Tensor) else type(sinks).__name__
        return None, f"attention sinks of shape {shape}, not one logit per query head ({site.num_heads})"
    return sinks.detach().reshape(site.num_heads).clone(), None


def _check_output(site: AttentionSite, values: dict, kind: str) -> str | None:
    """None if ``varlen_attention`` with the site's parameters reproduces the site's sampled output
    within the rule of :mod:`.numerics` (the site's own nodes in float64 as the exact result)."""
    q, k, v = site.tokens_first(values.__getitem__)
    cu = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
    params = site.params()
    with torch.no_grad():
        ours = torch.ops.pagedpack.varlen_attention(q, k, v, cu, **params.op_kwargs(), causal=kind == CAUSAL)
    theirs = to_tokens_first(values[site.output], site.layout)
    if ours.shape == theirs.shape and equal_to_floor(ours, theirs):
        return None
    excess = (excess_error(ours, theirs, to_tokens_first(site_float64(site, values), site.layout))
              if ours.shape == theirs.shape else f"of shape {tuple(ours.shape)}, not {tuple(theirs.shape)}")
    if excess:
        what = params.describe() or "no window, soft-cap or bias"
        return (f"the site's output is not {kind} attention with scale={params.scale:.6g} ({what}): the op's is "
                f"{excess} on the sample; the site computes something the match did not read")
    return None


def site_float64(site: AttentionSite, values: dict) -> Tensor:
    """The site's output computed by its own nodes (:meth:`AttentionSite.computation`) in float64,
    from the sampled ``values`` of its leaves."""
    leaves, inner = site.computation()
    graph, env = torch.fx.Graph(), {}
    for leaf in leaves:
        env[leaf] = graph.placeholder(leaf.name)
    for node in inner:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[site.output])
    module = float64_copy(torch.fx.GraphModule(torch.nn.Module(), graph))
    with torch.no_grad():
        return module(*float64_inputs([values[leaf] for leaf in leaves]))
