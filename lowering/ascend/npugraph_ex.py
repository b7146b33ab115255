"""pagedpack as a custom pass of TorchAir's ``npugraph_ex`` backend (ACL graphs through ``torch.compile``).

Usage (on an NPU; the tests run it on the op emulation and the stand-in backend of
:mod:`pagedpack.kernels.npugraph_ex_emulation`)::

    step = paged_step(model)                          # the pagedpack rewrite; refusals in step.report
    pre_pass = PagedpackPrePass(max_num_tokens=2048, max_num_seqs=256)
    compiled = torch.compile(step, backend="npugraph_ex", fullgraph=True,
                             options={"post_grad_custom_pre_pass": pre_pass})
    logits = compiled(*metadata, *caches, **step.host_lengths(metadata))   # [B, vocab]
    pre_pass.reports[-1]                              # the sites lowered, or why not

What npugraph_ex gives a custom pass (followed: Ascend/torchair @ fced8842, 2026-06-01,
``npugraph_ex/npugraph_ex/npu_fx_compiler.py`` ``_optimize_fx``, ``configs/npugraphex_config.py``,
``docs/zh/npugraph_ex/advanced/post_grad_custom_pass.md``): the option key is
``"post_grad_custom_pre_pass"`` (or ``"post_grad_custom_post_pass"``) of ``torch.compile(...,
backend="npugraph_ex", options=...)``, mapped onto ``CompilerConfig.post_grad_custom_pre_pass``;
the pass is called as ``pass_(gm, example_inputs, config)`` on the graph AOT autograd produced
(``aot_module_simplified(..., keep_inference_input_mutations=True)``: functional ATen ops, in-place
input writes as trailing ``copy_``), before npugraph_ex's own passes (``remove_noop_ops``,
``recover_view_inplace_pattern``, pattern fusion, ``view_to_reshape``); it edits ``gm`` in place
and its return value is ignored. ``example_inputs`` are fake tensors, ``config`` the
``CompilerConfig``. npugraph_ex's docs ask a pass to raise on what it cannot handle; this one
records a refusal instead (:class:`LoweringReport`) and leaves the graph as it was, so the user's
compile completes with the graph unlowered (the ``pagedpack`` ops then run as they are).

Why the rewrite runs before ``torch.compile`` and only the lowering in the pass: a post-grad pass
can edit the graph but not its signature. The compiled callable takes the inputs dynamo traced, so
the step metadata (``cu_seqlens_q``, ``positions``, ``block_table``, ``slot_mapping``, ``seq_lens``)
and the KV caches cannot be invented by the pass; the rewrite also checks every site on samples
of the single-sequence graph (sequence independence, :mod:`pagedpack.passes.pipeline`), which a
post-grad graph with lifted parameters and anonymous inputs does not allow. So :func:`paged_step`
runs the same rewrite (:func:`pagedpack.passes.pipeline.rewrite`) as every target and returns a
module whose forward takes the metadata and caches as tensors: dynamo lifts them as graph inputs,
and the pass lowers the ``pagedpack`` ops it finds to the Ascend ops with
:func:`pagedpack.lowering.ascend.lower.lower_to_ascend`, the lowering and limit checks of the
``ascend`` target.

FIA in an ACL graph takes its lengths as host lists (torch_npu's ``SymInt[]`` form: the tensor
form is TorchAir's GE-only ``air`` op); npugraph_ex refreshes them on every replay
(``_acl_concrete_graph/acl_graph.py``: ``updated_param_keys=["actual_seq_lengths",
"actual_seq_lengths_kv", ...]``). The forward takes them as two lists of ints, which it passes to a
marker op, ``torch.ops.pagedpack.step_host_lengths(cu_seqlens_q, actual_seq_lengths,
actual_seq_lengths_kv)`` (returns a copy of ``cu_seqlens_q``, which the step then reads, so no pass
removes it); the pass takes the lists from the marker's arguments (SymInt nodes or ints, as dynamo
traced them) and removes it.

Not run on an NPU (none was available): npugraph_ex's own compilation, capture and replay of the
lowered graph, and whether its ``recover_view_inplace_pattern`` turns the cache writes back in place.
"""
from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from pagedpack.lowering.ascend.limits import AscendLoweringError, AscendUnverifiedWarning
from pagedpack.lowering.ascend.lower import AscendOps, describe, host_lengths, lower_to_ascend, npu_ops
from pagedpack.lowering.targets import StepBounds
from pagedpack.models.capture import capture
from pagedpack.passes.pipeline import RewrittenModel, rewrite
from pagedpack.passes.report import PassReport
from pagedpack.step.contract import METADATA_INPUTS

# The torch_npu minor release whose op schemas the lowering was checked against (op-plugin's
# op_plugin_functions.yaml @ 517f2e7d, 2026-08-21, tests/test_ascend_schema.py); newer ones warn.
FOLLOWED_TORCH_NPU = (2, 14)
_CU = METADATA_INPUTS.index("cu_seqlens_q")


@torch.library.custom_op("pagedpack::step_host_lengths", mutates_args=())
def step_host_lengths(cu_seqlens_q: torch.Tensor, actual_seq_lengths: Sequence[int],
                      actual_seq_lengths_kv: Sequence[int]) -> torch.Tensor:
    """Marks FIA's host lists in the traced graph (module docstring): ``cu_seqlens_q`` int32
    ``[B+1]`` copied; ``actual_seq_lengths`` = ``cu_seqlens_q[1:]`` and ``actual_seq_lengths_kv`` =
    ``seq_lens`` as ints (:func:`pagedpack.lowering.ascend.lower.host_lengths`)."""
    return cu_seqlens_q.clone()


@step_host_lengths.register_fake
def _(cu_seqlens_q, actual_seq_lengths, actual_seq_lengths_kv):
    return torch.empty_like(cu_seqlens_q)


class PagedStep(torch.nn.Module):
    """One packed, paged step of a causal LM, as a module ``torch.compile`` can trace (:func:`paged_step`).

    ``forward(*inputs, actual_seq_lengths, actual_seq_lengths_kv)``: ``inputs`` are the step
    program's (:mod:`pagedpack.passes.pipeline`: the seven metadata tensors, then the KV caches
    ``[num_blocks, block_size, Hkv, D]``, written in place); the two int lists are
    :meth:`host_lengths` of the metadata. Returns logits ``[B, vocab]``.
    A model the rewrite refused (:attr:`report` says why) runs unrewritten: the model itself on
    the step's tokens as one sequence (``positions`` as its ``position_ids``) with no KV cache, so
    only a step of one sequence with no cached tokens is served (``ValueError`` for more sequences;
    a cached prefix is not detected).
    """

    def __init__(self, model: torch.nn.Module, rewritten: RewrittenModel):
        super().__init__()
        self.model, self.rewritten, self.rewritten_ok = model, rewritten, rewritten.ok
        if rewritten.ok:
            self.step_graph = rewritten.graph_module

    @property
    def report(self) -> PassReport:
        """The rewrite's report: every attention site, rewritten or why not."""
        return self.rewritten.report

    @staticmethod
    def host_lengths(metadata) -> dict[str, list[int]]:
        """The keyword arguments FIA's host lists come from, read off ``metadata`` (a
        :class:`~pagedpack.step.metadata.StepMetadata`), one device-to-host read each."""
        ends, kv_lens = host_lengths(metadata.cu_seqlens_q, metadata.seq_lens)
        return {"actual_seq_lengths": ends, "actual_seq_lengths_kv": kv_lens}

    def forward(self, *inputs: torch.Tensor, actual_seq_lengths: list[int], actual_seq_lengths_kv: list[int]):
        if not self.rewritten_ok:
            return self._unrewritten(inputs)
        cu = torch.ops.pagedpack.step_host_lengths(inputs[_CU], actual_seq_lengths, actual_seq_lengths_kv)
        return self.step_graph(*inputs[:_CU], cu, *inputs[_CU + 1:])

    def _unrewritten(self, inputs):
        input_ids, positions, cu_seqlens_q = inputs[:3]
        logits_indices = inputs[METADATA_INPUTS.index("logits_indices")]
        if cu_seqlens_q.shape[0] != 2:
            raise ValueError(f"this model was not rewritten ({self.report.refusal()}): it serves one sequence "
                             f"a step, got {cu_seqlens_q.shape[0] - 1}")
        logits = self.model(input_ids=input_ids[None], position_ids=positions[None]).logits
        return logits[0, logits_indices]


def paged_step(model: torch.nn.Module, *, example_num_tokens: int = 8) -> PagedStep:
    """Capture ``model`` (a ``transformers`` causal LM in eval mode) and rewrite it
    (:func:`pagedpack.passes.pipeline.rewrite`, the checks of every target). Never raises for a
    refused model: the step then runs it unrewritten and :attr:`PagedStep.report` says why;
    :func:`pagedpack.models.capture.capture`'s errors (a model that cannot be exported) propagate."""
    return PagedStep(model, rewrite(capture(model, example_num_tokens=example_num_tokens)))


@dataclass
class LoweringReport:
    """What :class:`PagedpackPrePass` did to one graph: the sites lowered (one line each) or why none."""

    sites: list[str] = field(default_factory=list)
    summary: str = ""  # :func:`pagedpack.lowering.ascend.lower.describe` of the lowering
    refusal: str | None = None

    @property
    def ok(self) -> bool:
        return self.refusal is None

    def format(self) -> str:
        if not self.ok:
            return f"npugraph_ex pre-pass: graph left unlowered: {self.refusal}"
        return "\n".join([self.summary, *self.sites])


class PagedpackPrePass:
    """npugraph_ex's ``post_grad_custom_pre_pass`` (or ``..._post_pass``): lowers the ``pagedpack``
    ops of a :class:`PagedStep` graph to the Ascend ops (module docstring).

    ``max_num_tokens`` / ``max_num_seqs`` bound every step (FIA's TND limits depend on them);
    ``ops``: the Ascend ops to emit, default torch_npu's (:func:`pagedpack.lowering.ascend.lower.npu_ops`,
    after :func:`check_torch_npu_version`); the tests pass the emulation. One
    :class:`LoweringReport` per graph is appended to :attr:`reports`. A refusal (no paged site, a
    site outside FIA's limits, a cache write it cannot lower) leaves the graph as it was.
    """

    def __init__(self, *, max_num_tokens: int, max_num_seqs: int, ops: AscendOps | None = None):
        self.bounds = StepBounds(max_num_tokens, max_num_seqs)
        self.ops = ops
        self.reports: list[LoweringReport] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs, config) -> None:
        report = LoweringReport()
        self.reports.append(report)
        markers = [n for n in gm.graph.nodes if n.target is torch.ops.pagedpack.step_host_lengths.default]
        sites = [n for n in gm.graph.nodes if n.target is torch.ops.pagedpack.paged_attention.default]
        if not sites or len(markers) != 1:
            report.refusal = (f"{len(sites)} paged attention site(s) and {len(markers)} host-length marker(s) in "
                              "the graph, expected sites and one marker: compile the module paged_step() returns")
            return
        marker = markers[0]
        saved, buffers = copy.deepcopy(gm.graph), set(gm._buffers)
        ops = self.ops or _npu_ops_checked()
        try:  # AOT calls its compiler under its fake mode: the mask buffer must be a real tensor
            with unset_fake_temporarily():
                shapes = lower_to_ascend(gm, example_inputs, ops=ops, bounds=self.bounds, eager=True,
                                         host_lengths=(list(marker.args[1]), list(marker.args[2])))
            left = _pagedpack_ops_left(gm)
            if left:  # e.g. a recurrent layer's ops, which this pass does not lower
                raise AscendLoweringError(f"no Ascend lowering here for {left}")
        except AscendLoweringError as err:
            gm.graph = saved
            for name in set(gm._buffers) - buffers:  # the mask, if a site was lowered before the refusal
                del gm._buffers[name]
            gm.recompile()
            report.refusal = str(err)
            return
        marker.replace_all_uses_with(marker.args[0])
        gm.graph.erase_node(marker)
        gm.recompile()
        report.summary = describe(shapes, ops, functional=True)
        report.sites = [f"site {i}: H={s.num_heads}/Hkv={s.num_kv_heads}, D={s.head_dim}, {s.dtype}, "
                        f"block_size={s.block_size}" + (f", window={s.sliding_window}" if s.sliding_window else "")
                        for i, s in enumerate(shapes)]


def _pagedpack_ops_left(gm: torch.fx.GraphModule) -> list[str]:
    """The ``pagedpack`` ops of ``gm`` other than the marker, called directly or auto-functionalised."""
    targets = (n.args[0] if n.target is torch.ops.higher_order.auto_functionalized_v2 else n.target
               for n in gm.graph.nodes if n.op == "call_function")
    return sorted({str(t) for t in targets if getattr(t, "namespace", None) == "pagedpack"
                   and t is not torch.ops.pagedpack.step_host_lengths.default})


def check_torch_npu_version(version: str) -> None:
    """Warn (:class:`AscendUnverifiedWarning`) for a torch_npu release newer than
    :data:`FOLLOWED_TORCH_NPU`; ``ValueError`` for a version string that is not ``major.minor...``."""
    try:
        key = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    except ValueError:
        raise ValueError(f"torch_npu version: expected 'major.minor[...]', got {version!r}") from None
    if key > FOLLOWED_TORCH_NPU:
        warnings.warn(f"npugraph_ex pre-pass: torch_npu {version} is newer than the op schemas checked "
                      f"({'.'.join(map(str, FOLLOWED_TORCH_NPU))}); op signatures may have changed",
                      AscendUnverifiedWarning, stacklevel=3)


def _npu_ops_checked() -> AscendOps:
    ops = npu_ops()  # imports torch_npu, checks CANN
    import torch_npu

    check_torch_npu_version(torch_npu.__version__)
    return ops
