"""Decode step time per decoder layer of a hybrid: recurrent layers against attention layers.

W1's model as a hybrid (``--workload w1-hybrid``, ``common.w1_hybrid_model``: three gated DeltaNet
layers to one attention layer) or any ``--model`` directory is served by ``LLM``; ``--num-seqs``
requests of ``--prompt-len`` tokens are prefilled, then ``--steps`` decode steps of all of them run
through ``LLMEngine.step``. The CPU step program (a ``torch.fx.GraphModule``) gets a
clock reading (``time.perf_counter_ns``, under a microsecond each) before the first node of each
decoder layer and before the model's final part, so a layer's time is everything its nodes run
(norms, projections, the attention or recurrent op, the MLP) at the step's batch. Nodes are given the
layer of the latest ``layers.N`` in their ``nn_module_stack``; nodes without one (the paged ops the
pass inserted) stay in the layer they sit in.

Prints one JSON object: the median over steps of each layer's time (ms), the mean per layer type
(``config.layer_types``, e.g. ``linear_attention`` / ``full_attention``), the step time, the host and
the 1-minute load. Run: ``python benchmarks/layer_times.py [--dtype bfloat16] [--context-len 512]``.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import torch

from pagedpack import LLM, SamplingParams

from common import cpu_model, load_1min, w1_workload

REPO = Path(__file__).resolve().parents[1]
LAYER = re.compile(r"layers\.(\d+)(?:\.|$)")
MLP = re.compile(r"layers\.\d+\.(post_attention_layernorm|pre_feedforward_layernorm|mlp|feed_forward|"
                 r"block_sparse_moe)(?:\.|$)")


def _part_of(node: torch.fx.Node) -> tuple[int, str] | None:
    """``(layer index, "mixer" or "mlp")`` of the innermost ``layers.N`` module in ``node``'s
    ``nn_module_stack``; None outside the layers."""
    paths = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
    layers = [(int(m.group(1)), path) for path in paths if (m := LAYER.search(path))]
    if not layers:
        return None
    layer, path = layers[-1]
    return layer, "mlp" if MLP.search(path) else "mixer"


def instrument(gm: torch.fx.GraphModule, clock: list[tuple[object, int]], num_layers: int) -> None:
    """Insert a call appending ``(part, time.perf_counter_ns())`` to ``clock`` where each part
    starts: a layer's mixer (attention or recurrent block, with its norm), the layer's MLP, the model's
    final part (``"head"``: the first node of a module after the last node of a layer) and the output
    (``"end"``). Nodes outside any module (the ops the pass inserted), and nodes of an earlier part
    placed later, stay in the part they sit in."""
    def mark(part) -> None:
        clock.append((part, time.perf_counter_ns()))

    def order(part) -> tuple[int, int]:
        return (num_layers, 0) if part == "head" else (part[0], part[1] == "mlp")

    nodes = list(gm.graph.nodes)
    parts = [_part_of(node) for node in nodes]
    last = max(i for i, part in enumerate(parts) if part is not None)
    current = (-1, "mlp")
    for i, (node, part) in enumerate(zip(nodes, parts)):
        if i > last and node.meta.get("nn_module_stack"):
            part = "head"
        if part is not None and order(part) > order(current):  # parts only go forward
            current = part
            with gm.graph.inserting_before(node):
                gm.graph.call_function(mark, (part,))
        if node.op == "output":
            with gm.graph.inserting_before(node):
                gm.graph.call_function(mark, ("end",))
    gm.recompile()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workload", choices=("w1-hybrid",), default="w1-hybrid")
    parser.add_argument("--model", default=None, help="a Hugging Face directory of a hybrid instead of W1's")
    parser.add_argument("--bench-dir", type=Path, default=REPO.parent / "shared" / "bench")
    parser.add_argument("--w1-dir", type=Path, default=None)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--context-len", type=int, default=128, help="prompt tokens of each sequence")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    load = load_1min()
    model = args.model or w1_workload(args)[0]

    llm = LLM(model, dtype=args.dtype, enable_prefix_caching=False)
    gm = llm.program.run
    if not isinstance(gm, torch.fx.GraphModule):
        raise SystemExit(f"--model: the step program is a {type(gm).__name__}, not an fx.GraphModule to time")
    clock: list[tuple[object, int]] = []
    types = getattr(llm.model.config, "layer_types", None) or ["layer"] * llm.model.config.num_hidden_layers
    instrument(gm, clock, len(types))

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 4, ignore_eos=True)
    for i in range(args.num_seqs):
        engine.add_request(f"r{i}", [1 + (i * 7 + j) % 200 for j in range(args.context_len)], params)
    scheduler = engine.scheduler
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in [*scheduler.running, *scheduler.waiting]):
        engine.step()

    per_part: dict[object, list[float]] = {}
    steps = []
    for _ in range(args.steps):
        clock.clear()
        start = time.perf_counter_ns()
        engine.step()
        steps.append((time.perf_counter_ns() - start) / 1e6)
        for (part, t0), (_, t1) in zip(clock, clock[1:]):
            per_part.setdefault(part, []).append((t1 - t0) / 1e6)

    def ms(part) -> float:
        return round(statistics.median(per_part.get(part, [0.0])), 3)

    layers = [{"layer": i, "type": kind, "mixer_ms": ms((i, "mixer")), "mlp_ms": ms((i, "mlp"))}
              for i, kind in enumerate(types)]
    by_type = {kind: {key: round(statistics.mean(row[key] for row in layers if row["type"] == kind), 3)
                      for key in ("mixer_ms", "mlp_ms")} for kind in dict.fromkeys(types)}
    print(json.dumps({
        "model": model, "dtype": args.dtype, "num_seqs": args.num_seqs, "context_len": args.context_len,
        "steps": args.steps, "step_ms": round(statistics.median(steps), 3), "per_layer_type": by_type,
        "layers": layers, "final_norm_and_lm_head_ms": ms("head"),
        "threads": torch.get_num_threads(), "host": cpu_model(), "load_1min": load,
    }, indent=1))

if __name__ == "__main__":
    main()
