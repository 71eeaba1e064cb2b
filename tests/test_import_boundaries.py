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


# ---- the layout's rules (DESIGN.md, "Layout") ------------------------------------------

MODULE_LIMIT = 15  # modules directly in one folder: more, and it wants sub-packages
INDEX_MODULE = ROOT / "store" / "base" / "index.py"
LMDB_ATTRS = {"cursor", "_env", "_db", "_txn"}  # LMDB handles and raw transactions


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = ["kvtier", *rel.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def kvtier_imports(path: Path, known: set[str]) -> set[str]:
    """The kvtier modules `path` imports, at its top or inside a function (a lazy import
    closes a loop as surely, only later), outside `if TYPE_CHECKING:`. `from P import x`
    names module `P.x` where that is one, else `P`."""
    out: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    type_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                 and "TYPE_CHECKING" in ast.unparse(node.test)
                 for stmt in node.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if sub in known:
                    out.add(sub)
                elif node.module in known:
                    out.add(node.module)
    return out


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for _, p in sources()}
    known = set(paths)
    return {m: kvtier_imports(p, known) - {m} for m, p in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` (as a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def dfs(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = dfs(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = dfs(m)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_a_loop_and_only_a_loop():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_package_has_no_import_cycle_between_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "modules import each other in a loop: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("pkg", ["tiers", "eviction"])
def test_tiers_and_eviction_stand_on_store_base_only(pkg):
    for path in sorted((ROOT / pkg).rglob("*.py")):
        for name in imports(path):
            if name.startswith("kvtier.store"):
                assert name == "kvtier.store.base" or name.startswith("kvtier.store.base."), \
                    f"{path.relative_to(ROOT)} imports {name}: {pkg}/ may use only " \
                    "kvtier.store.base of store/"


def test_store_base_is_the_floor():
    for path in sorted((ROOT / "store" / "base").rglob("*.py")):
        for name in imports(path):
            if name.startswith("kvtier."):
                assert name.startswith("kvtier.store.base"), \
                    f"{path.relative_to(ROOT)} imports {name}: store/base imports no other " \
                    "part of kvtier"


def test_library_code_never_imports_a_cli_module():
    cli = ("kvtier.tools.cli", "kvtier.tools.commands")
    for pkg, path in sources():
        if path.parent.name == "commands" or path.name == "cli.py":
            continue
        for name in imports(path):
            assert not name.startswith(cli), \
                f"{path.relative_to(ROOT)} imports {name}: library code never imports the CLI"


def test_lmdb_is_reached_only_through_the_index():
    for pkg, path in sources():
        if path == INDEX_MODULE:
            continue
        tree = ast.parse(path.read_text(), str(path))
        assert "lmdb" not in {n.split(".")[0] for n in imports(path)}, \
            f"{path.relative_to(ROOT)} imports lmdb: only store/base/index.py may"
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in LMDB_ATTRS:
                pytest.fail(f"{path.relative_to(ROOT)}:{node.lineno} uses .{node.attr}: "
                            "LMDB is reached only through Index and its Txn")


def test_an_init_is_a_face():
    for pkg, path in sources():
        if path.name != "__init__.py":
            continue
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, (ast.Import, ast.ImportFrom, ast.Expr)):
                continue  # re-exports and the docstring
            if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == \
                    ["__all__"]:
                continue
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                continue  # a lazy re-export (the connector's class, without importing vLLM)
            pytest.fail(f"{path.relative_to(ROOT)}:{node.lineno} defines something: an "
                        "__init__.py only re-exports")


@pytest.mark.parametrize("pkg", ["store", "tiers", "tools", "connector", "eviction"])
def test_no_folder_holds_more_than_a_handful_of_modules(pkg):
    for folder in [ROOT / pkg, *[p for p in (ROOT / pkg).rglob("*") if p.is_dir()
                                 and p.name != "__pycache__"]]:
        n = len(list(folder.glob("*.py")))
        assert n <= MODULE_LIMIT, f"{folder.relative_to(ROOT)} holds {n} modules; give it " \
            f"sub-packages by job (at most {MODULE_LIMIT} a folder)"
