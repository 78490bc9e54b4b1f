"""HTTP serving: the OpenAI-compatible API, native /generate, /metrics."""
