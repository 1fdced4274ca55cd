"""The documentation cannot drift from the code it describes.

- Python in docs/ is never typed into a page unless a test runs it: every ```python block only
  includes a file (or a marked section of one) from examples/, which tests/test_examples.py
  runs, or follows a marker `<!-- ... tests/test_X.py runs this block -->` naming the test
  that reads the page and executes it (a guide whose example is a user's own test file).
  mkdocs' snippets extension (check_paths) fails the build when a file or section is missing.
- Python in README.md (rendered by code hosts, which cannot include files) must be a verbatim
  excerpt of an example, so it runs too.
- The API reference documents every name `art_trio` exports; the architecture page names every
  module under src/art_trio; every page is in the site's navigation.

`mkdocs build --strict` itself runs in `.ci/package` (it needs the `docs` extra).
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
EXAMPLES = ROOT / "examples"
PACKAGE = ROOT / "src" / "art_trio"

FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
RUN_MARKER = re.compile(
    r"^<!-- .*?(tests/test_\w+\.py) runs this block -->\n```python", re.MULTILINE
)
SNIPPET = re.compile(r'^--8<-- "(examples/[\w.-]+\.py)(?::([\w-]+))?"$')


def python_blocks(path: Path) -> list[str]:
    return FENCE.findall(path.read_text())


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_python_in_the_docs_comes_from_examples(page: Path) -> None:
    text = page.read_text()
    run_by_tests = RUN_MARKER.findall(text)
    for test in run_by_tests:
        assert f'"{page.name}"' in (ROOT / test).read_text(), f"{test} does not read {page.name}"
    marked = {match.end() for match in RUN_MARKER.finditer(text)}
    for fence in FENCE.finditer(text):
        if fence.start() + len("```python") in marked:
            continue  # executed by the test its marker names
        block = fence.group(1)
        lines = [line for line in block.splitlines() if line.strip()]
        assert len(lines) == 1, f"{page.name}: inline Python; include it from examples/:\n{block}"
        match = SNIPPET.match(lines[0])
        assert match, f"{page.name}: {lines[0]!r} is not an include from examples/"
        file, section = match.groups()
        source = (ROOT / file).read_text()
        if section is not None:
            assert f"# --8<-- [start:{section}]" in source, f"{file} has no section {section!r}"
            assert f"# --8<-- [end:{section}]" in source, f"{file} has no end of {section!r}"


def test_readme_python_is_taken_from_the_examples() -> None:
    examples = {p.name: p.read_text().splitlines() for p in EXAMPLES.glob("*.py")}
    blocks = python_blocks(ROOT / "README.md")
    assert len(blocks) >= 3, "the README shows the import, usage from trio and from anyio"
    for block in blocks:
        found = [name for name, lines in examples.items() if is_excerpt(block, lines)]
        assert found, f"README block is not a verbatim excerpt of any example:\n{block}"


def is_excerpt(block: str, lines: list[str]) -> bool:
    """`block` is a run of consecutive `lines`, with their common indentation removed."""
    wanted = textwrap.dedent(block).strip("\n")
    size = len(wanted.splitlines())
    return any(
        textwrap.dedent("\n".join(lines[start : start + size])) == wanted
        for start in range(len(lines) - size + 1)
    )


def test_the_readme_stays_a_front_door() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def exported_names() -> list[str]:
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    raise AssertionError("art_trio/__init__.py has no __all__")


def test_the_api_reference_documents_every_export() -> None:
    api = (DOCS / "api.md").read_text()
    documented = set(re.findall(r"^::: art_trio\.(\w+)$", api, re.MULTILINE))
    # ART's own classes on 0.5.20+: documented under their name, from art_trio's replica.
    headed = set(re.findall(r"^### (\w+)$", api, re.MULTILINE))
    missing = [name for name in exported_names() if name not in documented | headed]
    assert not missing, f"docs/api.md lacks ::: art_trio.NAME for {missing}"


def test_the_module_map_names_every_module() -> None:
    text = (DOCS / "architecture.md").read_text()
    mapped = set(re.findall(r"^\| `([\w/]+\.py)` \|", text, re.MULTILINE))
    modules = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")}
    assert not modules - mapped, f"docs/architecture.md lacks {sorted(modules - mapped)}"
    assert not mapped - modules, f"docs/architecture.md names gone modules {mapped - modules}"


def test_every_page_is_in_the_navigation() -> None:
    config = (ROOT / "mkdocs.yml").read_text()
    in_nav = set(re.findall(r":\s+([\w-]+\.md)\s*$", config, re.MULTILINE))
    pages = {p.name for p in DOCS.glob("*.md")}
    assert pages == in_nav, (pages - in_nav, in_nav - pages)
