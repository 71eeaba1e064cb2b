"""DESIGN.md's import boundaries, checked on the source: who may import vllm and torch (only
connector/), mooncake, liburing and aiofiles (only tiers/), and that eviction/ stays pure
logic (no tiers, no I/O libraries) and nothing imports tools/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("store", "tiers", "connector", "eviction", "tools")
ONLY_IN = {"vllm": "connector", "torch": "connector", "mooncake": "tiers", "liburing": "tiers",
           "aiofiles": "tiers"}


def imports(path: Path) -> set[str]:
    """Every module `path` imports, top level or inside a function (absolute names)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def sources():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            yield pkg, path


def test_the_walker_sees_imports_inside_functions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\ndef g():\n    from vllm.config import X\n    import torch.nn\n")
    assert imports(f) == {"os", "vllm.config", "torch.nn"}


@pytest.mark.parametrize("pkg,path", list(sources()), ids=lambda v: str(v).rsplit("/", 2)[-1]
                         if isinstance(v, Path) else v)
def test_boundaries(pkg, path):
    for name in imports(path):
        top = name.split(".")[0]
        if top in ONLY_IN:
            assert pkg == ONLY_IN[top], f"{path.relative_to(ROOT)} imports {name}: only " \
                f"{ONLY_IN[top]}/ may (DESIGN.md)"
        if name.startswith("kvtier."):
            sub = name.split(".")[1]
            assert sub != "tools" or pkg == "tools", \
                f"{path.relative_to(ROOT)} imports {name}: nothing imports tools/"
            if pkg == "eviction":
                assert sub in ("eviction", "store"), \
                    f"{path.relative_to(ROOT)} imports {name}: eviction/ is pure logic"
            if pkg == "store" and sub == "connector":
                pytest.fail(f"{path.relative_to(ROOT)} imports {name}: store/ must not "
                            "depend on the vLLM connector")
