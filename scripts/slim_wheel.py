"""A wheel of transformers cut to a few model families, rewritten in place (scripts/prepare_gpu.sh).

    python scripts/slim_wheel.py transformers-X-py3-none-any.whl auto llama qwen2 qwen3

transformers finds its model families by listing ``transformers/models/`` and imports one only when
it is used, so a wheel without the others imports and runs those kept as the whole one does. Its
RECORD keeps the kept files' lines (their hashes are unchanged), so pip installs it as any wheel.
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path


def kept(name: str, families: set[str]) -> bool:
    parts = name.split("/")
    if parts[:2] != ["transformers", "models"] or len(parts) < 4:
        return True  # outside models/, or models/__init__.py itself
    return parts[2] in families


def slim(path: Path, families: set[str]) -> tuple[int, int]:
    """Rewrite ``path`` keeping ``families``; its size (bytes) before and after."""
    before = path.stat().st_size
    tmp = path.with_suffix(".slim")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = "\n".join(x for x in lines if kept(x.split(",")[0], families)).encode() + b"\n"
            elif not kept(info.filename, families):
                continue
            dst.writestr(info, data)
    tmp.replace(path)
    return before, path.stat().st_size


if __name__ == "__main__":
    wheel, families = Path(sys.argv[1]), set(sys.argv[2:])
    before, after = slim(wheel, families)
    kept_names = ", ".join(sorted(families))
    print(f"{wheel.name}: {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB ({kept_names})")
