"""The code passes the project's linter and formatter (ruff, configured in pyproject.toml)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_is_clean(command):
    result = subprocess.run([sys.executable, "-m", "ruff", *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# What a newcomer reads in one sitting: a module of at most 400 lines, a function of at most 80. A file that must
# be longer is named here with its reason; none is today.
MODULE_LINES, FUNCTION_LINES = 400, 80
LONGER_MODULES: dict[str, str] = {}
LONGER_FUNCTIONS: dict[str, str] = {}  # "path:function": reason


def sizes(root: Path) -> tuple[dict[str, int], dict[str, int]]:
    """Lines of each module under `root`, and of each function (methods and nested functions included)."""
    modules, functions = {}, {}
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root.parent).as_posix()
        text = path.read_text()
        modules[name] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions[f"{name}:{node.name}"] = node.end_lineno - node.lineno + 1
    return modules, functions


def test_modules_and_functions_stay_short():
    modules, functions = sizes(ROOT / "titan")
    long_modules = {m: n for m, n in modules.items() if n > MODULE_LINES and m not in LONGER_MODULES}
    long_functions = {f: n for f, n in functions.items() if n > FUNCTION_LINES and f not in LONGER_FUNCTIONS}
    assert not long_modules, f"over {MODULE_LINES} lines: {long_modules}; split it, or name it with a reason"
    assert not long_functions, f"over {FUNCTION_LINES} lines: {long_functions}; split it, or name it with a reason"
    assert set(LONGER_MODULES) <= set(modules) and set(LONGER_FUNCTIONS) <= set(functions)  # no stale names


def test_the_size_check_catches_a_long_module_and_function(tmp_path):
    package = tmp_path / "titan"
    package.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(FUNCTION_LINES))
    (package / "big.py").write_text("def long():\n" + body + "\n" * MODULE_LINES)
    modules, functions = sizes(package)
    assert modules["titan/big.py"] > MODULE_LINES and functions["titan/big.py:long"] == FUNCTION_LINES + 1
