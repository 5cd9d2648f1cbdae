"""HTTP layer and engine loop of the CONF-KV server."""
