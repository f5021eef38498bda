"""The tail every benchmark plot shares: label the last axes, lay the figure out, write the PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def finish(
    fig: Any, ax: Any, path: str | Path, *, ylabel: str, title: str, dpi: int, xlabel: str | None = None
):
    """Label ``ax`` (with its legend), lay ``fig`` out and save it to ``path``."""
    if xlabel is not None:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
