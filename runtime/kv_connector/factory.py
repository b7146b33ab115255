"""The registry of connectors, as vLLM's (``vllm/distributed/kv_transfer/kv_connector/factory.py``).

A connector is registered by name with the module and class that implement it, imported only when an
engine asks for it (:meth:`KVConnectorFactory.create_connector`); ``kv_connector_module_path`` in the
config names a module outside the registry, as in vLLM.
"""
from __future__ import annotations

import importlib
from typing import Any, ClassVar

from pagedpack.runtime.kv_connector.base import KVConnectorBase_V1, KVConnectorRole
from pagedpack.runtime.kv_connector.config import KVTransferConfig


class KVConnectorFactory:
    """Connectors by name (vLLM's ``KVConnectorFactory``)."""

    _registry: ClassVar[dict[str, tuple[str, str]]] = {
        "OffloadingConnector": ("pagedpack.runtime.kv_connector.offloading_connector", "OffloadingConnector"),
    }

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        """Register ``module_path.class_name`` as ``name``; ``ValueError`` if ``name`` is taken."""
        if name in cls._registry:
            raise ValueError(f"kv_connector: {name!r} is already registered")
        cls._registry[name] = (module_path, class_name)

    @classmethod
    def registered(cls) -> list[str]:
        return sorted(cls._registry)

    @classmethod
    def get_connector_class(cls, config: KVTransferConfig) -> type[KVConnectorBase_V1]:
        """The class ``config.kv_connector`` names; ``ValueError`` naming ``kv_transfer_config.kv_connector``."""
        name = config.kv_connector
        if config.kv_connector_module_path is not None:
            module_path, class_name = config.kv_connector_module_path, name
        elif name in cls._registry:
            module_path, class_name = cls._registry[name]
        else:
            raise ValueError(f"kv_transfer_config.kv_connector: expected one of {cls.registered()} (or a "
                             f"kv_connector_module_path), got {name!r:.80}")
        try:
            connector = getattr(importlib.import_module(module_path), class_name)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"kv_transfer_config.kv_connector: {name!r} names {module_path}.{class_name}, which "
                             f"cannot be imported ({err})") from None
        if not (isinstance(connector, type) and issubclass(connector, KVConnectorBase_V1)):
            raise ValueError(f"kv_transfer_config.kv_connector: expected a KVConnectorBase_V1 subclass, got "
                             f"{module_path}.{class_name}")
        return connector

    @classmethod
    def create_connector(cls, config: KVTransferConfig, role: KVConnectorRole, **kwargs: Any) -> KVConnectorBase_V1:
        """An instance of ``config``'s connector in ``role``; ``kwargs`` go to its constructor
        (``block_size`` and what the connector takes)."""
        return cls.get_connector_class(config)(config, role, **kwargs)


KVConnectorFactory.register_connector("P2pTcpConnector", "pagedpack.runtime.kv_connector.p2p_tcp_connector",
                                      "P2pTcpConnector")
