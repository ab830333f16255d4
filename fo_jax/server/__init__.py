"""`fo-jax serve`: an OpenAI-compatible HTTP server over `fo_jax.engine.Engine`.

`driver` (the engine thread and its queues) needs nothing beyond fo_jax; `app`, `protocol` and
`serve` need fastapi, uvicorn and prometheus_client.
"""

from fo_jax.server.driver import EngineDriver, NotAccepting, QueueFull

__all__ = ["EngineDriver", "NotAccepting", "QueueFull"]
