"""Hugging Face Hub access through huggingface_hub: file listing, downloads, header reads.

Everything reads its settings (HF_ENDPOINT, HF_HUB_OFFLINE, HF_HUB_CACHE / HF_HOME, HF_TOKEN)
when a Hub is made, so tests and users can point it elsewhere without re-importing.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import huggingface_hub
from huggingface_hub import HfApi, hf_hub_download, hf_hub_url, scan_cache_dir
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

from . import gguf_check
from ..errors import SpecLlamaError

def _network_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "the Hub could not be reached", whichever HTTP client hub uses."""
    errors: list[type[BaseException]] = [HfHubHTTPError, OSError]
    for module_name in ("httpx2", "httpx", "requests"):
        try:
            module = __import__(module_name)
        except ImportError:
            continue
        for name in ("HTTPError", "TransportError", "RequestException"):
            if isinstance(getattr(module, name, None), type):
                errors.append(getattr(module, name))
    return tuple(errors)


NETWORK_ERRORS = _network_errors()
SPLIT_RE = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
FIRST_READ = 256 * 1024


class HubError(SpecLlamaError):
    """The Hub could not give us a file: not found, gated, offline and not cached."""


@dataclass
class HeaderRead:
    """A GGUF header read with range requests, or the reason it was abandoned early."""

    fields: dict
    array_lengths: dict
    n_bytes_fetched: int
    complete: bool
    file_size: int


@dataclass
class Hub:
    endpoint: Optional[str] = None
    cache_dir: Optional[Path] = None
    offline: bool = False
    token: Optional[str] = None
    _api: Any = field(default=None, repr=False)
    _reachable: Optional[bool] = field(default=None, repr=False)

    @classmethod
    def from_env(cls) -> "Hub":
        env = os.environ
        cache = env.get("HF_HUB_CACHE") or (str(Path(env["HF_HOME"]) / "hub") if env.get("HF_HOME") else None)
        offline = env.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        return cls(endpoint=env.get("HF_ENDPOINT") or None, cache_dir=Path(cache) if cache else None,
                   offline=offline, token=env.get("HF_TOKEN") or None)

    @property
    def api(self) -> HfApi:
        if self._api is None:
            self._api = HfApi(endpoint=self.endpoint, token=self.token)
        return self._api

    # --- listing ------------------------------------------------------------------------------

    def gguf_files(self, repo_id: str, revision: Optional[str] = None) -> tuple[str, dict[str, int]]:
        """(commit sha, {filename: size}) of the .gguf files in repo_id; from the cache offline."""
        if self.offline or self._reachable is False:
            return self._cached_files(repo_id, revision)
        try:
            info = self.api.model_info(repo_id, revision=revision, files_metadata=True)
        except GatedRepoError:
            raise HubError(f"{repo_id} is gated: accept its terms on the Hub, then set HF_TOKEN") from None
        except RepositoryNotFoundError:
            raise HubError(f"repository {repo_id} not found on the Hub (check the name, or set HF_TOKEN "
                           "for a private repo)") from None
        except RevisionNotFoundError:
            raise HubError(f"{repo_id} has no revision {revision!r}") from None
        except NETWORK_ERRORS:
            self._reachable = False
            return self._cached_files(repo_id, revision)
        files = {s.rfilename: (s.size or 0) for s in info.siblings or [] if s.rfilename.lower().endswith(".gguf")}
        return info.sha or "", files

    def _cached_files(self, repo_id: str, revision: Optional[str]) -> tuple[str, dict[str, int]]:
        for repo in self._scan():
            if repo.repo_id == repo_id and repo.repo_type == "model":
                for rev in sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True):
                    if revision is None or revision == rev.commit_hash or revision in rev.refs:
                        return rev.commit_hash, {f.file_name: f.size_on_disk for f in rev.files
                                                 if f.file_name.lower().endswith(".gguf")}
        if self.offline:
            raise HubError(f"{repo_id} is not in the local Hugging Face cache and the Hub is offline "
                           "(unset HF_HUB_OFFLINE and connect once to download it)")
        raise HubError(f"cannot reach the Hub for {repo_id} and it is not in the local Hugging Face cache "
                       "(check the network, or set HF_ENDPOINT)")

    def _scan(self) -> list:
        try:
            return list(scan_cache_dir(self.cache_dir).repos)
        except huggingface_hub.CacheNotFound:
            return []

    def cached_ggufs(self) -> list[tuple[str, str, Path]]:
        """(repo_id, filename, path) for every GGUF in the local HF cache."""
        out = []
        for repo in self._scan():
            for rev in repo.revisions:
                for f in rev.files:
                    if f.file_name.lower().endswith(".gguf"):
                        out.append((repo.repo_id, str(f.file_path.relative_to(rev.snapshot_path)), f.file_path))
        return out

    def reachable(self) -> bool:
        """One quick request, without huggingface_hub's retries: is the Hub there at all?

        Lets draft search on a machine without network give up in seconds, not after a minute
        of backed-off retries.
        """
        if self.offline:
            return False
        if self._reachable is None:
            url = f"{self.endpoint or huggingface_hub.constants.ENDPOINT}/api/models"
            try:
                get_session().get(url, params={"limit": 1}, timeout=5)
                self._reachable = True
            except NETWORK_ERRORS:
                self._reachable = False
        return self._reachable

    def search(self, **query: Any) -> list:
        """HfApi.list_models(**query); an empty list offline or when the Hub is unreachable."""
        if not self.reachable():
            return []
        try:
            return list(self.api.list_models(**query))
        except NETWORK_ERRORS:
            return []

    # --- files --------------------------------------------------------------------------------

    def download(self, repo_id: str, filename: str, revision: Optional[str] = None,
                 sha256: Optional[dict[str, str]] = None) -> Path:
        """Download (or find in the cache) filename and, for split GGUFs, all its parts.

        sha256 maps "repo_id/file" to an expected digest; a file that does not match is removed
        from the cache and HubError is raised. Returns the path of the file, or of part 1 for a
        split GGUF (llama.cpp loads the rest).
        """
        names = [filename]
        m = SPLIT_RE.search(filename)
        if m:
            n_parts = int(m.group(2))
            names = [filename[:m.start()] + f"-{i:05d}-of-{n_parts:05d}.gguf" for i in range(1, n_parts + 1)]
        paths = []
        for name in names:
            try:
                paths.append(Path(hf_hub_download(repo_id, name, revision=revision, cache_dir=self.cache_dir,
                                                  endpoint=self.endpoint, token=self.token,
                                                  local_files_only=self.offline)))
            except GatedRepoError:
                raise HubError(f"{repo_id} is gated: accept its terms on the Hub, then set HF_TOKEN") from None
            except RepositoryNotFoundError:
                raise HubError(f"repository {repo_id} not found on the Hub") from None
            except (LocalEntryNotFoundError, OfflineModeIsEnabled):
                raise HubError(f"{repo_id}/{name} is not cached and the Hub cannot be reached "
                               "(connect once, or unset HF_HUB_OFFLINE)") from None
            except OSError as e:
                if getattr(e, "errno", None) == 28:
                    raise HubError(f"no space left on device while downloading {repo_id}/{name}; "
                                   "free some space or set HF_HOME to a larger disk") from None
                raise
            expected = (sha256 or {}).get(f"{repo_id}/{name}")
            if expected is not None:
                _verify_sha256(paths[-1], expected, f"{repo_id}/{name}")
        return paths[0]

    def read_header(self, repo_id: str, filename: str, revision: Optional[str] = None,
                    reject: Any = None) -> HeaderRead:
        """Read a remote GGUF's metadata with HTTP range requests, never its weights.

        reject(partial_fields, array_lengths) may return a reason to stop early. Local cache
        copies are read from disk instead.
        """
        cached = self._cached_path(repo_id, filename, revision)
        if cached is not None:
            try:
                h = gguf_check.read_header(cached)
            except gguf_check.InvalidModelFileError as e:
                raise HubError(str(e)) from None
            return HeaderRead(h.fields, {}, 0, True, cached.stat().st_size)
        if self.offline:
            raise HubError(f"{repo_id}/{filename} is not cached and the Hub is offline")
        url = hf_hub_url(repo_id, filename, revision=revision, endpoint=self.endpoint)
        headers = build_hf_headers(token=self.token)
        buf = bytearray()
        want, size = FIRST_READ, None
        n_fetched = 0
        while True:
            try:
                r = get_session().get(url, headers={**headers, "Range": f"bytes={len(buf)}-{want - 1}"},
                                      follow_redirects=True)
            except NETWORK_ERRORS as e:
                raise HubError(f"cannot reach the Hub for {repo_id}/{filename} ({type(e).__name__})") from None
            try:
                hf_raise_for_status(r)
            except GatedRepoError:
                raise HubError(f"{repo_id} is gated: accept its terms on the Hub, then set HF_TOKEN") from None
            except RepositoryNotFoundError:
                raise HubError(f"repository {repo_id} not found on the Hub") from None
            if r.status_code != 206:
                raise HubError(f"the Hub ignored a range request for {repo_id}/{filename}")
            size = int(r.headers["Content-Range"].rsplit("/", 1)[1])
            buf += r.content
            n_fetched += len(r.content)
            try:
                h = gguf_check.parse(buf, size, metadata_only=True)
                return HeaderRead(h.fields, {}, n_fetched, True, size)
            except gguf_check.NeedMoreBytes as e:
                if reject is not None and reject(e.partial, e.array_lengths):
                    return HeaderRead(e.partial, e.array_lengths, n_fetched, False, size)
                if len(buf) >= size:
                    raise HubError(f"{repo_id}/{filename}: the GGUF header runs past the end of the file")
                want = min(size, max(e.n_bytes, 2 * len(buf)))
            except ValueError as e:
                raise HubError(f"{repo_id}/{filename} is not a valid GGUF: {e}") from None

    def _cached_path(self, repo_id: str, filename: str, revision: Optional[str]) -> Optional[Path]:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, filename, cache_dir=self.cache_dir, revision=revision)
        return Path(found) if isinstance(found, str) else None



def _verify_sha256(path: Path, expected: str, label: str) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    if digest.hexdigest() != expected:
        blob = path.resolve()
        path.unlink(missing_ok=True)
        blob.unlink(missing_ok=True)  # the cache's blob behind the snapshot link
        raise HubError(f"{label} does not match its SHA-256 in models.toml (got {digest.hexdigest()[:16]}..., "
                       f"expected {expected[:16]}...); the file was removed, download it again")
