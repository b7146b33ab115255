"""A stand-in for torch_npu's ACL graph API (``torch.npu.NPUGraph``, ``torch.npu.graph``) off an NPU.

What it keeps of the real thing (``torch_npu/npu/graphs.py``; torch_npu's docs for
``graph_task_group_begin`` / ``graph_task_update_begin``):

- **Capture records, replay re-runs.** Inside ``graph(g)`` every op the dispatcher sees is
  recorded with the tensors it read and wrote. ``g.replay()`` runs the recorded ops again on those
  same tensors, reading whatever they hold now and writing each result into the tensor the capture
  produced, as a replayed kernel reads and writes fixed device addresses. Inputs reach a captured
  graph only by being copied into the tensors it captured.
- **Host arguments are frozen.** A non-tensor argument (FIA's ``SymInt[]`` length lists) is
  copied at capture; replays use that copy, so a replay whose lengths changed computes with stale
  lengths, and gives the wrong answer, exactly as on an NPU.
- **``update`` refreshes them.** With ``auto_dispatch_capture=True`` the FIA calls are recorded
  as updatable task groups; ``g.update(cpu_update_input=[{name: value}, ...])`` replaces the
  named keyword arguments of each (one dict: every call; else one dict per call, in capture
  order), which torch_npu does by relaunching each call's task group on an update stream.
- **No device-to-host read inside a capture** (``aten._local_scalar_dense``: ``.item()``,
  ``.tolist()``): a captured stream cannot synchronise, so the stand-in raises where the capture
  would fail.

Unlike the real capture, the stand-in also runs the ops while capturing (it needs their outputs
to record them); a caller must still replay after capturing, as on an NPU, where nothing ran yet.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

# The ops torch_npu's auto-dispatch capture records as updatable (its IFA handlers), emulated.
UPDATABLE_OPS = ("npu_fused_infer_attention_score", "npu_fused_infer_attention_score_v2")


@dataclass
class _Record:
    func: torch._ops.OpOverload
    args: tuple
    kwargs: dict
    outputs: list  # the tensors the capture produced, flattened


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: NPUGraph):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError("NPUGraph capture: a device-to-host read (.item() / .tolist()) inside a capture; "
                               "read host values before capturing")
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # Containers are copied, tensors kept: a list the caller changes later does not reach the record.
        self.graph._records.append(_Record(func, tree_map(lambda x: x, args), tree_map(lambda x: x, kwargs),
                                           tree_flatten(out)[0]))
        return out


class NPUGraph:
    """``torch.npu.NPUGraph`` on the CPU (module docstring): ``replay``, ``update``, ``reset``."""

    def __init__(self):
        self._records: list[_Record] = []
        self.auto_dispatch_capture = False

    @property
    def updatable(self) -> list[_Record]:
        """The recorded calls ``update`` reaches, in capture order."""
        if not self.auto_dispatch_capture:
            return []
        return [r for r in self._records if r.func._schema.name.split("::")[-1] in UPDATABLE_OPS]

    def replay(self) -> None:
        for record in self._records:
            fresh = tree_flatten(record.func(*record.args, **record.kwargs))[0]
            for captured, value in zip(record.outputs, fresh):
                if isinstance(captured, torch.Tensor) and not _same_memory(captured, value):
                    captured.copy_(value)

    def update(self, cpu_update_input: list[dict]) -> None:
        """Replace keyword arguments of the updatable calls: one dict for all, or one per call."""
        if not self.auto_dispatch_capture:
            raise RuntimeError("NPUGraph.update: the graph was not captured with auto_dispatch_capture=True")
        records = self.updatable
        if len(cpu_update_input) == 1:
            cpu_update_input = list(cpu_update_input) * len(records)
        if len(cpu_update_input) != len(records):
            raise RuntimeError(f"NPUGraph.update: {len(records)} captured calls to update, got "
                               f"{len(cpu_update_input)} dicts in cpu_update_input")
        for record, values in zip(records, cpu_update_input):
            record.kwargs.update({k: v for k, v in values.items() if k in record.kwargs})

    def reset(self) -> None:
        self._records.clear()


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the replayed op returned (a view of) the captured tensor's memory: in-place and view
    ops, whose result needs no copy."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@contextlib.contextmanager
def graph(npu_graph: NPUGraph, *, auto_dispatch_capture: bool = False):
    """``torch.npu.graph(npu_graph, auto_dispatch_capture=...)``: record what runs inside into ``npu_graph``."""
    npu_graph.reset()
    npu_graph.auto_dispatch_capture = auto_dispatch_capture
    with _Recorder(npu_graph):
        yield npu_graph
