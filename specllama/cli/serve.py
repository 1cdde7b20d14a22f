"""specllama serve and specllama worker: this machine as a server."""

from __future__ import annotations

import os
import signal
from typing import Any, Optional

import click

from .app import main, setup_logging
from .options import ModelChoice, model_options


@main.command("serve")
@model_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (loopback only by default).")
@click.option("--port", type=int, default=8080, show_default=True)
@click.option("--api-key", "api_keys", envvar="SPECLLAMA_API_KEY", multiple=True,
              help="Require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every endpoint but /health and /. "
                   "Repeat it for several clients (SPECLLAMA_API_KEY: keys separated by spaces); an empty key is "
                   "refused.")
@click.option("--allowed-hosts", default=None, envvar="SPECLLAMA_ALLOWED_HOSTS",
              help="Comma-separated Host header names served, or * for any. Default: any with --api-key or a "
                   "non-loopback --host; otherwise only 127.0.0.1, localhost and [::1] (a web page that rebinds "
                   "its name to this machine cannot drive the server).")
@click.option("--cache-scope", type=click.Choice(["key", "shared"]), default=None,
              help="Whose requests may reuse a cached prompt: 'key' (the default with --api-key) only requests "
                   "with the same key, so one client's cached prompt never shows in another's cached_tokens; "
                   "'shared': every request.")
@click.option("--limit", "limits", multiple=True, metavar="NAME=VALUE",
              help="Change one of the server's limits (repeatable): body_mb, prompts, choices, stop, stop_chars, "
                   "messages, tools, input_extra, grammar_kb, queue, send_timeout, backlog. Defaults and meanings: "
                   "docs/server.md, 'Limits and security'.")
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
def serve_cmd(choice: ModelChoice, host: str, port: int, api_keys: tuple[str, ...], allowed_hosts: Optional[str],
              cache_scope: Optional[str], limits: tuple[str, ...], model_id: Optional[str], strict_model: bool,
              cors_origins: str, n_parallel: int, batch_requests: Optional[bool]) -> None:
    """Serve MODEL over OpenAI-compatible APIs (/v1/chat/completions, /v1/completions)."""
    setup_logging(choice.verbose)
    try:
        import uvicorn

        from ..server import create_app
        from ..server.guard import LOOPBACK_HOSTS, access
        from ..server.limits import ServerLimits
    except ImportError as e:
        raise click.ClickException(f"specllama serve needs the server extra ({e.name} is missing): "
                                   "pip install -e '.[server]' in your specllama checkout") from None
    # checked before anything resolves or loads; a blank SPECLLAMA_API_KEY splits into no keys at all,
    # as much an unset variable as --api-key ""
    blank_env = not api_keys and "SPECLLAMA_API_KEY" in os.environ and not os.environ["SPECLLAMA_API_KEY"].strip()
    try:
        access([""] if blank_env else api_keys, None, cache_scope)
    except ValueError as e:
        raise click.BadParameter(f"{e} (an unset variable in a script?)", param_hint="--api-key") from None
    try:
        server_limits = ServerLimits.parse(limits)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--limit") from None
    target_path, _ = choice.resolve()
    name = model_id or target_path.stem
    loopback = host in LOOPBACK_HOSTS
    if not loopback:
        click.echo(f"warning: listening on {host}, reachable from other machines"
                   + ("" if api_keys else " with no --api-key"), err=True)
    # None: create_app's default (any name with a key, loopback names without)
    hosts = [h.strip() for h in allowed_hosts.split(",") if h.strip()] if allowed_hosts is not None else \
        None if loopback else ["*"]
    click.echo(f"serving {name} on http://{host}:{port}/v1 (loading the model; /health says when it is ready)",
               err=True)
    origins = [o.strip() for o in cors_origins.split(",") if o.strip()]
    share = "auto" if batch_requests is None else batch_requests
    from ..measuring.idle import idle_wanted

    idle = idle_wanted(default=True)  # a server owns its process: it measures between requests
    app = create_app(lambda: choice.open(n_parallel=n_parallel, batch_requests=share, idle_work=idle), name,
                     list(api_keys), cors_origins=origins, strict_model=strict_model, n_parallel=n_parallel,
                     allowed_hosts=hosts, limits=server_limits,
                     cache_scope=cache_scope)
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
