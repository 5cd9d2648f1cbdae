"""The HTTP layer: routes (ours and OpenAI's), settings, metrics, the cache inspector's page."""
