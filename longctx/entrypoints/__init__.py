"""How users reach the engine: the Python API (``api.LLM``), the command line (``cli``), the
OpenAI-compatible server (``server``), resumable JSONL jobs (``batch``, ``ray_batch``), the
long-document tasks (``tasks``: summarize, ask) and ``torchrun`` launches. They talk to the
engine through its facade (``LLMEngine.check_request``, ``stats``, ``kv_capacity_tokens``,
``kv_usage``, ...), never its scheduler, pool or prefix store.
"""
