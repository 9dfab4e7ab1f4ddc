"""The docs stay true: docs/config.md is what its command prints from the schema, and every relative link in the
README and docs/ reaches a file, and a heading there when it names one; docs/architecture.md names every module."""

import re
from pathlib import Path

from conftest import ROOT, run_titan

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_config_page_is_what_its_command_prints_from_the_schema():
    command = "titan config keys --markdown > docs/config.md"
    assert command in (ROOT / "docs" / "contributing.md").read_text()  # the command the contributing page names
    printed = run_titan("config", "keys", "--markdown")
    assert printed.returncode == 0, printed.stderr
    assert (ROOT / "docs" / "config.md").read_text() == printed.stdout, f"docs/config.md is stale: run {command}"


def anchors(page) -> set[str]:
    """The anchors of a page's headings, as GitHub makes them: lower case, punctuation dropped, spaces to dashes."""
    headings = re.findall(r"^#+ (.+)$", without_code(page.read_text()), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def without_code(text: str) -> str:
    return re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.M | re.S)


def broken_links(page) -> list[str]:
    """The relative links of a page whose file, or whose heading in it, does not exist."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", without_code(page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto: and the like are not checked here
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.is_file() or (anchor and anchor not in anchors(linked)):
            broken.append(target)
    return broken


def test_every_relative_link_reaches_a_file_and_heading():
    assert [f"{page.relative_to(ROOT)}: {target}" for page in PAGES for target in broken_links(page)] == []


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Its `part`: two\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# A title\n\n[ok](#a-title) [ok](other.md#its-part-two) [gone](missing.md) [nowhere](other.md#part)\n"
        "```\n[in code](not-a-link.md)\n```\n"
    )
    assert broken_links(page) == ["missing.md", "other.md#part"]


def unnamed_modules(root: Path, page: str) -> list[str]:
    """titan's modules whose file name `page` does not mention (a package's __init__ and __main__ aside)."""
    modules = sorted((root / "titan").rglob("*.py"))
    return [
        str(p.relative_to(root)) for p in modules if p.name not in ("__init__.py", "__main__.py") and p.name not in page
    ]


def test_the_architecture_page_names_every_module():
    """A newcomer finds each module on docs/architecture.md: a new one is named there when it lands."""
    assert unnamed_modules(ROOT, (ROOT / "docs" / "architecture.md").read_text()) == []


def test_the_module_check_finds_an_unnamed_module(tmp_path):
    (tmp_path / "titan" / "pkg").mkdir(parents=True)
    for name in ("__init__.py", "named.py", "new.py"):
        (tmp_path / "titan" / "pkg" / name).write_text("")
    assert unnamed_modules(tmp_path, "pkg/ (named.py)") == ["titan/pkg/new.py"]
