"""specllama serve and specllama worker: this machine as a server."""

from __future__ import annotations

import signal
from typing import Any, Optional

import click

from .app import main, setup_logging
from .options import ModelChoice, model_options


@main.command("serve")
@model_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (loopback only by default).")
@click.option("--port", type=int, default=8080, show_default=True)
@click.option("--api-key", envvar="SPECLLAMA_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every endpoint but /health.")
@click.option("--model-id", default=None, help="Name to serve the model under (default: the target file's stem).")
@click.option("--strict-model", is_flag=True,
              help="Answer 404 to requests naming another model (default: serve this one whatever the name).")
@click.option("--cors-origins", default="", envvar="SPECLLAMA_CORS_ORIGINS",
              help="Comma-separated origins browser apps may call from, or * for any (default: none).")
@click.option("--parallel", "-np", "n_parallel", type=click.IntRange(1, 64), default=4, show_default=True,
              help="Requests generating at once. Others wait in arrival order.")
@click.option("--batch-requests/--no-batch-requests", default=None,
              help="Decode the requests' rows of a round in one pass (a target and a draft context of N lanes, "
                   "N x --ctx KV cells; bitwise and seeded requests keep contexts of their own). Default: where "
                   "the difference a lane's rows carry (measured at the first load) is within the --exact "
                   "level's bound and memory allows; otherwise, and with --no-batch-requests, each request "
                   "decodes in contexts of its own (made when first needed) and their rounds take turns.")
def serve_cmd(choice: ModelChoice, host: str, port: int, api_key: Optional[str], model_id: Optional[str],
              strict_model: bool, cors_origins: str, n_parallel: int, batch_requests: Optional[bool]) -> None:
    """Serve MODEL over OpenAI-compatible APIs (/v1/chat/completions, /v1/completions)."""
    setup_logging(choice.verbose)
    try:
        import uvicorn

        from ..server import create_app
    except ImportError as e:
        raise click.ClickException(f"specllama serve needs the server extra ({e.name} is missing): "
                                   "pip install 'specllama[server]'") from None
    target_path, _ = choice.resolve()
    name = model_id or target_path.stem
    if host not in ("127.0.0.1", "localhost", "::1"):
        click.echo(f"warning: listening on {host}, reachable from other machines"
                   + ("" if api_key else " with no --api-key"), err=True)
    click.echo(f"serving {name} on http://{host}:{port}/v1 (loading the model; /health says when it is ready)",
               err=True)
    origins = [o.strip() for o in cors_origins.split(",") if o.strip()]
    share = "auto" if batch_requests is None else batch_requests
    app = create_app(lambda: choice.open(n_parallel=n_parallel, batch_requests=share), name, api_key,
                     cors_origins=origins, strict_model=strict_model, n_parallel=n_parallel)
    server = _server(uvicorn.Config(app, host=host, port=port, log_level="info" if choice.verbose else "warning"))
    server.run()
    if server.stopped_by == signal.SIGINT:  # Ctrl-C: the shell's convention, as every other command
        click.get_current_context().exit(130)


def _server(config: Any) -> Any:
    """uvicorn's server, remembering in .stopped_by which signal stopped it."""
    import uvicorn

    class Server(uvicorn.Server):
        stopped_by: Optional[int] = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            self.stopped_by = sig
            super().handle_exit(sig, frame)

    return Server(config)


@main.command("worker")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. llama.cpp's RPC protocol has no authentication: keep it on a trusted "
                   "network.")
@click.option("--port", type=click.IntRange(1, 65535), default=50052, show_default=True)
@click.option("--cache", "cache_dir", type=click.Path(file_okay=False), default=None,
              help="Keep received tensors here, so a reload sends only their hashes.")
@click.option("--threads", "-t", "n_threads", type=click.IntRange(1), default=None,
              help="CPU threads when serving the CPU (default: all this process may use).")
def worker_cmd(host: str, port: int, cache_dir: Optional[str], n_threads: Optional[int]) -> None:
    """Serve this machine's GPU (or CPU) to a specllama or llama.cpp client over llama.cpp's RPC
    backend, until interrupted. Clients use it with --rpc HOST:PORT."""
    import ipaddress
    import os
    import signal
    import threading

    from ..runtime.rpc import serve_rpc
    from ..runtime.settings import cpu_count

    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        loopback = False
    if not loopback:
        click.echo(f"warning: listening on {host}. llama.cpp's RPC protocol has no authentication or encryption: "
                   "anyone who can reach this port can run code on its devices and read what they hold. "
                   "Use it only on a network you trust.", err=True)
    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
    endpoint = f"{host}:{port}"
    served = serve_rpc(endpoint, cache_dir, n_threads or cpu_count())
    for device in served:
        click.echo(f"worker: serving {device.name} ({device.description}), {device.free / 2**30:.1f} GiB free "
                   f"of {device.total / 2**30:.1f} GiB", err=True)
    click.echo(f"worker: listening on {endpoint}; use it with --rpc {endpoint} (Ctrl-C stops it)", err=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):  # the server runs in ggml's thread; this one waits for a signal
            pass
    except KeyboardInterrupt:
        pass
    click.echo("worker: stopped", err=True)
