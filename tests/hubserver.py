"""A small Hugging Face Hub stand-in on 127.0.0.1, for tests that use the real huggingface_hub.

It implements only what specllama's Hub code calls: model search (/api/models), model info
(/api/models/{repo}[/revision/{rev}]) and file resolve (HEAD/GET with ETag, X-Repo-Commit and
Range). It counts the bytes served per file, so tests can prove weights were never fetched.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse


@dataclass
class Repo:
    repo_id: str
    files: dict[str, Path]
    downloads: int = 0
    gated: bool = False
    tags: list[str] = field(default_factory=lambda: ["gguf"])

    @property
    def sha(self) -> str:
        return hashlib.sha1(self.repo_id.encode()).hexdigest()


class HubServer:
    def __init__(self, repos: list[Repo]):
        self.repos = {r.repo_id: r for r in repos}
        self.bytes_served: dict[tuple[str, str], int] = {}
        self.drop_after: dict[tuple[str, str], int] = {}  # cut the next full download after N bytes
        self.requests: list[str] = []
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                server._handle(self, head=True)

            def do_GET(self):
                server._handle(self, head=False)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def start(self) -> "HubServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def served(self, repo_id: str) -> int:
        return sum(n for (r, _), n in self.bytes_served.items() if r == repo_id)

    # --- request handling -----------------------------------------------------------------

    def _handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        url = urlparse(h.path)
        path = unquote(url.path)
        query = parse_qs(url.query)
        with self._lock:
            self.requests.append(f"{h.command} {h.path}")
        if path == "/api/models":
            return self._json(h, self._search(query))
        m = re.match(r"^/api/models/([^/]+/[^/]+?)(?:/revision/([^/]+))?$", path)
        if m:
            repo = self._repo(h, m.group(1))
            if repo is not None:
                self._json(h, self._info(repo))
            return
        m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        if m:
            repo = self._repo(h, m.group(1))
            if repo is not None:
                self._file(h, repo, m.group(3), head)
            return
        self._error(h, 404, "EntryNotFound", "no such endpoint")

    def _repo(self, h, repo_id: str):
        repo = self.repos.get(repo_id)
        if repo is None:
            self._error(h, 404, "RepoNotFound", f"Repository {repo_id} not found")
            return None
        if repo.gated and not h.headers.get("authorization"):
            self._error(h, 401, "GatedRepo", "Access to model is restricted; you must be authenticated")
            return None
        return repo

    def _search(self, query: dict) -> list[dict]:
        search = (query.get("search") or [""])[0].lower()
        filters = query.get("filter") or []
        author = (query.get("author") or [None])[0]
        found = []
        for repo in self.repos.values():
            if search and search not in repo.repo_id.lower():
                continue
            if any(f not in repo.tags for f in filters):
                continue
            if author and repo.repo_id.split("/")[0] != author:
                continue
            found.append(repo)
        found.sort(key=lambda repo: -repo.downloads)
        out = [{"id": repo.repo_id, "modelId": repo.repo_id, "author": repo.repo_id.split("/")[0],
                "downloads": repo.downloads, "tags": repo.tags, "gated": repo.gated, "private": False}
               for repo in found]
        limit = int((query.get("limit") or [1000])[0])
        return out[:limit]

    def _info(self, repo: Repo) -> dict:
        return {"id": repo.repo_id, "modelId": repo.repo_id, "sha": repo.sha, "downloads": repo.downloads,
                "tags": repo.tags, "gated": repo.gated, "private": False,
                "siblings": [{"rfilename": name, "size": p.stat().st_size, "blobId": self._etag(p)}
                             for name, p in repo.files.items()]}

    @staticmethod
    def _etag(p: Path) -> str:
        st = p.stat()
        return hashlib.sha256(f"{p.name}|{st.st_size}".encode()).hexdigest()

    def _file(self, h, repo: Repo, name: str, head: bool) -> None:
        p = repo.files.get(name)
        if p is None:
            return self._error(h, 404, "EntryNotFound", f"{name} not in {repo.repo_id}")
        size = p.stat().st_size
        start, end = 0, size - 1
        status = 200
        rng = h.headers.get("Range")
        if rng:
            m = re.match(r"bytes=(\d+)-(\d*)", rng)
            assert m is not None, rng
            start = int(m.group(1))
            end = min(int(m.group(2)) if m.group(2) else size - 1, size - 1)
            status = 206
        h.send_response(status)
        h.send_header("ETag", f'"{self._etag(p)}"')
        h.send_header("X-Repo-Commit", repo.sha)
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Length", str(end - start + 1))
        if status == 206:
            h.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        h.end_headers()
        if head:
            return
        drop = self.drop_after.pop((repo.repo_id, name), None) if end - start + 1 > 1 << 20 else None
        with open(p, "rb") as f:
            f.seek(start)
            left = end - start + 1
            sent = 0
            while left > 0:
                if drop is not None and sent >= drop:
                    h.close_connection = True
                    h.connection.shutdown(2)  # the network goes away mid-file
                    return
                block = f.read(min(left, 1 << 20))
                try:
                    h.wfile.write(block)
                except (BrokenPipeError, ConnectionResetError):
                    break
                left -= len(block)
                sent += len(block)
                with self._lock:
                    key = (repo.repo_id, name)
                    self.bytes_served[key] = self.bytes_served.get(key, 0) + len(block)

    def _json(self, h, data) -> None:
        body = json.dumps(data).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)

    def _error(self, h, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)
