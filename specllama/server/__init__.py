"""`specllama serve`: an HTTP server on SpecLlama's one generate path.

app.py holds what every API shares (loading, authentication, CORS, errors, /health,
/metrics, /v1/models); each wire format is a translator module of its own that turns its
requests into the engine's options and the engine's chunks back into its own events:
openai_chat (OpenAI chat completions and completions). No translator decodes or samples.
Needs the `server` extra (FastAPI, uvicorn, sse-starlette, prometheus-client), imported only
by this package.
"""

from .app import create_app

__all__ = ["create_app"]
