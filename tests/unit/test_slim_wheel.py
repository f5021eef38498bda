"""``scripts/slim_wheel.py``: a transformers wheel cut to some model families for the device script keeps
everything outside ``models/``, the families named, and a RECORD that lists exactly what it holds."""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("slim_wheel", ROOT / "scripts" / "slim_wheel.py")
slim_wheel = importlib.util.module_from_spec(spec)
spec.loader.exec_module(slim_wheel)

FILES = [
    "transformers/__init__.py",
    "transformers/models/__init__.py",
    "transformers/models/auto/modeling_auto.py",
    "transformers/models/llama/modeling_llama.py",
    "transformers/models/bert/modeling_bert.py",
    "transformers/models/bert/__init__.py",
    "transformers/utils/import_utils.py",
]


def test_only_the_named_families_stay_and_record_lists_what_is_held(tmp_path):
    wheel = tmp_path / "transformers-5.24.0-py3-none-any.whl"
    record = "transformers-5.24.0.dist-info/RECORD"
    with zipfile.ZipFile(wheel, "w") as z:
        for name in FILES:
            z.writestr(name, f"# {name}\n" * 50)
        z.writestr(record, "".join(f"{n},sha256=x,1\n" for n in [*FILES, record]))
    slim_wheel.slim(wheel, {"auto", "llama"})
    with zipfile.ZipFile(wheel) as z:
        held = set(z.namelist())
        listed = {line.split(",")[0] for line in z.read(record).decode().splitlines() if line}
        kept_text = z.read("transformers/models/llama/modeling_llama.py").decode()
    assert held == set(FILES) - {
        "transformers/models/bert/modeling_bert.py",
        "transformers/models/bert/__init__.py",
    } | {record}
    assert listed == held
    assert kept_text == "# transformers/models/llama/modeling_llama.py\n" * 50
