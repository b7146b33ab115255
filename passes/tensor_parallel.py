"""The ``tensor_parallel`` pass: one rank's shard of a rewritten step graph.

Megatron-LM's split, as vLLM and ``transformers`` apply it, driven by the model's own plan
(``transformers``' ``_tp_plan``: ``"colwise"`` / ``"rowwise"`` per linear module, e.g.
``model.layers.*.self_attn.q_proj: colwise``). Each ``aten.linear`` of the step graph whose weight
(or, after ``merge_linears``, each slice of a merged weight) belongs to a planned module becomes
rank ``r``'s part of it:

- colwise (Q, K, V, gate, up): rows of the output features. Query heads and MLP channels are cut in
  ``tp_size`` contiguous chunks; KV heads too when ``num_kv_heads >= tp_size``, and otherwise each
  rank holds the one KV head its query heads read, replicated ``tp_size / num_kv_heads`` times
  (vLLM's ``QKVParallelLinear``). A merged QKV / gate-up linear keeps one GEMM, its slices shrunk;
- rowwise (attention output, down): columns of the input features, then an out-of-place
  ``_c10d_functional.all_reduce(x, "sum", group_name)`` + ``wait_tensor`` (the collective form
  ``torch.compile`` and ``torch.export`` keep in graphs); a bias is added on rank 0 only;
- per-head attention inputs (``sinks``, ``alibi_slopes``) keep their rank's query heads;
- vocabulary-parallel, where the plan says so (``embedding_rowwise`` / ``colwise_gather_output``,
  vLLM's ``VocabParallelEmbedding`` / ``ParallelLMHead``): rank ``r`` holds rows
  ``[r * ceil(V / tp), (r + 1) * ceil(V / tp))`` of the embedding and LM-head weights (one slice when
  they are tied; the last padded with zeros). The embedding looks up the ids in its rows, zeroes the
  others and all-reduces; the LM head computes its columns of the logits, which
  ``_c10d_functional.all_gather_into_tensor`` joins on every rank (each samples the same logits).
  A weight also read by anything else stays whole;
- norms stay whole on every rank.

Rank ``r``'s KV caches hold its KV heads only (:func:`shard_specs`). Refused with the numbers, as a
``ValueError`` naming ``tensor_parallel_size``: a model without a plan, query heads or MLP channels
that do not divide, KV heads that neither divide nor are divided by ``tp_size``, Mixture-of-Experts
layers (their experts are not sharded), a planned weight in a form other than a linear's.

:func:`check_shards` runs every rank's graph on one sample in lockstep in this process (the
all-reduce sums the ranks' values) and compares the logits with the unsharded graph's by the
passes' rule (:mod:`pagedpack.passes.numerics`): a plan that does not fit the graph (a norm over
all heads between a colwise and a rowwise linear, a view with a hard-coded head count) is refused
there instead of giving wrong tokens.
"""
from __future__ import annotations

import copy
import dataclasses
import re
from dataclasses import dataclass

import torch
import torch.fx
from torch.fx import Node

from pagedpack.kernels.attention_params import op_arguments
from pagedpack.kernels.sparse_attention import sparse_attention_layers
from pagedpack.passes.graph_attrs import attr_tensor, linear_projections, vocab_size
from pagedpack.passes.numerics import equal_to_floor, excess_error, float64_copy, float64_inputs
from pagedpack.step.contract import METADATA_INPUTS, KVCacheSpec, StateSpec, state_layers
from pagedpack.step.metadata import example_metadata

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
_ops = torch.ops.pagedpack
_SHARDED_STYLES = ("colwise", "rowwise")
_REPLICATED_STYLES = ("colwise_gather_output", "embedding_rowwise", "replicated", "gather_output")
_SAMPLE_BLOCK_SIZE = 4
# the collectives a rank's graph holds; the first two name their process group
_NAMED_COLLECTIVES = (c10d.all_reduce.default, c10d.all_gather_into_tensor.default)
_COLLECTIVES = (*_NAMED_COLLECTIVES, c10d.wait_tensor.default)
# tp plan styles that split a weight by vocabulary rows, and the op that reads such a weight
_VOCAB_STYLES = {"embedding_rowwise": aten.embedding.default, "colwise_gather_output": aten.linear.default}
_WEIGHT_ARG = {aten.embedding.default: 0, aten.linear.default: 1}


@dataclass(frozen=True)
class HeadSplit:
    """How ``num_heads`` query heads and ``num_kv_heads`` KV heads of a layer split over ``tp_size``
    ranks (module docstring); ``ValueError`` with the numbers when they do not."""

    num_heads: int
    num_kv_heads: int
    tp_size: int

    def __post_init__(self):
        h, kv, tp = self.num_heads, self.num_kv_heads, self.tp_size
        if h % tp:
            raise ValueError(f"tensor_parallel_size: {h} query heads ({kv} KV heads) do not split over {tp} ranks; "
                             f"expected a size that divides {h}")
        if kv % tp and tp % kv:
            raise ValueError(f"tensor_parallel_size: {kv} KV heads neither split over {tp} ranks nor replicate "
                             f"evenly on them; expected a divisor or a multiple of {kv}")

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.tp_size)

    def query_heads(self, rank: int) -> range:
        per_rank = self.num_heads // self.tp_size
        return range(rank * per_rank, (rank + 1) * per_rank)

    def kv_heads(self, rank: int) -> range:
        """Rank ``rank``'s KV heads: the ones its query heads read (GQA groups stay whole)."""
        if self.num_kv_heads >= self.tp_size:
            return range(rank * self.local_kv_heads, (rank + 1) * self.local_kv_heads)
        first = rank // (self.tp_size // self.num_kv_heads)
        return range(first, first + 1)


def tp_plan(model: torch.nn.Module) -> dict[str, str]:
    """The ``transformers`` plan of ``model`` (module name pattern -> style); ``ValueError`` if none."""
    plan = getattr(model, "_tp_plan", None) or {}
    if not plan:
        raise ValueError(f"tensor_parallel_size: {type(model).__name__} has no tensor-parallel plan "
                         f"(transformers' base_model_tp_plan), so no split is known for its linears")
    return dict(plan)


def _module_styles(model: torch.nn.Module, plan: dict[str, str]):
    """``(name, style or None, weight or None)`` of each module of ``model`` under ``plan``."""
    patterns = [(re.compile(re.escape(p).replace(r"\*", r"[^.]+") + "$"), style) for p, style in plan.items()]
    for name, module in model.named_modules():
        yield name, next((s for pattern, s in patterns if pattern.match(name)), None), getattr(module, "weight", None)


def _planned_weights(model: torch.nn.Module, plan: dict[str, str]) -> dict[int, tuple[str, str]]:
    """``data_ptr`` of each planned module's weight -> (module name, style). A merged weight's rows
    are its originals' storage (``merge_linears``), so a slice finds its module by address."""
    found = {}
    for name, style, weight in _module_styles(model, plan):
        if style is None or style.startswith("embedding"):
            continue
        if "experts" in name:
            raise ValueError(f"tensor_parallel_size: {name} (tp plan {style!r}) is a Mixture-of-Experts layer, "
                             f"whose experts pagedpack does not shard; serve the model with tensor_parallel_size=1")
        if isinstance(weight, torch.Tensor):
            found[weight.data_ptr()] = (name, style)
    return found


@dataclass
class _Part:
    """One projection of a linear node: the node itself, or one slice of a merged linear."""

    node: Node
    start: int
    end: int
    name: str | None
    style: str | None


def _parts(gm: torch.fx.GraphModule, linear: Node, planned: dict) -> list[_Part]:
    return [_Part(node, start, end, *planned.get(address, (None, None)))
            for node, start, end, address in linear_projections(gm, linear)]


def _nearest_parts(start: Node, part_nodes: set[Node]) -> set[Node]:
    """The projection outputs ``start`` is computed from without passing through another projection."""
    seen, stack, found = set(), [start], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in part_nodes:
            found.add(node)
        else:
            stack.extend(node.all_input_nodes)
    return found


def _vocab_parallel_weights(model: torch.nn.Module, plan: dict[str, str]) -> set[int]:
    """``data_ptr`` of each weight every module of which the plan splits by vocabulary rows
    (:data:`_VOCAB_STYLES`: an embedding and the LM head tied to it qualify together)."""
    styles: dict[int, set] = {}
    for _, style, weight in _module_styles(model, plan):
        if isinstance(weight, torch.Tensor):
            styles.setdefault(weight.data_ptr(), set()).add(style)
    return {ptr for ptr, found in styles.items() if found <= set(_VOCAB_STYLES)}


def _vocab_parallel_uses(graph: torch.fx.Graph, attrs: dict, weights: set[int]) -> dict[str, list[Node]]:
    """Attribute name -> the embeddings and linears reading it as their weight, for each attribute
    of ``weights`` that nothing else reads."""
    uses: dict[str, list[Node]] = {}
    for node in graph.nodes:
        if node.op == "get_attr" and isinstance(attrs.get(node.target), torch.Tensor) \
                and attrs[node.target].data_ptr() in weights:
            uses.setdefault(node.target, []).extend(node.users)
    return {target: users for target, users in uses.items()
            if all(u.target in _VOCAB_STYLES.values() and u.args[_WEIGHT_ARG[u.target]].target == target
                   and u.args.count(u.args[_WEIGHT_ARG[u.target]]) == 1 for u in users)}


def _shard_vocab(graph: torch.fx.Graph, attrs: dict, uses: dict[str, list[Node]], *, tp_size: int, rank: int,
                 group_name: str) -> None:
    """Rank ``rank``'s rows of each vocabulary-parallel weight, and its embeddings and LM heads
    rewritten to use them (module docstring)."""
    for target, users in uses.items():
        weight = attrs[target]
        vocab = weight.shape[0]
        per_rank = -(-vocab // tp_size)
        attrs[target] = _padded_rows(weight, rank * per_rank, per_rank)
        for user in users:
            if user.target is aten.embedding.default:
                _embedding_in_rows(graph, user, rank * per_rank, per_rank, group_name)
            else:
                _gathered_logits(graph, user, attrs, rank * per_rank, per_rank, vocab, tp_size, group_name)


def _padded_rows(tensor: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """``tensor[start:start + rows]`` (a copy), zero rows appended past its end."""
    part = tensor[start:start + rows]
    pad = torch.zeros((rows - part.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    return torch.cat([part, pad]) if pad.shape[0] else part.clone()


def _embedding_in_rows(graph: torch.fx.Graph, node: Node, start: int, rows: int, group_name: str) -> None:
    """``embedding(weight, ids)`` on rows ``[start, start + rows)`` only, then summed over the ranks."""
    call = graph.call_function
    weight, ids = node.args[:2]
    with graph.inserting_before(node):  # the nodes a block creates stand in the order it creates them
        local = call(aten.sub.Scalar, (ids, start))
        inside = call(aten.bitwise_and.Tensor, (call(aten.ge.Scalar, (local, 0)), call(aten.lt.Scalar, (local, rows))))
        node.args = (weight, call(aten.mul.Tensor, (local, inside)))  # ids outside: row 0, zeroed below
        column = call(aten.unsqueeze.default, (inside, -1))
    with graph.inserting_before(node.next):
        masked = call(aten.mul.Tensor, (node, column))
    _reduce_after(graph, node, masked, group_name)


def _gathered_logits(graph: torch.fx.Graph, linear: Node, attrs: dict, start: int, rows: int, vocab: int,
                     tp_size: int, group_name: str) -> None:
    """The LM head ``linear`` on rows ``[start, start + rows)``, its logits gathered from every rank
    into the ``vocab`` columns of the unsharded one."""
    call = graph.call_function
    if len(linear.args) > 2 and linear.args[2] is not None:
        attrs[linear.args[2].target] = _padded_rows(attrs[linear.args[2].target], start, rows)
    with graph.inserting_before(linear.next):
        ranked = call(aten.unsqueeze.default, (linear, 0))
        gathered = call(c10d.all_gather_into_tensor.default, (ranked, tp_size, group_name))
        waited = call(c10d.wait_tensor.default, (gathered,))  # [tp, ..., rows]
        logits = call(aten.flatten.using_ints, (call(aten.movedim.int, (waited, 0, -2)), -2, -1))
        if rows * tp_size != vocab:
            logits = call(aten.slice.Tensor, (logits, -1, 0, vocab))
    linear.replace_all_uses_with(logits, delete_user_cb=lambda user: user is not ranked)
    if "val" in linear.meta:
        logits.meta["val"] = linear.meta["val"]


# The grouped GEMM of transformers' Mixture-of-Experts layers: aten's, or (5.25 on, whose tp plan no
# longer names the experts) transformers' own fallback op for it.
_GROUPED_GEMMS = ("aten::_grouped_mm", "transformers::grouped_mm_fallback")


def _refuse_experts(gm: torch.fx.GraphModule) -> None:
    """``ValueError`` naming the first Mixture-of-Experts layer of ``gm``, if it has one."""
    for node in gm.graph.nodes:
        if isinstance(node.target, torch._ops.OpOverload) and node.target.name() in _GROUPED_GEMMS:
            stack = list((node.meta.get("nn_module_stack") or {}).values())
            where = stack[-1][0].removeprefix("model.") if stack else "the model"
            raise ValueError(f"tensor_parallel_size: {where} is a Mixture-of-Experts layer (grouped GEMMs), whose "
                             f"experts pagedpack does not shard; serve the model with tensor_parallel_size=1")


def shard_specs(specs: list[KVCacheSpec], splits: list[HeadSplit]) -> list[KVCacheSpec]:
    """Each layer's KV cache spec on one rank: its local KV heads."""
    return [dataclasses.replace(spec, num_kv_heads=split.local_kv_heads) for spec, split in zip(specs, splits)]


def shard_step_graph(gm: torch.fx.GraphModule, specs: list[KVCacheSpec], model: torch.nn.Module, *,
                     tp_size: int, rank: int, group_name: str) -> tuple[torch.fx.GraphModule, list[KVCacheSpec]]:
    """Rank ``rank``'s step graph and KV cache specs (module docstring). ``gm`` (a rewritten step
    graph) is left as it is; the new module holds its unsharded tensors and slices (copies) of the
    sharded ones. ``model`` is the ``transformers`` model ``gm`` was captured from (for its plan).
    ``ValueError`` naming ``tensor_parallel_size`` if the model cannot be split so."""
    if not isinstance(tp_size, int) or tp_size < 1 or not 0 <= rank < tp_size:
        raise ValueError(f"tensor_parallel_size: expected an int >= 1 and a rank below it, got {tp_size}, rank {rank}")
    _refuse_experts(gm)
    plan = tp_plan(model)
    planned = _planned_weights(model, plan)
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    attrs = {n.target: attr_tensor(gm, n) for n in graph.nodes if n.op == "get_attr"}
    linears = [n for n in graph.nodes if n.target is aten.linear.default]
    parts = {n: _parts(gm, n, planned) for n in linears}
    part_nodes = {p.node: p for ps in parts.values() for p in ps}
    sites = _attention_sites(graph)
    splits, roles = [], {}
    for layer, (write, reads) in enumerate(sites):
        spec = specs[layer]
        keys, values = (_nearest_parts(op_arguments(write)[a], set(part_nodes)) for a in ("key", "value"))
        # each reader of the cache (its writer's layer, then the layers sharing it) shards its own query
        # heads; which KV heads a rank keeps depends on the KV heads and tp_size alone (HeadSplit.kv_heads)
        queries, read_splits = set(), []
        for read in reads:
            read_queries = _nearest_parts(op_arguments(read)["query"], set(part_nodes))
            q_rows = sum(part_nodes[q].end - part_nodes[q].start for q in read_queries)
            split = HeadSplit(q_rows // spec.key_head_size, spec.num_kv_heads, tp_size)
            # A projection that feeds queries and keys alike (GPT-NeoX's fused QKV, heads interleaved) is cut
            # in contiguous chunks like an MLP's; the sample check tells whether its layout allows that.
            roles.update({q: ("query", split, spec.key_head_size) for q in read_queries - keys - values})
            _shard_per_head_inputs(read, attrs, split.query_heads(rank))
            queries |= read_queries
            read_splits.append(split)
        split = read_splits[0]  # the writer's layer
        splits.append(split)
        roles.update({k: ("kv", split, spec.key_head_size) for k in keys - queries})
        roles.update({v: ("kv", split, spec.value_head_size) for v in values - queries})
    for linear in linears:
        _shard_linear(graph, linear, parts[linear], roles, attrs, tp_size=tp_size, rank=rank, group_name=group_name)
    if tp_size > 1:
        _shard_vocab(graph, attrs, _vocab_parallel_uses(graph, attrs, _vocab_parallel_weights(model, plan)),
                     tp_size=tp_size, rank=rank, group_name=group_name)
    graph.lint()
    return torch.fx.GraphModule(attrs, graph), shard_specs(specs, splits)


def _attention_sites(graph: torch.fx.Graph) -> list[tuple[Node, list[Node]]]:
    """``(reshape_and_cache, [paged_attention, ...])`` per cache, in cache-input order: its write, then
    its reads in graph order (the writer's layer first, then the layers sharing its cache)."""
    reads, writes = {}, {}
    for n in graph.nodes:
        if n.target is _ops.paged_attention.default:
            reads.setdefault(op_arguments(n)["key_cache"], []).append(n)
        elif n.target is _ops.reshape_and_cache.default:
            writes.setdefault(op_arguments(n)["key_cache"], []).append(n)
    caches = [n for n in graph.nodes if n.op == "placeholder" and n.target.startswith("key_cache_")]
    if any(c not in reads or len(writes.get(c, ())) != 1 for c in caches):
        raise ValueError("tensor_parallel_size: expected one reshape_and_cache and at least one paged_attention "
                         "per cache")
    return [(writes[c][0], reads[c]) for c in caches]


def _shard_per_head_inputs(read: Node, attrs: dict, heads: range) -> None:
    for name in ("alibi_slopes", "sinks"):
        arg = op_arguments(read).get(name)
        if arg is None:
            continue
        if arg.op != "get_attr":
            raise ValueError(f"tensor_parallel_size: {name} of {read.name} is computed in the graph, not a "
                             f"stored tensor pagedpack can split by head")
        attrs[arg.target] = attrs[arg.target][heads.start:heads.stop]


def _rows(part: _Part, roles: dict, tp_size: int, rank: int) -> range:
    """The output features of ``part`` rank ``rank`` computes (module docstring)."""
    size = part.end - part.start
    role = roles.get(part.node)
    if role is not None:
        kind, split, head_size = role
        heads = split.query_heads(rank) if kind == "query" else split.kv_heads(rank)
        return range(heads.start * head_size, heads.stop * head_size)
    if size % tp_size:
        raise ValueError(f"tensor_parallel_size: {part.name} has {size} output features, which do not split over "
                         f"{tp_size} ranks")
    chunk = size // tp_size
    return range(rank * chunk, (rank + 1) * chunk)


def _shard_linear(graph: torch.fx.Graph, linear: Node, parts: list[_Part], roles: dict, attrs: dict, *,
                  tp_size: int, rank: int, group_name: str) -> None:
    styles = {p.style for p in parts}
    if styles <= {None} or styles <= set(_REPLICATED_STYLES) | {None}:
        return
    if len(styles) > 1 or not styles <= set(_SHARDED_STYLES):
        shown = {p.name: p.style for p in parts}
        raise ValueError(f"tensor_parallel_size: expected linears planned 'colwise' or 'rowwise' (one GEMM, one "
                         f"style), got {shown}")
    weight_node, bias_node = linear.args[1], (linear.args[2] if len(linear.args) > 2 else None)
    weight = attrs[weight_node.target]
    bias = attrs[bias_node.target] if bias_node is not None else None
    if styles == {"colwise"}:
        rows = [_rows(p, roles, tp_size, rank) for p in parts]
        index = torch.tensor([p.start + r for p, rs in zip(parts, rows) for r in rs], dtype=torch.long)
        attrs[weight_node.target] = weight.index_select(0, index)
        if bias is not None:
            attrs[bias_node.target] = bias.index_select(0, index)
        start = 0
        for part, rs in zip(parts, rows):
            if part.node is not linear:
                part.node.args = (linear, part.node.args[1], start, start + len(rs))
            start += len(rs)
        return
    (part,) = parts
    columns = weight.shape[1]
    if columns % tp_size:
        raise ValueError(f"tensor_parallel_size: {part.name} has {columns} input features, which do not split over "
                         f"{tp_size} ranks")
    chunk = columns // tp_size
    attrs[weight_node.target] = weight[:, rank * chunk:(rank + 1) * chunk].clone()
    if bias is not None and rank:
        attrs[bias_node.target] = torch.zeros_like(bias)
    _reduce_after(graph, linear, linear, group_name)


def _reduce_after(graph: torch.fx.Graph, node: Node, partial: Node, group_name: str) -> None:
    """Give ``node``'s users the sum over the ranks of ``partial`` (``node`` or computed from it):
    ``_c10d_functional.all_reduce`` + ``wait_tensor``."""
    with graph.inserting_before(partial.next):
        reduced = graph.call_function(c10d.all_reduce.default, (partial, "sum", group_name))
        waited = graph.call_function(c10d.wait_tensor.default, (reduced,))
    node.replace_all_uses_with(waited, delete_user_cb=lambda user: user is not reduced and user is not partial)
    if "val" in node.meta:
        reduced.meta["val"] = waited.meta["val"] = node.meta["val"]


def count_all_reduces(gm: torch.fx.GraphModule) -> int:
    return sum(n.target is c10d.all_reduce.default for n in gm.graph.nodes)


def count_all_gathers(gm: torch.fx.GraphModule) -> int:
    return sum(n.target is c10d.all_gather_into_tensor.default for n in gm.graph.nodes)


def local_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with its collectives replaced by local ops of the same shapes (an all-reduce passes
    its input through; no collective: what the CPU lowering checks a rank's graph with); ``gm``
    itself when it has none."""
    if not any(n.target in _COLLECTIVES for n in gm.graph.nodes):
        return gm
    local = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    for node in [n for n in local.graph.nodes if n.target in _COLLECTIVES]:
        stand_in = node.args[0]
        if node.target is c10d.all_gather_into_tensor.default:  # the shape it gives: this rank's part tp times
            with local.graph.inserting_before(node):
                stand_in = local.graph.call_function(aten.cat.default, ([node.args[0]] * node.args[1],))
        node.replace_all_uses_with(stand_in)
        local.graph.erase_node(node)
    local.recompile()
    return local


def set_group_name(gm: torch.fx.GraphModule, group_name: str) -> int:
    """Point ``gm``'s collectives at the process group ``group_name`` (a loaded rank program names
    the group it was exported with); returns how many, ``gm`` recompiled."""
    named = [n for n in gm.graph.nodes if n.target in _NAMED_COLLECTIVES]
    for node in named:  # all_reduce(x, "sum", group), all_gather_into_tensor(x, size, group)
        node.args = (node.args[0], node.args[1], group_name)
    gm.recompile()
    return len(named)


def run_in_lockstep(graphs: list[torch.fx.GraphModule], inputs: list[tuple]) -> list:
    """Run the ranks' graphs (equal node lists, :func:`shard_step_graph` of one graph) side by
    side in this process: each ``all_reduce`` gives every rank the sum of the ranks' values, each
    ``all_gather_into_tensor`` their concatenation, as the process group would. Returns each
    rank's outputs."""
    interpreters = [torch.fx.Interpreter(gm) for gm in graphs]
    for interpreter, args in zip(interpreters, inputs):
        interpreter.env, interpreter.args_iter = {}, iter(args)
    outputs = [None] * len(graphs)
    for nodes in zip(*(gm.graph.nodes for gm in graphs)):
        if nodes[0].target in _NAMED_COLLECTIVES:
            parts = [i.env[n.args[0]] for i, n in zip(interpreters, nodes)]
            total = sum(parts) if nodes[0].target is c10d.all_reduce.default else torch.cat(parts)
            for i, n in zip(interpreters, nodes):
                i.env[n] = total.clone()
            continue
        for r, (interpreter, node) in enumerate(zip(interpreters, nodes)):
            value = interpreter.run_node(node)
            if node.op == "output":
                outputs[r] = value
            else:
                interpreter.env[node] = value
    return outputs


def check_no_recurrent_state(state_specs: list[StateSpec], tp_size) -> None:
    """``ValueError`` naming ``tensor_parallel_size`` and the layers if the step graph keeps recurrent
    state (``state_specs``): its layers are not split over ranks yet."""
    if state_specs:
        raise ValueError(f"tensor_parallel_size: the model's recurrent layers ({state_layers(state_specs)}) are not "
                         f"split over ranks yet; expected 1, got {tp_size}")


def check_no_sparse_attention(graph_module: torch.fx.GraphModule, tp_size) -> None:
    """``ValueError`` naming ``tensor_parallel_size`` and the layers if the step graph has sparse-attention
    (DSA) layers (:mod:`pagedpack.kernels.sparse_attention`): their indexer and attention are not split
    over ranks yet."""
    layers = sparse_attention_layers(graph_module.graph)
    if layers:
        raise ValueError(f"tensor_parallel_size: the model's sparse-attention (DSA) layers ({', '.join(layers)}) are "
                         f"not split over ranks yet; expected 1, got {tp_size}")


def check_shards(gm: torch.fx.GraphModule, specs: list[KVCacheSpec], model: torch.nn.Module, *, tp_size: int,
                 num_tokens: int = 7) -> None:
    """Shard ``gm`` for every rank and run one prefill of ``num_tokens`` random tokens in lockstep
    (:func:`run_in_lockstep`); ``ValueError`` naming ``tensor_parallel_size`` unless the logits are
    the unsharded graph's within the passes' rule (against a float64 run of ``gm``)."""
    ranks = [shard_step_graph(gm, specs, model, tp_size=tp_size, rank=r, group_name="check") for r in range(tp_size)]
    device = next(iter(gm.parameters())).device
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab_size(gm), (num_tokens,), generator=g).to(device)
    num_blocks = -(-num_tokens // _SAMPLE_BLOCK_SIZE)
    batch = example_metadata([num_tokens], block_size=_SAMPLE_BLOCK_SIZE, num_blocks=num_blocks, device=device)
    step = batch._replace(input_ids=tokens, logits_indices=torch.arange(num_tokens, device=device)).as_inputs()
    meta = tuple(step[name] for name in METADATA_INPUTS)

    def caches(layer_specs, dtype=None):
        return tuple(torch.zeros(shape, dtype=dtype or spec.dtype, device=device) for spec in layer_specs
                     for shape in spec.cache_shapes(num_blocks, _SAMPLE_BLOCK_SIZE))

    failure = f"tensor_parallel_size: the model's plan does not fit its step graph split over {tp_size} ranks"
    with torch.no_grad():
        own = gm(*meta, *caches(specs))
        try:
            sharded = run_in_lockstep([g for g, _ in ranks], [meta + caches(s) for _, s in ranks])[0]
        except Exception as err:  # e.g. a per-head norm weight the plan leaves whole
            raise ValueError(f"{failure}: the shards do not run ({type(err).__name__}: {str(err)[:200]})") from err
        if equal_to_floor(sharded, own):
            return
        exact = float64_copy(gm)(*float64_inputs(meta), *caches(specs, torch.float64))
    excess = excess_error(sharded, own, exact)
    if excess is not None:
        raise ValueError(f"{failure}: the logits are {excess}")
