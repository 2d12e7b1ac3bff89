"""The layers import downwards only: the lowering (`cdpjax/program/`) reads tables and kinds, never
the layouts that make the tables (a new table must lower without a layout behind it)."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _imported_modules(tree: ast.AST) -> set[str]:
    """Every module an `import` or `from ... import` names, at any depth (late imports in functions too)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def test_program_imports_nothing_from_layouts():
    found = {}
    for path in sorted((ROOT / "cdpjax" / "program").rglob("*.py")):
        bad = sorted(m for m in _imported_modules(ast.parse(path.read_text()))
                     if m == "cdpjax.layouts" or m.startswith("cdpjax.layouts."))
        if bad:
            found[path.relative_to(ROOT).as_posix()] = bad
    assert not found


def test_the_import_walk_sees_a_late_import():
    """The check above could fail: a late import inside a function is seen."""
    tree = ast.parse("def f():\n    from cdpjax.layouts.cdp import cdp_table\n    return cdp_table\n")
    assert "cdpjax.layouts.cdp" in _imported_modules(tree)
