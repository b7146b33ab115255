"""Request life cycle and the Scheduler: directed cases and hypothesis-driven invariants.

The scheduler is driven by ``PagedEchoModel``, a fake model with a real paged cache: it writes
each step's token ids through ``slot_mapping`` and reads every sequence's history back through
``block_table``, so a wrong block assignment, a lost block or a bad recompute shows up as a
wrong history. Its next token is a function of the request's own history only, so every
request's stream must equal the stream of the same request run alone.
"""
from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedpack.runtime.batch import build_batch
from pagedpack.runtime.kv_cache_manager import KVCacheManager
from pagedpack.runtime.request import Request, RequestStatus
from pagedpack.runtime.sampling import SamplingParams
from pagedpack.runtime.scheduler import Scheduler, SchedulerOutput

VOCAB = 17
EOS = 0


def next_token(history: list[int]) -> int:
    """The fake model's token: a function of the sequence's own history only."""
    return (sum((i + 1) * t for i, t in enumerate(history[-4:])) + 3 * len(history)) % VOCAB


def solo_stream(prompt: list[int], params: SamplingParams, eos: int | None,
                max_model_len: int) -> tuple[list[int], str]:
    """Output tokens and finish reason of a request run alone, straight from the stop rules."""
    history, out = list(prompt), []
    while True:
        tok = next_token(history)
        history.append(tok)
        out.append(tok)
        if (tok == eos and not params.ignore_eos) or tok in params.stop_token_ids:
            return out, "stop"
        if len(out) >= params.max_tokens or len(history) >= max_model_len:
            return out, "length"


class PagedEchoModel:
    """Stores token ids in a paged cache and samples ``next_token`` of the history it reads back.

    It makes the step's block copies first, and checks every write into a block that other running
    requests hold: it must be the token each of them has at that position (a shared block is
    written once, with the contents its hash names, in the step that fills it)."""

    def __init__(self, num_blocks: int, block_size: int, scheduler: Scheduler | None = None) -> None:
        self.num_blocks, self.block_size, self.scheduler = num_blocks, block_size, scheduler
        self.cache = [-1] * (num_blocks * block_size)

    def __call__(self, output: SchedulerOutput) -> dict[str, int]:
        bs = self.block_size
        for src, dst in output.blocks_to_copy:
            self.cache[dst * bs:(dst + 1) * bs] = self.cache[src * bs:(src + 1) * bs]
        md = build_batch(output.scheduled, block_size=bs, num_blocks=self.num_blocks)
        holders = collections.defaultdict(list)  # block -> (request, its index in the request's blocks)
        for r in self.scheduler.running if self.scheduler is not None else []:
            for j, b in enumerate(r.block_ids):
                holders[b].append((r, j))
        for slot, tok in zip(md.slot_mapping.tolist(), md.input_ids.tolist()):
            for r, j in holders[slot // bs]:
                position = j * bs + slot % bs
                assert position < r.num_tokens and r.all_token_ids[position] == tok, \
                    f"a step writes token {tok} into block {slot // bs}, held by {r.request_id!r} with other contents"
            self.cache[slot] = tok
        sampled = {}
        for s, row, seq_len in zip(output.scheduled, md.block_table.tolist(), md.seq_lens.tolist()):
            history = [self.cache[row[p // bs] * bs + p % bs] for p in range(seq_len)]
            assert history == s.request.all_token_ids[:seq_len], "KV read back is not the request's own"
            for r in s.sample_requests:  # the request, and parallel samples forked off it
                sampled[r.request_id] = next_token(history)
        return sampled


def make_request(request_id: str, num_prompt: int, eos: int | None = None, first: int = 1, **params) -> Request:
    prompt = [(first + i) % VOCAB or 1 for i in range(num_prompt)]
    return Request(request_id, prompt, SamplingParams(**params), eos_token_id=eos)


def make_scheduler(num_blocks=64, block_size=4, enable_prefix_caching=True,
                   **limits) -> tuple[Scheduler, PagedEchoModel]:
    limits = {"max_num_batched_tokens": 32, "max_num_seqs": 8, "max_model_len": 128} | limits
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
    scheduler = Scheduler(kv, **limits)
    return scheduler, PagedEchoModel(num_blocks, block_size, scheduler)


def step(scheduler: Scheduler, model: PagedEchoModel) -> tuple[SchedulerOutput, list[Request]]:
    output = scheduler.schedule()
    return output, scheduler.update_from_output(output, model(output))


def run_all(scheduler: Scheduler, model: PagedEchoModel) -> None:
    for _ in range(10_000):
        if not scheduler.has_unfinished():
            return
        step(scheduler, model)
    raise AssertionError("scheduler did not finish")


def expect_solo(req: Request, max_model_len: int) -> None:
    tokens, reason = solo_stream(req.prompt_token_ids, req.sampling_params, req.eos_token_id, max_model_len)
    assert (req.output_token_ids, req.finish_reason) == (tokens, reason), req


# --- Request ---------------------------------------------------------------------------------


def test_request_starts_waiting_with_its_prompt():
    req = Request("a", [5, 6, 7], SamplingParams())
    assert req.status is RequestStatus.WAITING and not req.is_finished
    assert (req.all_token_ids, req.num_tokens, req.num_prompt_tokens, req.num_output_tokens) == ([5, 6, 7], 3, 3, 0)
    assert (req.num_computed_tokens, req.block_ids, req.generator, req.num_preemptions) == (0, [], None, 0)
    assert req.finish_reason is None and req.error is None


@pytest.mark.parametrize(
    "params, eos, tokens, reason",
    [
        (dict(max_tokens=10), 9, [3, 4, 9], "stop"),
        (dict(max_tokens=5, ignore_eos=True), 9, [3, 9, 9, 9, 9], "length"),
        (dict(max_tokens=10, stop_token_ids=[4]), None, [3, 4], "stop"),
        (dict(max_tokens=3), None, [3, 4, 5], "length"),
        (dict(max_tokens=100), None, [3, 4, 5, 6, 7], "length"),  # max_model_len = 8, prompt 3
        (dict(max_tokens=1), 3, [3], "stop"),  # EOS on the last allowed token is a stop
    ],
)
def test_append_output_stop_conditions(params, eos, tokens, reason):
    req = Request("a", [1, 2, 3], SamplingParams(**params), eos_token_id=eos)
    finished = [req.append_output(t, max_model_len=8) for t in tokens]
    assert finished == [False] * (len(tokens) - 1) + [True]
    assert req.output_token_ids == tokens and req.all_token_ids == [1, 2, 3] + tokens
    assert req.finish_reason == reason
    assert req.status is (RequestStatus.FINISHED_STOPPED if reason == "stop" else RequestStatus.FINISHED_LENGTH)
    with pytest.raises(RuntimeError, match="already finished"):
        req.append_output(1, max_model_len=8)


def test_fail_and_is_finished_forms():
    req = Request("a", [1], SamplingParams())
    req.fail("bad prompt")
    assert (req.status, req.finish_reason, req.error) == (RequestStatus.FINISHED_ERROR, "error", "bad prompt")
    assert req.is_finished and RequestStatus.is_finished(req.status) and req.status.is_finished()
    assert not RequestStatus.RUNNING.is_finished()


# --- check_request ---------------------------------------------------------------------------


def test_check_request_errors_and_bad_requests_are_not_queued():
    scheduler, _ = make_scheduler(num_blocks=4, block_size=4, max_model_len=20)
    cases = [
        (make_request("empty", 0), r"'empty': the prompt is empty"),
        (make_request("long", 21), r"prompt has 21 tokens, more than max_model_len=20"),
        (
            make_request("big", 10, max_tokens=7),
            r"up to 17 tokens need 5 KV blocks of block_size=4, more than the whole pool of num_blocks=4",
        ),
    ]
    for req, message in cases:
        with pytest.raises(ValueError, match=message):
            scheduler.add_request(req)
    assert scheduler.num_waiting == 0 and not scheduler.has_unfinished()
    fits = make_request("fits", 10, max_tokens=6)  # 16 tokens = 4 blocks
    scheduler.add_request(fits)
    assert scheduler.num_waiting == 1
    # Counted up to max_model_len only: 20 tokens = 5 blocks, whatever max_tokens says.
    capped = make_scheduler(num_blocks=5, block_size=4, max_model_len=20)[0]
    capped.check_request(make_request("capped", 20, max_tokens=100))


# --- directed scheduling cases ---------------------------------------------------------------


def test_continuous_batching_new_request_joins_running_decodes():
    scheduler, model = make_scheduler()
    a = make_request("a", 5, max_tokens=6)
    scheduler.add_request(a)
    out, _ = step(scheduler, model)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 5)]
    step(scheduler, model)
    b = make_request("b", 7, first=4, max_tokens=3)
    scheduler.add_request(b)
    out, _ = step(scheduler, model)
    # a decodes one token and b's whole prompt is prefilled in the same step.
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 7)]
    assert all(s.needs_sample for s in out.scheduled) and out.num_batched_tokens == 8
    run_all(scheduler, model)
    for req in (a, b):
        expect_solo(req, 128)
    assert scheduler.kv_cache_manager.num_used_blocks == 0


def test_chunked_prefill_of_prompt_longer_than_budget():
    scheduler, model = make_scheduler(max_num_batched_tokens=4)
    d = make_request("d", 2, max_tokens=20)
    scheduler.add_request(d)
    step(scheduler, model)  # d is now decoding
    p = make_request("p", 10, first=5, max_tokens=2)
    scheduler.add_request(p)
    chunks = []
    while not p.is_finished:
        out, _ = step(scheduler, model)
        chunks.append([(s.request.request_id, s.num_new_tokens) for s in out.scheduled])
    # The decode goes first each step; the prompt gets the rest of the budget: 3 + 3 + 3 + 1.
    assert chunks == [
        [("d", 1), ("p", 3)],
        [("d", 1), ("p", 3)],
        [("d", 1), ("p", 3)],
        [("d", 1), ("p", 1)],  # last chunk: samples p's first token
        [("d", 1), ("p", 1)],  # p decodes its second token and finishes
    ]
    assert p.output_token_ids and p.num_output_tokens == 2
    run_all(scheduler, model)
    expect_solo(p, 128)
    expect_solo(d, 128)


def test_needs_sample_only_on_the_last_chunk():
    scheduler, model = make_scheduler(max_num_batched_tokens=4)
    p = make_request("p", 9, max_tokens=1)
    scheduler.add_request(p)
    flags = []
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        assert p.num_computed_tokens == sum(n for n, _ in flags)  # not advanced by schedule()
        flags.append((out.scheduled[0].num_new_tokens, out.scheduled[0].needs_sample))
        scheduler.update_from_output(out, model(out))
    assert flags == [(4, False), (4, False), (1, True)]
    assert p.finish_reason == "length" and p.num_output_tokens == 1


def test_preemption_evicts_latest_and_recomputes():
    # 4 blocks of 2: a and b take 2 blocks each for their prompts; the first to need a third
    # block forces the latest arrived (b) out.
    scheduler, model = make_scheduler(num_blocks=4, block_size=2)
    a = make_request("a", 3, max_tokens=5)
    b = make_request("b", 3, first=7, max_tokens=5)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out, _ = step(scheduler, model)
    assert [s.num_new_tokens for s in out.scheduled] == [3, 3] and scheduler.kv_cache_manager.num_free_blocks == 0

    out, _ = step(scheduler, model)  # both decode position 3: still inside their second blocks
    assert out.preempted == []
    out = scheduler.schedule()  # a needs a block for position 4
    assert out.preempted == [b] and [s.request for s in out.scheduled] == [a]
    assert (b.status, b.block_ids, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.WAITING, [], 0, 1)
    assert list(scheduler.waiting) == [b] and scheduler.running == [a]
    assert b.num_output_tokens == 2  # kept: recomputed as part of the prompt on re-admission
    scheduler.update_from_output(out, model(out))

    run_all(scheduler, model)
    for req in (a, b):
        expect_solo(req, 128)


def test_last_running_request_preempts_itself():
    # 4 blocks of 2. After the prefills, a decodes position 3 (inside its 2nd block) while b,
    # the last running request, needs a 3rd block for position 4: b evicts itself.
    scheduler, model = make_scheduler(num_blocks=4, block_size=2)
    a = make_request("a", 3, max_tokens=4)
    b = make_request("b", 4, first=3, max_tokens=4)
    for req in (a, b):
        scheduler.add_request(req)
    step(scheduler, model)
    out = scheduler.schedule()
    assert out.preempted == [b] and [s.request for s in out.scheduled] == [a]
    assert scheduler.running == [a] and list(scheduler.waiting) == [b]
    scheduler.update_from_output(out, model(out))
    run_all(scheduler, model)
    expect_solo(a, 128)
    expect_solo(b, 128)


def test_waiting_queue_is_fifo_without_skipping():
    scheduler, model = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    hog = make_request("hog", 16, max_tokens=8)  # 4 blocks now, 6 at most
    scheduler.add_request(hog)
    step(scheduler, model)
    big = make_request("big", 12, first=7, max_tokens=1)  # needs 3 blocks, only 2 free (no cached prefix)
    small = make_request("small", 2, first=3, max_tokens=1)  # would fit
    scheduler.add_request(big)
    scheduler.add_request(small)
    out = scheduler.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["hog"]
    assert list(scheduler.waiting) == [big, small]
    scheduler.update_from_output(out, model(out))
    run_all(scheduler, model)
    for req in (hog, big, small):
        expect_solo(req, 128)


def test_max_num_seqs_caps_running():
    scheduler, model = make_scheduler(max_num_seqs=2)
    reqs = [make_request(str(i), 3, first=i, max_tokens=4) for i in range(4)]
    for req in reqs:
        scheduler.add_request(req)
    out = scheduler.schedule()
    assert len(out.scheduled) == 2 and scheduler.num_running == 2 and scheduler.num_waiting == 2
    scheduler.update_from_output(out, model(out))
    run_all(scheduler, model)
    for req in reqs:
        expect_solo(req, 128)


def test_update_rejects_wrong_sampled_tokens_and_changes_nothing():
    scheduler, model = make_scheduler(max_num_batched_tokens=4)
    a, b = make_request("a", 2), make_request("b", 8)  # b is chunked: no sample this step
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = scheduler.schedule()
    for wrong, failed in (({}, {}), ({"a": 1, "b": 2}, {}), ({"a": 1}, {"a": "both"}), ({}, {"b": "x"})):
        with pytest.raises(ValueError, match=r"sampled_token_ids, failed: expected tokens or errors for exactly "
                                             r"\['a'\]"):
            scheduler.update_from_output(out, wrong, failed)
    assert (a.num_computed_tokens, b.num_computed_tokens, a.output_token_ids) == (0, 0, [])
    assert scheduler.update_from_output(out, model(out)) == []
    assert (a.num_computed_tokens, b.num_computed_tokens, a.num_output_tokens) == (2, 2, 1)


def test_finished_request_frees_blocks_and_leaves_running():
    scheduler, model = make_scheduler()
    a = make_request("a", 3, max_tokens=1)
    scheduler.add_request(a)
    out, finished = step(scheduler, model)
    assert finished == [a] and a.block_ids == [] and scheduler.num_running == 0
    assert scheduler.kv_cache_manager.num_used_blocks == 0 and not scheduler.has_unfinished()


# --- invariants under random load ------------------------------------------------------------


def check_step_invariants(scheduler: Scheduler, out: SchedulerOutput, arrival: dict[str, int]) -> None:
    kv = scheduler.kv_cache_manager
    scheduled = [s.request for s in out.scheduled]
    assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled) <= scheduler.max_num_batched_tokens
    assert len(scheduled) <= scheduler.max_num_seqs and scheduler.num_running <= scheduler.max_num_seqs
    assert len({id(r) for r in scheduled}) == len(scheduled)
    assert all(r.status is RequestStatus.RUNNING for r in scheduler.running)
    assert {id(r) for r in scheduled} <= {id(r) for r in scheduler.running}
    if scheduler.has_unfinished():
        assert scheduled, "work left but nothing scheduled"
    # Blocks: only running requests own any, and the pool agrees with the owners.
    assert all(r.block_ids == [] and r.num_computed_tokens == 0 for r in scheduler.waiting if r.num_preemptions)
    assert all(r.block_ids == [] for r in scheduler.waiting)
    check_pool(kv, scheduler.running, out.blocks_to_copy)
    # Coverage: exactly the blocks for computed + scheduled tokens (computed only when idle).
    new_tokens = {id(s.request): s.num_new_tokens for s in out.scheduled}
    for r in scheduler.running:
        assert len(r.block_ids) == kv.num_blocks_for(r.num_computed_tokens + new_tokens.get(id(r), 0))
    # First come, first served: running in arrival order, all older than anything waiting.
    running_order = [arrival[r.request_id] for r in scheduler.running]
    assert running_order == sorted(running_order)
    if scheduler.running and scheduler.waiting:
        assert max(running_order) < min(arrival[r.request_id] for r in scheduler.waiting)
    for r in out.preempted:
        assert r.status is RequestStatus.WAITING and r in scheduler.waiting


def check_pool(kv: KVCacheManager, owners: list[Request], blocks_to_copy=()) -> None:
    """The pool's invariants: each block's reference count is its owners (each request holding
    it, each copy source of the step), an owned block is not free, the free queue has no
    duplicate, the counts add up, and every cached hash names a block that holds the tokens the
    hash was computed from (the request's own, as the echo model's history check proves)."""
    pool = kv.pool
    expected = collections.Counter(b for r in owners for b in r.block_ids)
    expected.update(src for src, _ in blocks_to_copy)
    for r in owners:
        assert len(set(r.block_ids)) == len(r.block_ids)
    free = pool.free_block_ids()
    assert len(free) == len(set(free)) == pool.num_free_blocks
    assert all(pool.ref_count(b) == expected[b] for b in range(pool.num_blocks))
    assert set(free) == {b for b in range(pool.num_blocks) if expected[b] == 0}
    assert pool.num_used_blocks == len(expected)
    for block_hash, block_id in pool.cached_blocks().items():
        assert pool.block_hash(block_id) == block_hash
    # a request's computed full blocks that the cache names are named by that request's hashes
    for r in owners:
        for j, block_id in enumerate(r.block_ids[: r.num_computed_tokens // kv.block_size]):
            cached_as = pool.block_hash(block_id)
            assert cached_as is None or cached_as == kv.block_hashes(r)[j]


request_specs = st.tuples(
    st.integers(0, 5),  # arrival step
    st.integers(1, 24),  # prompt length
    st.integers(1, 12),  # max_tokens
    st.sampled_from([None, EOS, 5]),  # eos_token_id
    st.booleans(),  # ignore_eos
    st.lists(st.integers(0, VOCAB - 1), max_size=2),  # stop_token_ids
    st.integers(0, VOCAB - 1),  # first prompt token
)


def drive(config: dict, specs: list[tuple]) -> dict[str, Request]:
    """Run the arrivals through one scheduler, checking invariants every step."""
    scheduler, model = make_scheduler(**config)
    pending = sorted(enumerate(specs), key=lambda item: item[1][0])
    accepted: dict[str, Request] = {}
    arrival: dict[str, int] = {}
    for step_index in range(10_000):
        while pending and pending[0][1][0] <= step_index:
            i, (_, num_prompt, max_tokens, eos, ignore_eos, stop_ids, first) = pending.pop(0)
            req = make_request(
                f"r{i}", num_prompt, eos=eos, first=first, max_tokens=max_tokens, ignore_eos=ignore_eos,
                stop_token_ids=stop_ids,
            )
            kv = scheduler.kv_cache_manager
            fits = kv.num_blocks_for(min(num_prompt + max_tokens, config["max_model_len"])) <= kv.num_blocks
            if num_prompt <= config["max_model_len"] and fits:
                scheduler.add_request(req)
                accepted[req.request_id] = req
                arrival[req.request_id] = len(arrival)
            else:
                with pytest.raises(ValueError):
                    scheduler.add_request(req)
        if not pending and not scheduler.has_unfinished():
            assert scheduler.kv_cache_manager.num_used_blocks == 0
            return accepted
        out = scheduler.schedule()
        check_step_invariants(scheduler, out, arrival)
        finished = scheduler.update_from_output(out, model(out)) if out.scheduled else []
        assert all(r.is_finished and r.block_ids == [] and r not in scheduler.running for r in finished)
    raise AssertionError("scheduler did not finish")


@st.composite
def configs(draw) -> dict:
    """Limits around one full-length request's worth of KV blocks, so pools are tight enough to
    force preemption while most requests are accepted."""
    block_size = draw(st.integers(1, 4))
    max_model_len = draw(st.integers(4, 40))
    return dict(
        block_size=block_size,
        max_model_len=max_model_len,
        num_blocks=max(1, -(-max_model_len // block_size) + draw(st.integers(-2, 2))),
        max_num_batched_tokens=draw(st.integers(1, 24)),
        max_num_seqs=draw(st.integers(1, 6)),
    )


@settings(max_examples=200, deadline=None)
@given(config=configs(), specs=st.lists(request_specs, min_size=1, max_size=8))
def test_random_load_invariants_and_solo_equivalence(config, specs):
    together = drive(config, specs)
    for request_id, req in together.items():
        # Every request finished with exactly its solo stream; none was lost.
        assert req.is_finished
        expect_solo(req, config["max_model_len"])
        # And the same request run alone through the scheduler agrees.
        alone = drive(config, [(0,) + specs[int(request_id[1:])][1:]])
        assert next(iter(alone.values())).output_token_ids == req.output_token_ids
