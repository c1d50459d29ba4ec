"""`lmd serve`: the OpenAI-compatible HTTP server over the engine (docs/serve.md)."""
