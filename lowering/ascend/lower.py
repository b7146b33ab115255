"""The ``ascend`` lowering: ``pagedpack`` ops -> Ascend ops, in place on an FX graph.

Per attention site::

    reshape_and_cache(k [T, Hkv, D], v, key_cache, value_cache, slot_mapping)
      -> npu_scatter_nd_update_(key_cache.view(-1, Hkv, D), slot_mapping[:, None], k)   (same for v)
    out [T, H, D] = paged_attention(q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, scale)
      -> npu_fused_infer_attention_score(q [T, H, D], key_cache.view(-1, block_size, Hkv*D), (same for v),
             input_layout="TND", actual_seq_lengths=cu_seqlens_q[1:] (cumulative, the last = T),
             actual_seq_lengths_kv=seq_lens (per sequence, since the call is paged), block_table,
             block_size, num_heads=H, num_key_value_heads=Hkv, scale,
             sparse_mode=3 (causal, bottom-right), atten_mask=<compressed 2048x2048 mask>)[0]

One call serves prefill, decode, chunked prefill and mixed steps: sparse_mode 3 aligns each
sequence's causal mask bottom-right (row i sees keys j <= i + kv_len - q_len), which is the
reference op's rule. The limits this form must meet live in :mod:`pagedpack.lowering.ascend.limits`.

Attention parameters are read off each site by name
(:meth:`pagedpack.kernels.attention_params.AttentionParams.from_node`). A sliding window of ``w``
keys becomes the band ``sparse_mode=4`` with ``pre_tokens=w - 1, next_tokens=0``: the band keeps
keys ``[i + off - pre_tokens, i + off + next_tokens]``, ``off = kv_len - q_len``
(kernels/ascend_emulation.py, ``_visible``), i.e. ``kv_len - q_len + i - w + 1 .. kv_len - q_len + i``,
the reference op's window. The docs make pre_tokens/next_tokens and sparse_mode ineffective when
Q_S is 1 [_op_plugin_docs.py, npu_fused_infer_attention_score, parameters pre_tokens, next_tokens,
sparse_mode], and a step of decodes only is such a call, which would silently attend every key. So a
windowed site appends one dummy sequence of two query rows and no keys (zero query rows, KV length
0, a block-table row of zeros; it needs no block, so the blocknum rule holds), which keeps every
step on the band's branch; its two output rows are dropped. Windowed sites call FIA v2, as
vllm-ascend does for sliding windows (the same kernel, arguments renamed)::

    out = npu_fused_infer_attention_score_v2(pad(q, 2 rows), ..., actual_seq_qlen=[cu_seqlens_q[1:], T + 2],
              actual_seq_kvlen=[seq_lens, 0], block_table=pad(block_table, 1 row),
              sparse_mode=4, pre_tokens=w - 1, next_tokens=0)[0][:-2]

Attention sinks (gpt-oss: a logit per head in the softmax denominator) are FIA v2's
``learnable_sink`` (bfloat16 ``(Q_N,)``; TND, value head_dim <= 128 [_op_plugin_docs.py,
npu_fused_infer_attention_score_v2, learnable_sink constraints]); a site with sinks calls v2, with
the band if it is also windowed.

Logit soft-capping, ALiBi and attention chunks have no FIA equivalent: such a site is refused with an
:class:`~pagedpack.lowering.ascend.limits.AscendLoweringError` naming the parameter and the reason
(:func:`pagedpack.lowering.ascend.limits.parameter_violations`).

Caches keep the runtime's ``[num_blocks, block_size, Hkv, D]`` layout; FIA gets their
``(blocknum, blocksize, Hkv*D)`` view, a paged layout TND queries accept
[_op_plugin_docs.py, npu_fused_infer_attention_score, page attention].

Lengths are int64 tensors computed in the graph from the metadata inputs, the form TorchAir's
``torch.ops.air.npu_fused_infer_attention_score`` takes (torchair/ops/_npu_fused_infer_attention_score.py);
the air op runs only under TorchAir's max-autotune (GE) mode, so this is the form of compiled
graphs. A graph lowered with ``eager=True`` calls torch_npu's ``torch.ops.npu`` op instead, which
takes host int lists (``SymInt[]``): the graph takes them as its last two inputs
(:data:`HOST_LENGTH_INPUTS`), which the caller reads off the step's metadata once per step
(:func:`host_lengths`) and every site shares, as vllm-ascend passes its CPU-side lengths to its
eager attention. Lists that are inputs, not read in the graph, are also what a captured ACL graph
needs: no device-to-host read inside the capture, and a replay refreshes them by name
(``NPUGraph.update``). Which steps run which graph: :mod:`pagedpack.lowering.ascend.graphs`.

Cache writes use ``npu_scatter_nd_update_`` (rows by slot, in place, no ATB; TorchAir converts it to
an in-place ScatterNdUpdate and restores the in-place form after functionalisation,
torchair/patterns/_recover_view_inplace_pattern.py). Out-of-range indices are not supported
[_op_plugin_docs.py, npu_scatter_nd_update_], so the ascend target does not take slot ``-1``
(the runtime's batch builder never emits it).
"""
from __future__ import annotations

import importlib
import operator
import warnings
from dataclasses import dataclass

import torch
import torch.fx
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Node

import pagedpack.kernels.ops  # noqa: F401  (registers torch.ops.pagedpack.*)
from pagedpack.kernels.attention_params import PARAM_NAMES, AttentionParams, op_arguments
from pagedpack.lowering.ascend.limits import (
    WINDOW_DUMMY_ROWS,
    AscendLoweringError,
    AscendUnverifiedWarning,
    AttentionShape,
    check_supported,
)
from pagedpack.lowering.targets import StepBounds, TargetUnavailableError
from pagedpack.step.contract import METADATA_INPUTS
from pagedpack.step.metadata import example_metadata, example_state_inputs

aten = torch.ops.aten
COMPRESSED_MASK_SIZE = 2048
_MASK_BUFFER = "ascend_compressed_causal_mask"
# The eager form's last two inputs: FIA's host lists, ``cu_seqlens_q[1:]`` and ``seq_lens``
# (:func:`host_lengths`), read from the step's metadata once per step by the caller.
HOST_LENGTH_INPUTS = ("host_actual_seq_lengths", "host_actual_seq_lengths_kv")
_PAGEDPACK_OPS = (torch.ops.pagedpack.reshape_and_cache.default, torch.ops.pagedpack.paged_attention.default)


@dataclass(frozen=True)
class AscendOps:
    """The ops the lowering emits: the real ones (:func:`npu_ops`) or the emulation (:func:`emulated_ops`)."""

    fused_infer_attention_score: OpOverload  # tensor lengths: TorchAir's air op, for compiled graphs
    fused_infer_attention_score_eager: OpOverload  # host int lists: torch_npu's op, for eager steps
    fused_infer_attention_score_v2: OpOverload  # the same two forms of FIA v2 (windows, sinks)
    fused_infer_attention_score_v2_eager: OpOverload
    scatter_nd_update_: OpOverload
    scatter_nd_update: OpOverload  # its functional twin, for graphs that are already functional (post-grad)

    @property
    def namespaces(self) -> set[str]:
        return {op.namespace for op in (self.fused_infer_attention_score, self.fused_infer_attention_score_eager,
                                        self.fused_infer_attention_score_v2, self.fused_infer_attention_score_v2_eager,
                                        self.scatter_nd_update_, self.scatter_nd_update)}


class AscendUnavailableError(TargetUnavailableError):
    """torch_npu / TorchAir cannot be imported on this machine."""


def import_torchair():
    """Import torch_npu and return ``torchair`` (shipped inside torch_npu).

    Raises :class:`AscendUnavailableError` with what to install instead of the import's own
    traceback (without CANN, torch_npu fails deep inside its C++ extension loading).
    """
    try:
        import torch_npu  # noqa: F401  (registers the npu device and torch.ops.npu)
        import torchair
    except Exception as err:  # ImportError, or OSError/RuntimeError when CANN's libraries are missing
        raise AscendUnavailableError(
            f"the ascend target on an NPU needs torch_npu and TorchAir, and importing them failed "
            f"({type(err).__name__}: {err}). Is the CANN toolkit installed and its set_env.sh sourced? "
            "On an Ascend host: install CANN, then `pip install -e .[ascend]`. Without an NPU, "
            "LLM(target='ascend') runs the lowered graph on the op emulation."
        ) from None
    return torchair


MIN_CANN = "8.3.RC1"
# The newest major release the choices here follow: vllm-ascend v0.23 runs CANN 9.1.0 with torch 2.10 /
# torch_npu 2.10.0.post4; late-2025 releases ran CANN 8.3.RC2 - 8.5.0 with torch_npu 2.7.1 - 2.8.0.
FOLLOWED_CANN = "8.3.RC1 - 9.x"
NEWEST_CANN_MAJOR = 9


def cann_version_key(version: str) -> tuple[int, int, int, int]:
    """``"8.3.RC1"`` -> ``(8, 3, 0, 1)``, ``"8.3.0"`` -> ``(8, 3, 1, 0)``: release candidates
    sort before the release of the same minor version; a suffix after the third field (an
    ``.alpha002`` build tag) is ignored. ``ValueError`` for anything else."""
    parts = version.strip().split(".")
    try:
        major, minor, third = int(parts[0]), int(parts[1]), parts[2].upper()
        key = (major, minor, 0, int(third[2:])) if third.startswith("RC") else (major, minor, 1, int(third))
    except (IndexError, ValueError):
        raise ValueError(f"CANN version: expected a form like {MIN_CANN!r} or '8.5.0', got {version!r}") from None
    return key


def check_cann_version(version: str | None) -> None:
    """Refuse CANN older than :data:`MIN_CANN`; warn (:class:`AscendUnverifiedWarning`) for a major
    release past :data:`NEWEST_CANN_MAJOR` (the followed range is :data:`FOLLOWED_CANN`).

    Before 8.3.RC1 FIA rejects TND with a block table at run time ("When layout is TND, not support
    Page Attention", vllm-ascend issue #4373; vllm-ascend gated the path on ``torch.version.cann``),
    older builds reject head_dim 128 in TND (vllm-ascend #8045), and TorchAir's pass restoring the
    in-place cache update after functionalisation exists only from 8.3.RC1 (without it every layer
    copies its whole cache every step).
    Raises :class:`AscendUnavailableError` naming the version found and the one needed."""
    if version is None:
        raise AscendUnavailableError(f"the ascend target needs CANN >= {MIN_CANN}, and torch.version.cann is not set "
                                     "(torch_npu sets it from the installed toolkit): cannot tell which CANN runs")
    key = cann_version_key(version)
    if key < cann_version_key(MIN_CANN):
        raise AscendUnavailableError(
            f"the ascend target needs CANN >= {MIN_CANN} (TND with a block table: vllm-ascend #4373; in-place "
            f"cache writes through TorchAir), found CANN {version} (torch.version.cann); upgrade the toolkit")
    if key[0] > NEWEST_CANN_MAJOR:
        warnings.warn(f"ascend target: CANN {version} is newer than the releases this lowering follows "
                      f"({FOLLOWED_CANN}); op signatures may have changed", AscendUnverifiedWarning, stacklevel=2)


def npu_ops() -> AscendOps:
    """``torch.ops.air.npu_fused_infer_attention_score`` (compiled graphs), ``torch.ops.npu.
    npu_fused_infer_attention_score`` (eager steps) and ``torch.ops.npu.npu_scatter_nd_update_``,
    after :func:`check_cann_version` of the installed CANN."""
    import_torchair()
    check_cann_version(getattr(torch.version, "cann", None))
    # The air ops' library is defined by these (private) modules, which torchair.ops imports lazily.
    importlib.import_module("torchair.ops._npu_fused_infer_attention_score")
    importlib.import_module("torchair.ops._npu_fused_infer_attention_score_v2")
    return AscendOps(torch.ops.air.npu_fused_infer_attention_score.default,
                     torch.ops.npu.npu_fused_infer_attention_score.default,
                     torch.ops.air.npu_fused_infer_attention_score_v2.default,
                     torch.ops.npu.npu_fused_infer_attention_score_v2.default,
                     torch.ops.npu.npu_scatter_nd_update_.default,
                     torch.ops.npu.npu_scatter_nd_update.default)


def emulated_ops() -> AscendOps:
    """The same ops from :mod:`pagedpack.kernels.ascend_emulation` (any device, no CANN)."""
    importlib.import_module("pagedpack.kernels.ascend_emulation")
    return AscendOps(torch.ops.pagedpack_air.npu_fused_infer_attention_score.default,
                     torch.ops.pagedpack_npu.npu_fused_infer_attention_score.default,
                     torch.ops.pagedpack_air.npu_fused_infer_attention_score_v2.default,
                     torch.ops.pagedpack_npu.npu_fused_infer_attention_score_v2.default,
                     torch.ops.pagedpack_npu.npu_scatter_nd_update_.default,
                     torch.ops.pagedpack_npu.npu_scatter_nd_update.default)


def compressed_causal_mask(device: torch.device | str = "cpu") -> torch.Tensor:
    """The mask sparse_mode 2/3/4 take: ``[2048, 2048]`` bool, strictly upper triangular, True = masked."""
    return torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool, device=device).triu(1)


def lower_to_ascend(gm: torch.fx.GraphModule, example_inputs, *, ops: AscendOps,
                    bounds: StepBounds, eager: bool = False, host_lengths: tuple | None = None) -> list[AttentionShape]:
    """Replace every ``pagedpack`` op of ``gm`` as the module docstring shows; returns each site's shape.

    ``example_inputs`` are inputs ``gm`` accepts (real or fake; only their shapes and dtypes are
    used, to read each site's heads, head sizes, dtype and block size). ``eager``: for running
    ``gm`` eagerly or in a captured ACL graph, with torch_npu's FIA and the lengths as host lists
    passed after the caches (:data:`HOST_LENGTH_INPUTS`, :func:`host_lengths`); otherwise
    TorchAir's tensor-length form. ``host_lengths``: with ``eager``, the two lists already in the
    graph (``(actual_seq_lengths, actual_seq_lengths_kv)``, lists of SymInt nodes or ints) instead
    of new inputs: a post-grad graph cannot take new inputs (:mod:`pagedpack.lowering.ascend.npugraph_ex`).
    A functional graph (AOT autograd's, post-grad) writes the caches through
    ``auto_functionalized_v2(reshape_and_cache)``: those become :attr:`AscendOps.scatter_nd_update`
    and a view back, whose result the graph's own ``copy_`` writes to the cache input.
    Raises :class:`pagedpack.lowering.ascend.limits.AscendLoweringError` (a ``ValueError``) if a
    site breaks a documented limit; ``gm`` is then unchanged.
    """
    values = _fake_values(gm, example_inputs)
    sites, shapes = _site_shapes(gm, values)
    for shape in shapes:
        check_supported(shape, bounds)
    emit = _Emitter(gm, ops, values, eager, host_lengths)
    for node in list(gm.graph.nodes):
        if node.target is torch.ops.pagedpack.reshape_and_cache.default:
            emit.cache_write(node)
        elif _is_functional_cache_write(node):
            emit.functional_cache_write(node)
    for node, shape in zip(sites, shapes):
        emit.attention(node, shape)
    gm.graph.lint()
    gm.recompile()
    return shapes


def lower_rewritten(rewritten, *, block_size: int, ops: AscendOps, bounds: StepBounds,
                    device: torch.device | str = "cpu", eager: bool = False) -> list[AttentionShape]:
    """:func:`lower_to_ascend` on the step graph of :func:`pagedpack.passes.pipeline.rewrite`."""
    return lower_to_ascend(rewritten.graph_module, step_example_inputs(rewritten, block_size, device),
                           ops=ops, bounds=bounds, eager=eager)


def site_shapes(rewritten, *, block_size: int, device: torch.device | str = "cpu") -> list[AttentionShape]:
    """Each attention site's shape as FIA would see it, for caches of ``block_size`` (no change to the graph)."""
    values = _fake_values(rewritten.graph_module, step_example_inputs(rewritten, block_size, device))
    return _site_shapes(rewritten.graph_module, values)[1]


def _is_functional_cache_write(node: Node) -> bool:
    """``auto_functionalized_v2(pagedpack.reshape_and_cache, ...)``: the cache write after functionalisation."""
    return (node.target is torch.ops.higher_order.auto_functionalized_v2
            and node.args[0] is torch.ops.pagedpack.reshape_and_cache.default)


def _site_shapes(gm: torch.fx.GraphModule, values: dict[Node, object]) -> tuple[list[Node], list[AttentionShape]]:
    sites = [n for n in gm.graph.nodes if n.target is torch.ops.pagedpack.paged_attention.default]
    return sites, [_attention_shape(node, values) for node in sites]


def describe(shapes: list[AttentionShape], ops: AscendOps, functional: bool = False) -> str:
    """One line for the pass report: what was lowered, to which ops (``functional``: the cache
    writes of a functional graph, :attr:`AscendOps.scatter_nd_update`)."""
    kinds = sorted({f"H={s.num_heads}/Hkv={s.num_kv_heads}, D={s.head_dim}, block_size={s.block_size}" for s in shapes})
    windows = sorted({s.sliding_window for s in shapes if s.sliding_window is not None})
    band = f"; sparse_mode=4 band for sliding window(s) {windows}" if windows else ""
    v2 = sum(map(uses_fia_v2, shapes))
    v2 = f", {v2} through npu_fused_infer_attention_score_v2" if v2 else ""
    return (f"ascend lowering: {len(shapes)} site(s) -> npu_fused_infer_attention_score (TND, paged, sparse_mode=3"
            f"{band}{v2}) + {ops.scatter_nd_update if functional else ops.scatter_nd_update_} ({'; '.join(kinds)})")


def _fake_values(gm: torch.fx.GraphModule, example_inputs) -> dict[Node, object]:
    """The (fake) values of the pagedpack ops' arguments: those dynamo recorded if present
    (re-running would add guards to dynamo's shapes), else computed for ``example_inputs`` on fake
    tensors (no node meta is touched)."""
    wanted = [a for n in gm.graph.nodes if n.target in _PAGEDPACK_OPS for name, a in op_arguments(n).items()
              if isinstance(a, Node) and name not in PARAM_NAMES]  # the tensors the emitter reads
    recorded = {a: a.meta.get("example_value", a.meta.get("val")) for a in wanted}
    if all(v is not None for v in recorded.values()):
        return recorded
    interpreter = torch.fx.Interpreter(gm, garbage_collect_values=False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        interpreter.run(*example_inputs)
    return interpreter.env


def _attention_shape(node: Node, values: dict[Node, object]) -> AttentionShape:
    args = op_arguments(node)
    query, key_cache, value_cache = (values[args[name]] for name in ("query", "key_cache", "value_cache"))
    params = AttentionParams.from_node(node)
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    return AttentionShape(num_heads=int(query.shape[1]), num_kv_heads=int(num_kv_heads), head_dim=int(head_dim),
                          value_head_dim=int(value_cache.shape[3]), dtype=query.dtype, block_size=int(block_size),
                          sliding_window=params.sliding_window, logits_soft_cap=params.logits_soft_cap,
                          alibi=params.alibi_slopes is not None, sinks=params.sinks is not None,
                          attention_chunk_size=params.attention_chunk_size)


def step_example_inputs(rewritten, block_size: int, device) -> list[torch.Tensor]:
    """Inputs of ``rewritten``'s step graph for reading its sites' shapes: one sequence of two
    tokens, one-block caches and (a model with recurrent layers) one zeroed state slot."""
    inputs = example_metadata([2], block_size=block_size, num_blocks=1, device=device).as_inputs()
    caches = [torch.zeros(shape, dtype=spec.dtype, device=device)
              for spec in rewritten.kv_cache_specs for shape in spec.cache_shapes(1, block_size)]
    states = example_state_inputs(getattr(rewritten, "state_specs", ()), [0], device)
    return [inputs[name] for name in METADATA_INPUTS] + caches + states


def uses_fia_v2(shape: AttentionShape) -> bool:
    """Whether a site is lowered to FIA v2: sinks need its ``learnable_sink``, and sliding windows
    go through it as production does (vllm-ascend calls v2 for them)."""
    return shape.sinks or shape.sliding_window is not None


def kv_lengths_argument(shape: AttentionShape) -> str:
    """The name of the FIA argument holding a site's KV lengths (what an ACL graph's update sets)."""
    return "actual_seq_kvlen" if uses_fia_v2(shape) else "actual_seq_lengths_kv"


def host_lengths(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor) -> list[list[int]]:
    """The eager form's host lists: ``[cu_seqlens_q[1:], seq_lens]`` as Python ints (one
    device-to-host read each per step)."""
    return [cu_seqlens_q[1:].tolist(), seq_lens.tolist()]


class _Emitter:
    """Inserts the Ascend ops; what all sites share (int64 lengths, the mask) is built once."""

    def __init__(self, gm: torch.fx.GraphModule, ops: AscendOps, values: dict[Node, object], eager: bool,
                 host_lengths: tuple | None = None):
        self.gm, self.graph, self.ops, self.values, self.eager = gm, gm.graph, ops, values, eager
        self.host_lengths = host_lengths
        self.fia = ops.fused_infer_attention_score_eager if eager else ops.fused_infer_attention_score
        self.fia_v2 = ops.fused_infer_attention_score_v2_eager if eager else ops.fused_infer_attention_score_v2
        self._shared: dict[tuple, Node] = {}

    def _call(self, target, *args, **kwargs) -> Node:
        return self.graph.call_function(target, args, kwargs)

    def _once(self, key: tuple, build) -> Node:
        """``build()`` the first time ``key`` is asked for (inserted before the current site, which
        comes first in graph order, so the node dominates every later site)."""
        if key not in self._shared:
            self._shared[key] = build()
        return self._shared[key]

    def cache_write(self, node: Node) -> None:
        args = op_arguments(node)
        key, value, key_cache, value_cache, slot_mapping = (
            args[name] for name in ("key", "value", "key_cache", "value_cache", "slot_mapping"))
        with self.graph.inserting_before(node):
            index = self._call(aten.unsqueeze.default, slot_mapping, 1)  # [T, 1]
            for rows, cache in ((key, key_cache), (value, value_cache)):
                cache_val = self.values[cache]
                if self.values[rows].dtype != cache_val.dtype:  # the reference op casts to the cache dtype
                    rows = self._call(aten._to_copy.default, rows, dtype=cache_val.dtype)
                flat = self._call(aten.view.default, cache, [-1, *map(int, cache_val.shape[2:])])  # [slots, Hkv, D]
                self._call(self.ops.scatter_nd_update_, flat, index, rows)
        self.graph.erase_node(node)

    def functional_cache_write(self, node: Node) -> None:
        """``auto_functionalized_v2(reshape_and_cache, key, value, slot_mapping, _all_bases=[key_cache,
        value_cache], ...)`` -> per cache ``view(scatter_nd_update(cache.view(-1, Hkv, D), slots[:, None],
        rows), cache.shape)``, which replaces the node's updated-base outputs (``getitem(node, 1 + i)``).
        The caches must be whole bases (no view of one: ``AscendLoweringError`` otherwise)."""
        kwargs = node.kwargs
        views = sorted(k for k in kwargs if k.endswith(("_size", "_stride", "_storage_offset", "_slice_dim")))
        if views:
            raise AscendLoweringError(f"{node.name}: the caches written are views of the inputs ({views}); "
                                      "the lowering writes whole cache inputs only")
        bases = kwargs["_all_bases"]
        updated = {}
        with self.graph.inserting_before(node):
            index = self._call(aten.unsqueeze.default, kwargs["slot_mapping"], 1)  # [T, 1]
            for rows, name in ((kwargs["key"], "key_cache"), (kwargs["value"], "value_cache")):
                base_index = kwargs[f"_{name}_base_index"]
                base, base_val = bases[base_index], bases[base_index].meta["val"]
                if rows.meta["val"].dtype != base_val.dtype:  # the reference op casts to the cache dtype
                    rows = self._call(aten._to_copy.default, rows, dtype=base_val.dtype)
                flat = self._call(aten.view.default, base, [-1, *map(int, base_val.shape[2:])])
                written = self._call(self.ops.scatter_nd_update, flat, index, rows)
                updated[base_index] = self._call(aten.view.default, written, list(map(int, base_val.shape)))
                updated[base_index].meta["val"] = self.values[updated[base_index]] = base_val
        for user in list(node.users):  # getitem(node, 0) is the op's own (None) result
            user.replace_all_uses_with(updated[user.args[1] - 1])
            self.graph.erase_node(user)
        self.graph.erase_node(node)

    def attention(self, node: Node, shape: AttentionShape) -> None:
        args = op_arguments(node)
        params = AttentionParams.from_node(node)  # what FIA cannot compute was refused by check_supported
        query, cu_seqlens_q, seq_lens, block_table = (
            args[name] for name in ("query", "cu_seqlens_q", "seq_lens", "block_table"))
        window = params.sliding_window
        with self.graph.inserting_before(node):
            caches = [self._call(aten.view.default, c, [-1, shape.block_size, shape.num_kv_heads * d])
                      for c, d in ((args["key_cache"], shape.head_dim), (args["value_cache"], shape.value_head_dim))]
            ends, kv_lens = self._lengths(cu_seqlens_q, seq_lens, windowed=window is not None)
            mask = self._once(("mask",), lambda: self._mask(query))
            query = self._call(aten.contiguous.default, query)  # FIA takes no non-contiguous tensor
            band = dict(sparse_mode=3)
            if window is not None:  # the module docstring: a dummy sequence keeps the call off the Q_S == 1 branch
                query = self._call(aten.constant_pad_nd.default, query, [0, 0, 0, 0, 0, WINDOW_DUMMY_ROWS], 0.0)
                block_table = self._once(("block_table_dummy", block_table), lambda: self._call(
                    aten.constant_pad_nd.default, block_table, [0, 0, 0, 1], 0))
                band = dict(sparse_mode=4, pre_tokens=window - 1, next_tokens=0)
            common = dict(atten_mask=mask, block_table=block_table, input_layout="TND",
                          num_key_value_heads=shape.num_kv_heads, block_size=shape.block_size, **band)
            if uses_fia_v2(shape):  # the v2 doc's argument names
                if shape.sinks:  # FIA v2 takes them as bfloat16 (Q_N,)
                    common["learnable_sink"] = self._call(aten._to_copy.default, args["sinks"], dtype=torch.bfloat16)
                result = self._call(self.fia_v2, query, *caches, actual_seq_qlen=ends, actual_seq_kvlen=kv_lens,
                                    num_query_heads=shape.num_heads, softmax_scale=float(params.scale), **common)
            else:
                result = self._call(self.fia, query, *caches, actual_seq_lengths=ends, actual_seq_lengths_kv=kv_lens,
                                    num_heads=shape.num_heads, scale=float(params.scale), **common)
            out = self._call(operator.getitem, result, 0)
            if window is not None:
                out = self._call(aten.slice.Tensor, out, 0, 0, -WINDOW_DUMMY_ROWS)
        node.replace_all_uses_with(out)
        self.graph.erase_node(node)

    def _lengths(self, cu_seqlens_q: Node, seq_lens: Node, *, windowed: bool) -> tuple[Node, Node]:
        """FIA's ``(actual_seq_lengths, actual_seq_lengths_kv)``: int64 tensors computed from the
        metadata, or in the eager form the two host lists of :data:`HOST_LENGTH_INPUTS`; a windowed
        site's carry the dummy sequence (``T + 2`` rows, KV length 0)."""
        if self.eager:
            ends, kv_lens = self._once(("host",), lambda: self.host_lengths or self._host_inputs())
            if windowed:
                ends = self._once(("host_dummy_q",), lambda: self._call(operator.add, ends, [self._call(
                    operator.add, self._call(operator.getitem, ends, -1), WINDOW_DUMMY_ROWS)]))
                kv_lens = self._once(("host_dummy_kv",), lambda: self._call(operator.add, kv_lens, [0]))
            return ends, kv_lens
        ends = self._once(("cumulative_q",), lambda: self._call(
            aten.slice.Tensor, self._call(aten._to_copy.default, cu_seqlens_q, dtype=torch.int64), 0, 1))
        kv_lens = self._once(("kv_lens",), lambda: self._call(aten._to_copy.default, seq_lens, dtype=torch.int64))
        if windowed:
            ends = self._once(("cumulative_q_dummy",), lambda: self._call(aten.cat.default, [ends, self._call(
                aten.add.Tensor, self._call(aten.slice.Tensor, ends, 0, -1), WINDOW_DUMMY_ROWS)]))
            kv_lens = self._once(("kv_lens_dummy",), lambda: self._call(aten.constant_pad_nd.default, kv_lens,
                                                                        [0, 1], 0))
        return ends, kv_lens

    def _host_inputs(self) -> tuple[Node, Node]:
        """The two host-list inputs, appended after the graph's last input."""
        last = [n for n in self.graph.nodes if n.op == "placeholder"][-1]
        with self.graph.inserting_after(last):
            kv_lens = self.graph.placeholder(HOST_LENGTH_INPUTS[1])
        with self.graph.inserting_after(last):
            ends = self.graph.placeholder(HOST_LENGTH_INPUTS[0])
        return ends, kv_lens

    def _mask(self, query: Node) -> Node:
        """The compressed mask as a buffer of ``gm`` on the query's device."""
        name = _MASK_BUFFER
        while hasattr(self.gm, name):
            name += "_"
        self.gm.register_buffer(name, compressed_causal_mask(self.values[query].device))
        return self.graph.get_attr(name)
