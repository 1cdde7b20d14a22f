"""The click group, its error handling and logging."""

from __future__ import annotations

import logging
from typing import Any

import click

from .. import __version__
from ..errors import SpecLlamaError, exit_interrupted


class _Group(click.Group):
    """Formats specllama's errors as one line (full traceback with --verbose); Ctrl-C exits 130."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except SpecLlamaError as e:
            if ctx.meta.get("specllama.verbose"):
                raise
            raise click.ClickException(f"{type(e).__name__}: {e}") from None
        except KeyboardInterrupt:
            exit_interrupted()


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="specllama")
def main() -> None:
    """Faster GGUF generation with a draft model, with the target model's exact output."""


def setup_logging(verbose: bool) -> None:
    """specllama's own notes as "specllama: ..." on stderr; other libraries' only with --verbose."""
    logger = logging.getLogger("specllama")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("specllama: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    if not verbose:
        logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
