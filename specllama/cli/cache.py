"""`specllama cache`: what the prompt cache keeps on disk (--prompt-cache-dir), and clearing it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

import click

from ..caching.disk_cache import SUFFIX, listing
from .app import main


@main.command("cache")
@click.option("--prompt-cache-dir", "folder", type=click.Path(file_okay=False), envvar="SPECLLAMA_PROMPT_CACHE_DIR",
              default=None, help="The folder (default: $SPECLLAMA_PROMPT_CACHE_DIR).")
@click.option("--clear", is_flag=True, help="Delete every saved state in the folder.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per state.")
def cache_cmd(folder: Optional[str], clear: bool, as_json: bool) -> None:
    """List the prompt-cache states kept on disk (model, tokens, size, last use), or clear them."""
    if folder is None:
        raise click.UsageError("no folder: pass --prompt-cache-dir DIR or set SPECLLAMA_PROMPT_CACHE_DIR")
    path = Path(folder).expanduser()
    files = sorted(path.glob(f"*{SUFFIX}")) if path.is_dir() else []
    if clear:
        n_bytes = sum(f.stat().st_size for f in files)
        for f in files:
            f.unlink(missing_ok=True)
        click.echo(f"{path}: removed {len(files)} state{'s' * (len(files) != 1)} ({n_bytes / 2**20:.1f} MiB)")
        return
    entries = listing(path)
    rows: list[dict[str, Any]] = [{"file": e.path.name, "model": e.model, "tokens": e.n_tokens, "scope": e.scope,
             "bytes": e.path.stat().st_size, "last_used": e.path.stat().st_mtime} for e in entries]
    if as_json:
        for row in rows:
            click.echo(json.dumps(row))
        return
    n_bytes = sum(r["bytes"] for r in rows)
    click.echo(f"{path}: {len(rows)} state{'s' * (len(rows) != 1)}, {n_bytes / 2**20:.1f} MiB"
               + (f" ({len(files) - len(rows)} unreadable)" if len(files) > len(rows) else ""))
    if rows:
        click.echo(f"  {'model':<44} {'tokens':>7} {'MiB':>8}  last used")
    for r in sorted(rows, key=lambda r: -r["last_used"]):
        ago = time.time() - r["last_used"]
        when = f"{ago / 86400:.0f} d ago" if ago > 86400 else f"{ago / 3600:.0f} h ago" if ago > 3600 \
            else f"{ago / 60:.0f} min ago"
        click.echo(f"  {r['model'][:44]:<44} {r['tokens']:>7} {r['bytes'] / 2**20:>8.1f}  {when}")
