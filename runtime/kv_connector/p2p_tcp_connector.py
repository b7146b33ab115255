"""``P2pTcpConnector``: prefill/decode disaggregation between two engines on one machine, KV blocks over TCP
(:mod:`pagedpack.runtime.kv_connector.tcp_transfer`), in the shape of vLLM's ``P2pNcclConnector`` /
``NixlConnector`` and their proxy flow (:mod:`pagedpack.serve.disagg_proxy`).

``--kv-transfer-config '{"kv_connector": "P2pTcpConnector", "kv_role": "kv_producer", "kv_ip": "127.0.0.1",
"kv_port": 14579}'`` on the engine that prefills, ``"kv_role": "kv_consumer"`` on the one that decodes
(``"kv_both"``: both). ``kv_connector_extra_config`` (each refused, naming it, when of the wrong type or range):

- ``hold_timeout_s`` (120): a producer lets go of blocks no consumer pulled in this long (vLLM's NIXL
  ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``);
- ``timeout_s`` (2): a transfer's deadline for the connect and for each read and write, both sides;
- ``transfer_timeout_s`` (5): a whole transfer's deadline, both sides: a producer that accepts and never
  answers, or answers a byte at a time, fails the pull when it passes (the tokens are computed here);
- ``max_pulls`` (32): pulls a consumer runs at once, each in a thread of its own: a pull asked for while as
  many run fails at once (its tokens computed here) rather than waiting behind them, so a stalled
  producer delays no other request's pull;
- ``max_held_bytes`` (1 GiB): the most bytes a producer holds for pulls at once; a request past it gets no
  ``kv_transfer_params`` (its decoder computes the prompt itself);
- ``remote_hosts`` (``["127.0.0.1", "localhost", "::1"]``): the only hosts a consumer pulls from (the
  ``remote_host`` a request names comes from a client, through the proxy).

The flow, with a request's ``kv_transfer_params`` (vLLM's; ``SamplingParams.extra_args``):

- producer, ``{"do_remote_decode": true}``: the request runs as any (the proxy asks for one token); when it
  finishes, :meth:`request_finished` copies its prompt's blocks out of the pool (it runs on the stepping
  thread, after the step: their bytes wait, with the prompt's block hashes, in the
  :class:`~pagedpack.runtime.kv_connector.tcp_transfer.KVBlockServer` for one pull or ``hold_timeout_s``) and
  returns ``{"do_remote_prefill": true, "remote_host", "remote_port", "remote_engine_id", "remote_request_id",
  "remote_block_ids", "remote_num_tokens"}`` without delaying the blocks' release (``delay_free`` False): a
  copy costs a memcpy, where blocks held until a pull would shrink the pool while consumers are slow, keep
  the engine stepping while they wait (``has_unfinished``), and be read off the stepping thread;
- consumer, those params: :meth:`get_num_new_matched_tokens` offers the prompt's tokens past the local prefix
  cache, loaded asynchronously (the scheduler keeps whole blocks and the last token to compute); the worker
  half pulls the blocks in a thread of its own, checks them (the tokens' hashes, each block's sha256, the
  caches' dtypes and shapes) and copies them into the request's blocks on the stepping thread, then names the
  request in ``finished_recving``. A pull that fails reports the blocks in
  :meth:`get_block_ids_with_load_errors`: the scheduler recomputes those tokens (a wrong answer never comes of
  it). A request aborted while its pull runs gets nothing written: its blocks may be someone else's by then.

Everything travels in whole requests between steps, not per layer: ``start_load_kv``,
``wait_for_layer_load``, ``save_kv_layer`` and ``wait_for_save`` have nothing to do, and the halves meet in
the ``shared`` state of one engine (:func:`pagedpack.runtime.kv_connector.driver.make_connectors`), since the
engine calls ``get_finished`` every step, a step that schedules nothing included (a request waiting for its
pull is not scheduled), and binds metadata only to steps that run.
"""
from __future__ import annotations

import logging
import socket
import threading
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from pagedpack.runtime.kv_connector.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from pagedpack.runtime.kv_connector.tcp_transfer import (
    MAX_ID_CHARS,
    BlockLayout,
    KVBlockServer,
    KVTransferError,
    PulledBlocks,
    TransferStats,
    pull_blocks,
    read_blocks,
    request_block_hashes,
    write_blocks,
)
from pagedpack.runtime.request import RequestStatus

if TYPE_CHECKING:
    import torch

    from pagedpack.runtime.kv_connector.config import KVTransferConfig
    from pagedpack.runtime.request import Request

log = logging.getLogger("pagedpack.kv_transfer")

_PARAMS = {"do_remote_decode": bool, "do_remote_prefill": bool, "remote_engine_id": str, "remote_request_id": str,
           "remote_host": str, "remote_port": int, "remote_block_ids": list, "remote_num_tokens": int}
_NEEDED_TO_PULL = ("remote_host", "remote_port", "remote_request_id", "remote_num_tokens")


@dataclass(frozen=True)
class P2pTcpOptions:
    """``kv_connector_extra_config`` (module docstring)."""

    hold_timeout_s: float = 120.0
    timeout_s: float = 2.0
    transfer_timeout_s: float = 5.0
    max_held_bytes: int = 2**30
    max_pulls: int = 32
    remote_hosts: tuple[str, ...] = ("127.0.0.1", "localhost", "::1")

    @classmethod
    def parse(cls, extra: dict) -> "P2pTcpOptions":
        """The options of ``kv_connector_extra_config``; ``ValueError`` naming
        ``kv_transfer_config.kv_connector_extra_config.<key>``, what was expected and what came."""
        name = "kv_transfer_config.kv_connector_extra_config"
        known = {f.name for f in fields(cls)}
        for key in extra:
            if key not in known:
                raise ValueError(f"{name}.{key}: expected one of {sorted(known)} for P2pTcpConnector, got {key!r:.80}")
        for key in ("hold_timeout_s", "timeout_s", "transfer_timeout_s"):
            value = extra.get(key, 1.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e6:
                raise ValueError(f"{name}.{key}: expected seconds in (0, 1e6), got {value!r:.80}")
        held = extra.get("max_held_bytes", 0)
        if isinstance(held, bool) or not isinstance(held, int) or not 0 <= held < 2**63:
            raise ValueError(f"{name}.max_held_bytes: expected an int >= 0, got {held!r:.80}")
        pulls = extra.get("max_pulls", 1)
        if isinstance(pulls, bool) or not isinstance(pulls, int) or not 1 <= pulls <= 1024:
            raise ValueError(f"{name}.max_pulls: expected an int in [1, 1024], got {pulls!r:.80}")
        hosts = extra.get("remote_hosts", ["127.0.0.1"])
        if not isinstance(hosts, list) or not hosts or not all(isinstance(h, str) and h for h in hosts):
            raise ValueError(f"{name}.remote_hosts: expected a non-empty list of host names, got {hosts!r:.80}")
        given = {k: tuple(v) if k == "remote_hosts" else v for k, v in extra.items()}
        return cls(**given)


class _PullThreads:
    """Runs each pull in a thread of its own, at most ``limit`` at once; a pull submitted while ``limit``
    run fails at once (``KVTransferError``) instead of queueing: no pull waits behind a stalled one."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._slots = threading.BoundedSemaphore(limit)

    def submit(self, fn, /, *args: Any, **kwargs: Any) -> Future:
        """A future of ``fn(*args, **kwargs)``, run now in a new daemon thread, or failed if none is free."""
        future: Future = Future()
        if not self._slots.acquire(blocking=False):
            future.set_exception(KVTransferError(f"{self.limit} pulls run already (kv_connector_extra_config."
                                                 "max_pulls)"))
            return future

        def run() -> None:
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as err:  # handed to the future's reader
                future.set_exception(err)
            finally:
                self._slots.release()

        threading.Thread(target=run, name="pagedpack-kv-pull", daemon=True).start()
        return future


@dataclass
class _Recv:
    host: str
    port: int
    remote_request_id: str
    block_ids: list[int]  # this engine's blocks to fill
    first_block: int
    block_hashes: list[bytes]
    num_tokens: int
    future: Future | None = None


@dataclass
class _Shared:
    """What the two halves of one engine's connector share (both run on the stepping thread)."""

    server: KVBlockServer | None = None
    layout: BlockLayout | None = None
    kv_caches: list = field(default_factory=list)
    to_recv: dict[str, _Recv] = field(default_factory=dict)
    cancelled: set[str] = field(default_factory=set)
    loaded: set[str] = field(default_factory=set)  # asked to load once: never again (re-admitted, preempted)
    received: TransferStats = field(default_factory=TransferStats)


class P2pTcpConnector(KVConnectorBase_V1):
    """The connector (module docstring). ``OSError`` / ``ValueError`` naming ``kv_transfer_config.kv_port`` when a
    producer cannot listen on ``kv_ip:kv_port``."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, *, block_size: int, shared: dict,
                 **kwargs: Any) -> None:
        super().__init__(config, role, block_size=block_size)
        self.options = P2pTcpOptions.parse(config.kv_connector_extra_config)
        self.engine_id = config.engine_id or uuid.uuid4().hex
        self.state: _Shared = shared.setdefault("p2p_tcp", _Shared())
        self._errors: set[int] = set()
        self._pulls = None
        if role is KVConnectorRole.WORKER:
            if config.is_kv_producer:
                try:
                    self.state.server = KVBlockServer(config.kv_ip, config.kv_port, timeout_s=self.options.timeout_s,
                                                      transfer_timeout_s=self.options.transfer_timeout_s,
                                                      hold_timeout_s=self.options.hold_timeout_s,
                                                      max_held_bytes=self.options.max_held_bytes)
                except OSError as err:
                    raise ValueError(_cannot_listen(config, err)) from err
            if config.is_kv_consumer:
                self._pulls = _PullThreads(self.options.max_pulls)

    cache_loaded_blocks = False  # the producer is the one a request's kv_transfer_params name

    @classmethod
    def check_config(cls, config: KVTransferConfig) -> None:
        """The options, and for a producer whether ``kv_ip:kv_port`` can be listened on (bound and let go at
        once: another process holding the port is refused before the model is built); ``ValueError`` naming
        ``kv_transfer_config.<field>``."""
        P2pTcpOptions.parse(config.kv_connector_extra_config)
        if config.is_kv_producer and config.kv_port:
            try:
                socket.create_server((config.kv_ip, config.kv_port)).close()
            except OSError as err:
                raise ValueError(_cannot_listen(config, err)) from err

    def describe(self) -> str:
        server = self.state.server
        return super().describe() + (f": KV blocks served on {self._kv_transfer_config.kv_ip}:{server.port}"
                                     if server is not None else "")

    # --- what a request may ask -------------------------------------------------------------

    def check_kv_transfer_params(self, request: Request) -> None:
        """``ValueError`` naming ``kv_transfer_params.<field>`` for a request whose ``kv_transfer_params``
        (from a client, through the proxy) this engine cannot take; thread-safe."""
        params = _incoming(request)
        if params is None:
            return
        if not isinstance(params, dict):
            raise ValueError(f"kv_transfer_params: expected a JSON object, got {params!r:.80}")
        for key, value in params.items():
            kind = _PARAMS.get(key)
            if kind is None:
                raise ValueError(f"kv_transfer_params.{key}: expected one of the fields {sorted(_PARAMS)}")
            if value is not None and (not isinstance(value, kind) or kind is int and isinstance(value, bool)):
                raise ValueError(f"kv_transfer_params.{key}: expected a {kind.__name__} or null, got {value!r:.80}")
        num_sequences = 1 + len(request.forks)  # n > 1 (best_of n): the first sequence, n=1, and its forks
        if num_sequences != 1:
            raise ValueError(f"kv_transfer_params: one sequence's KV moves at a time; expected n=1 (and best_of 1 "
                             f"or none) with kv_transfer_params, got n={num_sequences}")
        config = self._kv_transfer_config
        if params.get("do_remote_decode") and params.get("do_remote_prefill"):
            raise ValueError("kv_transfer_params.do_remote_prefill: expected do_remote_decode or do_remote_prefill, "
                             "got both")
        if params.get("do_remote_decode") and not config.is_kv_producer:
            raise ValueError(f"kv_transfer_params.do_remote_decode: this engine's kv_role is {config.kv_role}; "
                             "expected a kv_producer")
        if params.get("do_remote_prefill"):
            self._check_remote_prefill(params, request)

    def _check_remote_prefill(self, params: dict, request: Request) -> None:
        if not self._kv_transfer_config.is_kv_consumer:
            raise ValueError(f"kv_transfer_params.do_remote_prefill: this engine's kv_role is "
                             f"{self._kv_transfer_config.kv_role}; expected a kv_consumer")
        for key in _NEEDED_TO_PULL:
            if params.get(key) is None:
                raise ValueError(f"kv_transfer_params.{key}: expected with do_remote_prefill, got nothing")
        if params["remote_host"] not in self.options.remote_hosts:
            raise ValueError(f"kv_transfer_params.remote_host: expected one of {list(self.options.remote_hosts)} "
                             f"(kv_connector_extra_config.remote_hosts), got {params['remote_host']!r:.80}")
        if not 1 <= params["remote_port"] <= 65535:
            raise ValueError(f"kv_transfer_params.remote_port: expected a port in [1, 65535], got "
                             f"{params['remote_port']}")
        if not 0 < len(params["remote_request_id"]) <= MAX_ID_CHARS:
            raise ValueError(f"kv_transfer_params.remote_request_id: expected 1 to {MAX_ID_CHARS} characters, got "
                             f"{len(params['remote_request_id'])}")
        if params["remote_num_tokens"] != request.num_prompt_tokens:
            raise ValueError(f"kv_transfer_params.remote_num_tokens: expected the prompt's "
                             f"{request.num_prompt_tokens} tokens, got {params['remote_num_tokens']}")

    # --- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._to_pull(request) is None:
            return 0, False
        return max(0, request.num_prompt_tokens - num_computed_tokens), True

    def _to_pull(self, request: Request) -> dict | None:
        """The request's ``kv_transfer_params`` if it has blocks to pull not asked for yet, else None."""
        params = _incoming(request)
        wanted = isinstance(params, dict) and params.get("do_remote_prefill")
        return params if wanted and request.request_id not in self.state.loaded else None

    def update_state_after_alloc(self, request: Request, blocks: list[int], num_external_tokens: int) -> None:
        """Remember to pull the blocks of the ``num_external_tokens`` (a request whose prompt the local prefix
        cache holds whole pulls no block: its pull only tells the producer to let them go)."""
        params, size = self._to_pull(request), self.block_size
        if params is None:
            return
        first = (request.num_computed_tokens - num_external_tokens) // size
        self.state.loaded.add(request.request_id)
        self.state.to_recv[request.request_id] = _Recv(
            params["remote_host"], params["remote_port"], params["remote_request_id"],
            blocks[first:first + num_external_tokens // size], first,
            request_block_hashes(request.prompt_token_ids, size, request.block_keys), request.num_prompt_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()  # the halves share their state (module docstring)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        state = self.state
        state.loaded.discard(request.request_id)
        if request.request_id in state.to_recv:  # aborted while its pull runs: write nothing
            state.cancelled.add(request.request_id)
        params = _incoming(request)
        if state.server is None or not (isinstance(params, dict) and params.get("do_remote_decode")) \
                or request.status not in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED):
            return False, None
        num_blocks = -(-request.num_prompt_tokens // self.block_size)
        if len(block_ids) < num_blocks or not state.server.expect(request.request_id,
                                                                  num_blocks * state.layout.block_bytes):
            log.warning("request %r: its KV blocks are not kept for a consumer (max_held_bytes %d reached)",
                        request.request_id, self.options.max_held_bytes)
            return False, None
        held = block_ids[:num_blocks]
        state.server.hold(request.request_id, read_blocks(state.kv_caches, held),
                          request_block_hashes(request.prompt_token_ids, self.block_size, request.block_keys),
                          request.num_prompt_tokens, state.layout)
        host = self._kv_transfer_config.kv_ip
        if host in ("0.0.0.0", "::"):
            host = "127.0.0.1"  # listening on every interface: this machine's loopback reaches it
        return False, {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                      "remote_request_id": request.request_id, "remote_host": host,
                      "remote_port": state.server.port, "remote_block_ids": held,
                      "remote_num_tokens": request.num_prompt_tokens}

    # --- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.state.kv_caches = [cache for pair in kv_caches.values() for cache in pair]
        self.state.layout = BlockLayout.of(self.state.kv_caches)

    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        """Nothing: pulls start and end between steps (:meth:`get_finished`)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing: a request waits for its whole pull before it is scheduled."""

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing: a finished request's blocks are copied whole (:meth:`get_finished`)."""

    def wait_for_save(self) -> None:
        """Nothing to wait for."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Start the pulls of requests admitted since the last step, and write those done into their blocks
        (``finished_recving``, failed ones too: their blocks are reported by
        :meth:`get_block_ids_with_load_errors`). Nothing is ever ``finished_sending``: no block is held."""
        state, done = self.state, set()
        for request_id, recv in list(state.to_recv.items()):
            if recv.future is None:
                recv.future = self._pulls.submit(
                    pull_blocks, recv.host, recv.port, recv.remote_request_id, layout=state.layout,
                    block_hashes=recv.block_hashes, num_tokens=recv.num_tokens, first_block=recv.first_block,
                    num_blocks=len(recv.block_ids), timeout_s=self.options.timeout_s,
                    transfer_timeout_s=self.options.transfer_timeout_s)
            if not recv.future.done():
                continue
            del state.to_recv[request_id]
            if request_id in state.cancelled or not recv.block_ids:  # aborted, or nothing to write
                state.cancelled.discard(request_id)
                continue
            done.add(request_id)
            err = recv.future.exception()
            if err is None:
                pulled: PulledBlocks = recv.future.result()
                write_blocks(state.kv_caches, recv.block_ids, pulled.data)
                state.received.add(blocks=len(recv.block_ids), nbytes=pulled.data.numel(), seconds=pulled.seconds)
            else:
                state.received.add(failed=True)
                log.warning("request %r: its KV blocks could not be pulled (%s); computing them here", request_id, err)
                self._errors.update(recv.block_ids)
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """The transfers so far (vLLM's ``get_kv_connector_stats``): ``{"sent": TransferStats, "received":
        TransferStats, "held_requests": int, "held_bytes": int}``, a side this engine does not play absent."""
        state, stats = self.state, {}
        if state.server is not None:
            stats.update(sent=state.server.stats, held_requests=state.server.num_held,
                         held_bytes=state.server.held_bytes)
        if self._kv_transfer_config.is_kv_consumer:
            stats["received"] = state.received
        return stats

    def shutdown(self) -> None:
        if self.role is KVConnectorRole.WORKER:
            if self.state.server is not None:
                self.state.server.close()  # pulls under way end by their transfer_timeout_s


def _cannot_listen(config: KVTransferConfig, err: OSError) -> str:
    return (f"kv_transfer_config.kv_port: expected a port this producer can listen on, got {config.kv_ip}:"
            f"{config.kv_port}, which cannot be bound ({err.strerror or err}; another process holds it?)")


def _incoming(request: Request):
    """The ``kv_transfer_params`` the request came with (vLLM's: in ``SamplingParams.extra_args``)."""
    extra = request.sampling_params.extra_args
    return None if extra is None else extra.get("kv_transfer_params")

