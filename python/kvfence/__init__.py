"""kvfence for Python engines.

- ``Client``: admits a request through kvctld (both pools or neither) and runs it through
  prefill, transfer and verification; ``KvfenceError(code, message)`` when refused.
- ``Worker``: prefilld or decoded inside an engine's process (see ``kvfence.connector``).
- ``kvfence.connector.KvfenceConnector``: a vLLM KV connector over those.
- ``python -m kvfence.proxy``: the OpenAI-compatible front of a prefill and a decode vLLM.
"""

from ._native import HANDED_OFF, Client, KvfenceError, Worker

__all__ = ["Client", "Worker", "KvfenceError", "HANDED_OFF"]
