"""Server configuration: the knobs of ``longctx serve`` that are not engine knobs.

Owns: one frozen dataclass whose fields become CLI flags (like the engine's configs), and
its checks. Never: behaviour, torch, or reading files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from longctx.config import ConfigError

API_KEY_ENV = "LONGCTX_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on (0.0.0.0: all)"})
    port: int = field(default=8000, metadata={"help": "TCP port (0: any free port)"})
    api_key: str = field(default="", metadata={
        "help": f"require 'Authorization: Bearer KEY' on /v1/* (or set ${API_KEY_ENV})"})
    served_model_name: str = field(default="", metadata={
        "help": "the model name clients send (empty: the --model value)"})
    max_queued_requests: int = field(default=64, metadata={
        "help": "requests that may wait for a running slot; more get 429"})
    max_request_bytes: int = field(default=8 << 20, metadata={
        "help": "largest request body in bytes; larger gets 413"})
    graceful_shutdown_timeout: float = field(default=30.0, metadata={
        "help": "seconds in-flight requests may run after SIGTERM before they are cancelled"})
    log_level: str = field(default="info", metadata={"help": " | ".join(LOG_LEVELS)})

    def __post_init__(self) -> None:
        checks = [
            (bool(self.host), "host must not be empty"),
            (0 <= self.port <= 65535, f"port must be in [0, 65535], got {self.port}"),
            (self.max_queued_requests >= 0,
             f"max_queued_requests must be >= 0, got {self.max_queued_requests}"),
            (self.max_request_bytes >= 1024,
             f"max_request_bytes must be >= 1024, got {self.max_request_bytes}"),
            (self.graceful_shutdown_timeout >= 0,
             f"graceful_shutdown_timeout must be >= 0, got {self.graceful_shutdown_timeout}"),
            (self.log_level in LOG_LEVELS,
             f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    def resolved(self, model: str) -> ServerConfig:
        """Fill the defaults that depend on the model and the environment."""
        return replace(self, api_key=self.api_key or os.environ.get(API_KEY_ENV, ""),
                       served_model_name=self.served_model_name or model)
