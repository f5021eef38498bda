"""The three distributions' metadata: one version, sibling pins only this repository can meet (a
local version label PyPI refuses), and the licence text in each distribution's folder."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

import agentspec

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = [ROOT, ROOT / "toolcalls", ROOT / "integrations" / "langchain"]
SIBLINGS = ("agentspec-decode", "agentspec-toolcalls", "langchain-agentspec")


def project(folder: Path) -> dict:
    return tomllib.loads((folder / "pyproject.toml").read_text())["project"]


def test_one_version_everywhere():
    versions = {project(f)["version"] for f in FOLDERS}
    assert versions == {agentspec.__version__}, versions
    assert importlib.metadata.version("agentspec-decode") == agentspec.__version__


def test_every_pin_on_a_sibling_carries_the_local_label():
    for folder in FOLDERS:
        p = project(folder)
        requirements = [*p.get("dependencies", []), *sum(p.get("optional-dependencies", {}).values(), [])]
        for req in requirements:
            name = re.split(r"[\s=<>!~\[;@]", req, maxsplit=1)[0]
            if name in SIBLINGS:
                assert re.search(r"==[\d.]+\+\w+", req), f"{folder.name}: {req!r} could be met from an index"


def test_each_distribution_ships_the_licence():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0" in text
    for folder in FOLDERS:
        assert (folder / "LICENSE").read_text() == text, folder
        assert project(folder)["license-files"] == ["LICENSE"]
