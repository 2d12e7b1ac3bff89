"""The README and docs tell the truth about the code: the README stays short (at most 300
lines, the reference lives in docs/), every file they link exists, the command synopses name
every flag, the `zb-h1` walkthrough is the code that runs (each block, comments and type
annotations aside, is a statement of the layout's or the builder's file), and the code passes
ruff."""
import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _normal(node: ast.AST) -> str:
    """The statement without docstrings and annotations (the README leaves those to the file)."""
    node = ast.parse(ast.unparse(node)).body[0]  # a copy
    for n in ast.walk(node):
        if isinstance(n, ast.FunctionDef):
            n.returns = None
            for a in n.args.args + n.args.kwonlyargs:
                a.annotation = None
            if n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant):
                n.body = n.body[1:]
    return ast.dump(node)


def _walkthrough_blocks() -> list[str]:
    section = README.split("## Adding a layout: `zb-h1`, line by line", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_readme_is_at_most_300_lines():
    assert len(README.splitlines()) <= 300


def test_every_file_the_readme_links_exists():
    links = re.findall(r"\]\(([^)#]+)\)", README)
    assert links
    assert [link for link in links if not link.startswith("http") and not (ROOT / link).exists()] == []


def test_every_file_the_docs_link_exists():
    """Links in docs/*.md resolve from the file that holds them (`(ppll.md)`, `(../colab/...)`)."""
    broken = []
    for doc in sorted((ROOT / "docs").glob("*.md")):
        for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", doc.read_text()):
            if not link.startswith(("http://", "https://")) and not (doc.parent / link).exists():
                broken.append(f"{doc.name}: {link}")
    assert broken == []


def test_the_zb_h1_walkthrough_is_the_code():
    code = {_normal(s) for f in ("cdpjax/layouts/zb_h1.py", "cdpjax/methods/zb_h1.py")
            for s in ast.parse((ROOT / f).read_text()).body}
    blocks = _walkthrough_blocks()
    shown = [s for block in blocks for s in ast.parse(block).body]
    assert len(blocks) >= 3 and len(shown) >= 4  # both functions of the table, the registration, the builder
    assert [ast.unparse(s).splitlines()[0] for s in shown if _normal(s) not in code] == []


def test_the_code_passes_ruff():
    """Lines of at most 120 characters, no unused names, pycodestyle's errors and warnings
    (pyproject.toml's [tool.ruff]): a style slip fails here, not in review."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_the_command_synopses_list_every_flag(capsys):
    """docs/commands.md's synopsis of each subcommand names exactly the flags its parser takes
    (read from `cdpjax CMD --help`): a flag added to the code and not to the docs fails here."""
    from cdpjax.cli import main

    block = (ROOT / "docs" / "commands.md").read_text().split("```\n", 2)[1]
    documented: dict[str, set] = {}
    for line in block.splitlines():
        if line.startswith("cdpjax "):
            command = line.split()[1]
        documented.setdefault(command, set()).update(re.findall(r"(--[a-z][a-z-]*)", line))
    assert set(documented) == {"train", "plot", "schedule", "bench", "describe", "plan"}
    for command, flags in documented.items():
        with pytest.raises(SystemExit):
            main([command, "--help"])
        parsed = set(re.findall(r"^\s{2}(?:-\w, )?(--[a-z][a-z-]*)", capsys.readouterr().out, re.M))
        assert flags == parsed - {"--help"}, command


def _readme_commands() -> list[str]:
    """Every `cdpjax ...` command the README shows: the lines of its bash blocks (their shell
    variables expanded, comments dropped), `make train ARGS="..."` as the command it runs, and
    the ones quoted inline."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        variables = {}
        for line in block.splitlines():
            line = line.split("  #", 1)[0].strip()
            assignment = re.fullmatch(r"([A-Z]+)=(\S+)", line)
            if assignment:
                variables[assignment.group(1)] = re.sub(r"\$(\w+)", lambda m: variables[m.group(1)],
                                                        assignment.group(2))
            elif line.startswith("cdpjax "):
                commands.append(re.sub(r"\$(\w+)", lambda m: variables[m.group(1)], line))
    commands += [f"cdpjax train {args}" for args in re.findall(r'make train ARGS="([^"]*)"', README)]
    commands += re.findall(r"`(cdpjax [a-z]+[^`]*)`", README)
    return commands


def test_every_command_the_readme_shows_parses_and_names_a_valid_config(monkeypatch):
    """Each `cdpjax` command of the README goes through the CLI's parser (a flag renamed in the code
    and not in the README fails here), and the configs it names load and validate, with every
    `bench` variant (`method@KEY=VALUE`), without building or running anything."""
    import shlex

    from cdpjax import bench, checks, cli
    from cdpjax import config as cfg_lib
    from cdpjax.layouts import LAYOUTS

    ran = []

    def record(name):
        def command(args, overrides):
            ran.append(name)
            if getattr(args, "config", None) is None and name not in ("train", "bench", "plan"):
                return 0
            c = cli._load(args, overrides)
            cfg_lib.validate(c)
            if name == "train":
                checks.validate(c)
            for spec in (args.methods.split(",") if name == "bench" and args.methods else []):
                LAYOUTS.lookup(spec.split("@")[0])
                cfg_lib.validate(bench.variant_config(c, spec))
            return 0
        return command

    monkeypatch.setattr(cli, "cmd_train", record("train"))
    monkeypatch.setattr(cli, "_runner", lambda module: record(module.__name__.rsplit(".", 1)[1]))
    commands = _readme_commands()
    assert len(commands) >= 15 and {c.split()[1] for c in commands} >= {"train", "schedule", "bench", "plan"}
    for command in commands:
        assert cli.main(shlex.split(command)[1:]) == 0, command
    assert len(ran) == len(commands)


def _readme_scripts() -> list[str]:
    """Every `python experiments/NAME.py ...` command the README shows, in its bash blocks (comments
    after two spaces dropped) and quoted inline."""
    blocks = [line.split("  #", 1)[0].strip() for block in re.findall(r"```bash\n(.*?)```", README, re.S)
              for line in block.splitlines()]
    return [line for line in blocks if line.startswith("python experiments/")] + \
        re.findall(r"`(python experiments/[^`]+)`", README)


class _Parsed(Exception):
    pass


def test_every_script_the_readme_shows_takes_its_arguments(monkeypatch):
    """Each `python experiments/...` command of the README is parsed by the script's own parser (a
    flag or a choice renamed in the script and not in the README fails here); parsing is where the
    test stops it (argparse's parse_args made to return through an exception), so nothing runs."""
    import argparse
    import shlex

    from helpers import load_script

    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    commands = _readme_scripts()
    assert len(commands) >= 4 and any("readme_figures.py --only cdp-ring" in c for c in commands)
    for command in commands:
        words = shlex.split(command)
        script = load_script(str(ROOT / words[1]), pathlib.Path(words[1]).stem)
        with pytest.raises(_Parsed):
            script.main(words[2:])


def test_every_test_the_docs_cite_exists():
    """Every test the README and docs/ cite as `test_file.py::test_name` (or `::test_name` after a file
    named before it in the same page; `test_name_*` for the tests whose names start so) is defined in
    that file: a test renamed in the code and not in the docs fails here."""
    cited, missing = 0, []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        last = None
        for m in re.finditer(r"(?:tests/)?(test_\w+\.py)?::(test_\w+)(\*)?", doc.read_text()):
            last = m.group(1) or last
            cited += 1
            source = (ROOT / "tests" / last).read_text() if last and (ROOT / "tests" / last).exists() else ""
            name = re.escape(m.group(2)) + (r"\w*" if m.group(3) else "")
            if not re.search(rf"^def {name}\(", source, re.M):
                missing.append(f"{doc.name}: {last}::{m.group(2)}{m.group(3) or ''}")
    assert cited >= 50 and missing == []
