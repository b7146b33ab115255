"""KV connectors: an external KV tier or transfer behind vLLM v1's ``KVConnectorBase_V1`` interface."""
