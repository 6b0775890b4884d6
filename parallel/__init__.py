"""Sequence parallelism: ring attention and sharded-KV decode."""
