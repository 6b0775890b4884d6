"""Starting and stopping ``longctx serve``: bind, load the engine, run uvicorn, exit cleanly.

Owns: the listening socket (bound before the model loads, so a busy port fails in a second),
building the one engine, and the process's signal behaviour. Never: request handling.

SIGTERM and Ctrl-C stop accepting connections, let in-flight requests finish for up to
``graceful_shutdown_timeout`` seconds (then cancel them), stop the engine thread, and return.
"""

from __future__ import annotations

import asyncio
import ipaddress
import signal
import socket
import sys
from typing import Any

import uvicorn

from longctx.config import ConfigError, split_engine_kwargs
from longctx.engine.llm_engine import LLMEngine
from longctx.model.loader import resolve_model
from longctx.entrypoints.server.app import create_app
from longctx.entrypoints.server.config import ServerConfig
from longctx.entrypoints.server.engine_loop import EngineLoop
from longctx.entrypoints.server.metrics import ServerMetrics

SHUTDOWN_BACKSTOP_SECONDS = 5.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def run_server(server_config: ServerConfig, engine_kwargs: dict[str, Any]) -> int:
    """Serve until SIGTERM or Ctrl-C; returns the process exit code (0 after a clean stop)."""
    configs = split_engine_kwargs(engine_kwargs)
    load = configs[0]
    config = server_config.resolved(load.model)
    resolve_model(load.model)  # a wrong model name fails before anything else happens
    sock = bind(config.host, config.port)
    try:
        print(f"loading {load.model} ...", file=sys.stderr, flush=True)
        engine_loop = EngineLoop(LLMEngine(*configs), ServerMetrics(), config.max_queued_requests)
        app = create_app(engine_loop, config)
        server = _GracefulServer(uvicorn.Config(
            app, log_level=config.log_level, lifespan="on",
            timeout_graceful_shutdown=config.graceful_shutdown_timeout + SHUTDOWN_BACKSTOP_SECONDS),
            engine_loop, config.graceful_shutdown_timeout)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        warning = exposure_warning(host, config.api_key)
        if warning:
            print(warning, file=sys.stderr, flush=True)
        print(f"serving '{config.served_model_name}' on http://{shown}:{port}/v1 "
              f"(api key {'required' if config.api_key else 'off'}); stop with Ctrl-C or SIGTERM",
              file=sys.stderr, flush=True)
        # uvicorn re-raises the signal it stopped on once it is done, which would end the
        # process as "killed by SIGTERM" (or KeyboardInterrupt); after a clean shutdown the
        # exit code should be 0.
        previous = {sig: signal.signal(sig, _after_shutdown) for sig in STOP_SIGNALS}
        try:
            server.run(sockets=[sock])
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            engine_loop.engine.close()  # persists the prefix store, stops sequence-parallel ranks
    finally:
        sock.close()
    return 0 if server.started else 1


class _GracefulServer(uvicorn.Server):
    """uvicorn, plus: once shutdown starts, requests in flight get ``timeout`` seconds to end,
    then the engine cancels them, so each client gets an error event and ``[DONE]`` (or a 503)
    rather than a cut connection. uvicorn's own timeout, a little later, is the backstop."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop, timeout: float) -> None:
        super().__init__(config)
        self.engine_loop, self.timeout = engine_loop, timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self.timeout, self.engine_loop.cancel_all)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def exposure_warning(host: str, api_key: str) -> str | None:
    """A warning line when the server listens beyond this machine without an API key."""
    if api_key:
        return None
    try:
        loopback = ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:  # a host name: loopback only if it is localhost
        loopback = host == "localhost"
    if loopback:
        return None
    return (f"warning: listening on {host} without an API key: anyone who can reach this address "
            f"can use the model and read its API; pass --api-key (or set $LONGCTX_API_KEY)")


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``, or a ``ConfigError`` that says why not."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as err:
        raise ConfigError(f"cannot listen on {host}:{port}: {err}") from err
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as err:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {err.strerror or err}") from err
    return sock


def _after_shutdown(signum: int, frame: Any) -> None:
    """Stands in for the default action of a stop signal once uvicorn has shut down."""
