"""``GET /metrics``: the server's Prometheus metrics, named as vLLM names them.

Every name is vLLM's (``vllm:num_requests_running`` ...) under the namespace ``pagedpack`` by
default (``pagedpack:num_requests_running``); ``--metrics-namespace vllm`` gives vLLM's names
exactly, for dashboards written for vLLM. Each metric has the label ``model_name``.

- gauges read at scrape time: ``num_requests_running``, ``num_requests_waiting`` (queued or in
  the scheduler's waiting queue, preempted ones too), ``kv_cache_usage_perc`` (KV blocks held by
  requests / all blocks, 0..1; cached blocks nobody holds count as free, as vLLM counts them);
  ``recurrent_state_slots_used`` and ``recurrent_state_usage_perc`` (a model with recurrent layers:
  the per-sequence state slots held by requests, and that / all slots; 0 without such layers:
  pagedpack's, vLLM keeps a hybrid's state in its KV blocks);
  ``cache_config_info`` (1, the KV cache's ``block_size``, ``cache_dtype``, ``num_gpu_blocks`` and
  ``enable_prefix_caching`` as labels, vLLM's label names);
- with a KV connector (``--kv-transfer-config``, ``--kv-offload-size``): ``external_prefix_cache_queries_total`` /
  ``external_prefix_cache_hits_total`` (vLLM's: tokens of admitted requests / of those, tokens the connector
  loaded); with the ``OffloadingConnector``, labelled ``medium`` (``CPU`` or ``DISK``): the gauge
  ``kv_offload_bytes_used`` and the counters ``kv_offload_saves_total``, ``kv_offload_loads_total`` (blocks
  stored in / loaded back from the tier: its hits), ``kv_offload_misses_total`` (blocks it could not give
  back, ``kv_offload_corrupt_total`` of them a bad file), ``kv_offload_save_seconds_total`` and
  ``kv_offload_load_seconds_total`` (pagedpack's names; docs/kv-offload.md);
- counters: ``prompt_tokens_total`` and ``generation_tokens_total`` (of requests served, counted
  as their outputs arrive), ``request_success_total{finished_reason}``, and read from the
  engine's own counters ``prefix_cache_queries_total`` / ``prefix_cache_hits_total`` (tokens
  looked up / found at admission), ``num_preemptions_total``, and ``kv_events_dropped_batches_total``
  (KV event batches dropped because the publisher's queue was full: pagedpack's, vLLM has no such
  metric; 0 without ``--kv-events-config``: :mod:`pagedpack.runtime.kv_event_publisher`);
- with a KV connector that moves KV between engines (``--kv-transfer-config``, e.g. ``P2pTcpConnector``:
  prefill/decode disaggregation), pagedpack's own counters by ``direction`` (``sent``: pulled from this
  engine; ``received``: pulled by it): ``kv_transfer_requests_total``, ``kv_transfer_blocks_total``,
  ``kv_transfer_bytes_total``, ``kv_transfer_seconds_total`` (from a pull's connection to its last byte
  checked: the mean transfer time is its ratio to the requests) and ``kv_transfer_failures_total``; and the
  gauges ``kv_transfer_held_requests`` / ``kv_transfer_held_bytes`` (a producer's copies waiting for a pull);
- with ``--enable-lora``: vLLM's gauge ``lora_requests_info`` (labels ``running_lora_adapters`` and
  ``waiting_lora_adapters``, the adapters of the running and waiting requests, comma-separated, and
  ``max_lora``; its value the time of the scrape, in seconds since the epoch, as vLLM's is its last
  update's), pagedpack's gauge ``lora_adapters_loaded`` (adapters in host memory, at most
  ``--max-cpu-loras``) and counter ``lora_requests_total{lora_name}`` (completions run with each adapter,
  counted when taken: vLLM has none);
- with ``--speculative-config``, vLLM's counters ``spec_decode_num_drafts_total``,
  ``spec_decode_num_draft_tokens_total``, ``spec_decode_num_accepted_tokens_total`` and
  ``spec_decode_num_accepted_tokens_per_pos_total{position}`` (acceptance rate: accepted over draft
  tokens; mean acceptance length: ``1 +`` accepted over drafts);
- histograms (seconds, measured where the server hands tokens out): ``time_to_first_token_seconds``,
  ``inter_token_latency_seconds`` (between two outputs of a completion: one per step),
  ``e2e_request_latency_seconds``, and ``request_prompt_tokens`` / ``request_generation_tokens``.

The unit of every per-request series is a completion, as vLLM v1 counts the ``n`` completions of
a request (each a child request with its own stats): a request with ``n = 3`` adds 3 to
``request_success_total``, to each histogram's count, and its prompt's tokens 3 times to
``prompt_tokens_total``. A completion aborted because its client left counts only in
``request_success_total{finished_reason="abort"}``.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagedpack.runtime.engine_loop import EngineLoop

# vLLM's buckets
_TTFT_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
           80.0, 160.0, 640.0, 2560.0)
_ITL_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
          960.0, 1920.0, 7680.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class _EngineCollector:
    """What the engine knows, read when Prometheus scrapes (never stale, nothing to keep in step)."""

    def __init__(self, loop: EngineLoop, namespace: str, model_name: str):
        self.loop, self.namespace, self.model_name = loop, namespace, model_name

    def _offload(self, engine):
        connector = engine.scheduler.connector
        tier = connector.get_kv_connector_stats() if connector is not None else None
        if not tier or "medium" not in tier:
            return
        name, labels = f"{self.namespace}:kv_offload_", [self.model_name, tier["medium"]]
        used = GaugeMetricFamily(name + "bytes_used", "Bytes the KV offload tier holds.",
                                 labels=["model_name", "medium"])
        used.add_metric(labels, tier["bytes_used"])
        yield used
        for metric, doc in (("saves", "Blocks stored in the KV offload tier."),
                            ("loads", "Blocks loaded back from the KV offload tier (its hits)."),
                            ("misses", "Blocks the KV offload tier could not give back (recomputed)."),
                            ("corrupt", "Of the misses, blocks whose file was bad."),
                            ("save_seconds", "Seconds spent saving blocks to the KV offload tier."),
                            ("load_seconds", "Seconds spent loading blocks from the KV offload tier.")):
            family = CounterMetricFamily(name + metric, doc, labels=["model_name", "medium"])
            family.add_metric(labels, tier[metric])
            yield family

    def collect(self):
        engine = self.loop.engine
        stats = engine.get_stats()
        name = f"{self.namespace}:"
        gauges = (("num_requests_running", "Requests in the running batch.", len(engine.scheduler.running)),
                  ("num_requests_waiting", "Requests waiting to be scheduled.", self.loop.num_waiting),
                  ("kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests (1 = full).",
                   stats.kv_blocks_used / max(1, stats.kv_blocks_total)),
                  ("recurrent_state_slots_used", "Recurrent-state slots held by requests (0 without recurrent "
                   "layers).", stats.state_slots_used),
                  ("recurrent_state_usage_perc", "Fraction of recurrent-state slots held by requests (1 = full; 0 "
                   "without recurrent layers).", stats.state_slots_used / max(1, stats.state_slots_total)))
        for metric, doc, value in gauges:
            family = GaugeMetricFamily(name + metric, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        config = {"block_size": engine.runner.block_size, "cache_dtype": stats.kv_cache_dtype,
                  "num_gpu_blocks": stats.kv_blocks_total,  # vLLM's label, whatever the device
                  "enable_prefix_caching": engine.scheduler.kv_cache_manager.enable_prefix_caching}
        info = GaugeMetricFamily(name + "cache_config_info", "Information of the LLM's KV cache configuration.",
                                 labels=["model_name", *config])
        info.add_metric([self.model_name, *map(str, config.values())], 1.0)
        yield info
        yield from self._offload(engine)
        if engine.lora is not None:
            yield self._lora_info(name, engine)
            loaded = GaugeMetricFamily(name + "lora_adapters_loaded", "LoRA adapters loaded in host memory.",
                                       labels=["model_name"])
            loaded.add_metric([self.model_name], len(engine.list_loras()))
            yield loaded
        counters = (("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                     stats.prefix_cache_queries),
                    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits),
                    ("num_preemptions", "Requests preempted (their KV freed, recomputed later).",
                     stats.num_preemptions),
                    ("kv_events_dropped_batches", "KV event batches dropped: the publisher's queue was full.",
                     engine.kv_event_publisher.num_dropped_batches))
        if engine.scheduler.connector is not None:
            counters += (("external_prefix_cache_queries", "Tokens of requests admitted with a KV connector.",
                          stats.external_prefix_cache_queries),
                         ("external_prefix_cache_hits", "Tokens a KV connector loaded at admission.",
                          stats.external_prefix_cache_hits))
        if engine.proposer is not None:
            counters += (("spec_decode_num_drafts", "Number of spec decoding drafts.", stats.spec_decode_num_drafts),
                         ("spec_decode_num_draft_tokens", "Number of draft tokens.",
                          stats.spec_decode_num_draft_tokens),
                         ("spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                          stats.spec_decode_num_accepted_tokens))
        for metric, doc, value in counters:
            family = CounterMetricFamily(name + metric, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        if engine.proposer is not None:
            per_position = CounterMetricFamily(name + "spec_decode_num_accepted_tokens_per_pos",
                                               "Accepted tokens per draft position.", labels=["model_name", "position"])
            for position, value in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
                per_position.add_metric([self.model_name, str(position)], value)
            yield per_position
        connector = engine.scheduler.connector
        yield from self._kv_transfer(name, connector.get_kv_connector_stats() if connector is not None else None)

    def _lora_info(self, name: str, engine) -> GaugeMetricFamily:
        """vLLM's ``lora_requests_info``: the adapters running and waiting (labels), now (value)."""
        scheduler = engine.scheduler
        adapters = [",".join(sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None}))
                    for requests in (list(scheduler.running), list(scheduler.waiting))]
        info = GaugeMetricFamily(name + "lora_requests_info", "Running stats on LoRA requests.",
                                 labels=["model_name", "running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        info.add_metric([self.model_name, *adapters, str(engine.lora.max_loras)], time.time())
        return info

    def _kv_transfer(self, name: str, stats: dict | None):
        """The KV connector's transfer counters (``sent`` / ``received``) and held copies, if it moves any."""
        directions = [d for d in ("sent", "received") if stats and d in stats]
        if not directions:
            return
        for metric, doc, field in (("requests", "Requests whose KV blocks moved between engines.", "requests"),
                                   ("blocks", "KV blocks moved between engines.", "blocks"),
                                   ("bytes", "Bytes of KV blocks moved between engines.", "bytes"),
                                   ("seconds", "Seconds KV transfers took, connection to last byte checked.",
                                    "seconds"),
                                   ("failures", "KV transfers that failed (the tokens are computed again).",
                                    "failures")):
            family = CounterMetricFamily(f"{name}kv_transfer_{metric}", doc, labels=["model_name", "direction"])
            for direction in directions:
                family.add_metric([self.model_name, direction], getattr(stats[direction], field))
            yield family
        for metric, doc in (("held_requests", "Requests whose KV blocks wait for a consumer's pull."),
                            ("held_bytes", "Bytes of KV blocks waiting for a consumer's pull.")):
            if metric in stats:
                family = GaugeMetricFamily(f"{name}kv_transfer_{metric}", doc, labels=["model_name"])
                family.add_metric([self.model_name], stats[metric])
                yield family


class ServerMetrics:
    """The registry of one server; :meth:`request` gives the per-request observer."""

    def __init__(self, loop: EngineLoop, *, model_name: str, namespace: str = "pagedpack"):
        disable_created_metrics()  # no *_created series (process-wide), as vLLM serves its metrics
        self.registry = registry = CollectorRegistry(auto_describe=True)
        registry.register(_EngineCollector(loop, namespace, model_name))
        label, ns = ["model_name"], f"{namespace}:"
        self.prompt_tokens = Counter(ns + "prompt_tokens", "Prompt tokens of requests served.", label,
                                     registry=registry).labels(model_name)
        self.generation_tokens = Counter(ns + "generation_tokens", "Tokens generated.", label,
                                         registry=registry).labels(model_name)
        self._success = Counter(ns + "request_success", "Completions finished (n per request), by finish reason.",
                                [*label, "finished_reason"], registry=registry)
        self._lora_requests = Counter(ns + "lora_requests", "Completions (n per request) run with each LoRA adapter.",
                                      [*label, "lora_name"], registry=registry)
        self.ttft = Histogram(ns + "time_to_first_token_seconds", "Time to first token.", label, buckets=_TTFT_S,
                              registry=registry).labels(model_name)
        self.itl = Histogram(ns + "inter_token_latency_seconds", "Time between two outputs of a completion.", label,
                             buckets=_ITL_S, registry=registry).labels(model_name)
        self.e2e = Histogram(ns + "e2e_request_latency_seconds", "Arrival to last token.", label, buckets=_E2E_S,
                             registry=registry).labels(model_name)
        self.request_prompt_tokens = Histogram(ns + "request_prompt_tokens", "Prompt tokens per completion.", label,
                                               buckets=_TOKENS, registry=registry).labels(model_name)
        self.request_generation_tokens = Histogram(ns + "request_generation_tokens", "Tokens generated per completion.",
                                                   label, buckets=_TOKENS, registry=registry).labels(model_name)
        self.model_name = model_name

    def success(self, finished_reason: str) -> None:
        self._success.labels(self.model_name, finished_reason).inc()

    def adapter_requests(self, lora_name: str, num_completions: int) -> None:
        self._lora_requests.labels(self.model_name, lora_name).inc(num_completions)

    def request(self, num_completions: int) -> "RequestTimer":
        return RequestTimer(self, num_completions)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Observes one engine request's outputs as the server receives them (arrival: when made), each
    of its completions apart: its first tokens (TTFT, the prompt's tokens counted), the time
    between its own outputs (ITL), its end (success by finish reason, E2E latency, prompt and
    generated tokens)."""

    def __init__(self, metrics: ServerMetrics, num_completions: int):
        self.metrics, self.arrival = metrics, time.perf_counter()
        self.last: dict[int, float] = {}  # completion index -> when its last tokens came
        self.generated: dict[int, int] = {}  # completion index -> tokens so far
        self.num_unfinished = num_completions

    def observe(self, delta) -> None:
        """Take one :class:`~pagedpack.runtime.outputs.RequestOutput` delta."""
        m, now, num_prompt = self.metrics, time.perf_counter(), len(delta.prompt_token_ids)
        for completion in delta.outputs:  # each completion finishes in exactly one delta
            i, new = completion.index, len(completion.token_ids)
            if new:
                if i in self.last:
                    m.itl.observe(now - self.last[i])
                else:
                    m.ttft.observe(now - self.arrival)
                    m.prompt_tokens.inc(num_prompt)
                self.last[i] = now
                self.generated[i] = self.generated.get(i, 0) + new
                m.generation_tokens.inc(new)
            if completion.finish_reason is not None:
                m.success(completion.finish_reason)
                m.e2e.observe(now - self.arrival)
                m.request_prompt_tokens.observe(num_prompt)
                m.request_generation_tokens.observe(self.generated.get(i, 0))
                self.num_unfinished -= 1

    def close(self) -> None:
        """The server stopped reading (the client left): what did not finish was aborted."""
        for _ in range(self.num_unfinished):
            self.metrics.success("abort")
        self.num_unfinished = 0
