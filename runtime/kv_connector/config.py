"""``KVTransferConfig``: how an engine shares KV with others, as vLLM's (``vllm/config/kv_transfer.py``);
the connector it names is made by :class:`pagedpack.runtime.kv_connector.factory.KVConnectorFactory`."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from pagedpack.inputs import parse_config

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass
class KVTransferConfig:
    """vLLM's ``KVTransferConfig`` (the fields pagedpack uses, vLLM's names and defaults).

    kv_connector: a registered connector's name (``KVConnectorFactory.registered()``).
    kv_role: ``"kv_producer"`` (saves KV for others), ``"kv_consumer"`` (loads it) or ``"kv_both"``.
    kv_connector_extra_config: the connector's own options (a dict).
    kv_connector_module_path: a module holding a class named ``kv_connector``, for one not registered.
    kv_ip, kv_port: where a connector over the network listens or connects (127.0.0.1, 14579).
    engine_id: this engine's id among those sharing KV (None: the connector makes one).

    ``ValueError`` naming ``kv_transfer_config.<field>`` for a field unknown or of the wrong type.
    """

    kv_connector: str | None = None
    kv_role: str | None = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_connector_module_path: str | None = None
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    engine_id: str | None = None

    def __post_init__(self) -> None:
        for name in ("kv_connector", "kv_connector_module_path", "engine_id"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"kv_transfer_config.{name}: expected a non-empty string or null, got {value!r:.80}")
        if self.kv_connector is None:
            raise ValueError("kv_transfer_config.kv_connector: expected a registered connector's name "
                             "(KVConnectorFactory.registered()), got None")
        if self.kv_role is None:
            self.kv_role = "kv_both"
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role: expected one of {list(KV_ROLES)}, got {self.kv_role!r:.80}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config: expected a JSON object, got "
                             f"{self.kv_connector_extra_config!r:.80}")
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ValueError(f"kv_transfer_config.kv_ip: expected an address, got {self.kv_ip!r:.80}")
        if isinstance(self.kv_port, bool) or not isinstance(self.kv_port, int) or not 0 <= self.kv_port <= 65535:
            raise ValueError(f"kv_transfer_config.kv_port: expected a port from 0 to 65535, got {self.kv_port!r:.80}")

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)

    @classmethod
    def parse(cls, value) -> KVTransferConfig | None:
        """A config from JSON text (the command line's), a dict, or a config; None passes."""
        return parse_config(cls, value, "kv_transfer_config")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
