"""The documentation cannot drift from the code it describes.

- Python in docs/ is never typed into a page unless a test runs it: every ```python block
  follows a marker `<!-- from examples/X.py -->` (or `<!-- from examples/X.py:SECTION -->`,
  the lines between `# --8<-- [start:SECTION]` and `[end:SECTION]`) and is that code,
  dedented, as tests/test_examples.py runs it; or it follows a marker
  `<!-- ... tests/test_X.py runs this block -->` naming the test that reads the page and
  executes it (a guide whose example is a user's own test file). The code is written into the
  page, not included at build time, so the page reads the same on GitHub as on the site.
  After changing an example, `python tests/test_docs.py --sync` rewrites the blocks.
- What only the built site can show (mkdocstrings' `::: name`, the changelog's include) sits
  in `<!-- site-only ... -->` comments, and what only GitHub needs in `<!-- github-only -->`
  ... `<!-- /github-only -->`; `mkdocs_hooks.py` swaps them at build time. Outside those, no
  page shows a raw directive.
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
#: `<!-- from examples/X.py[:SECTION] -->`, then the block that shows it.
FROM_EXAMPLE = re.compile(
    r"^<!-- from (examples/[\w.-]+\.py)(?::([\w-]+))? -->\n(```python[^\n]*\n)(.*?)^```$",
    re.MULTILINE | re.DOTALL,
)
SECTION_MARK = re.compile(r"^\s*# --8<-- \[(?:start|end):[\w-]+\]\n", re.MULTILINE)


def python_blocks(path: Path) -> list[str]:
    return FENCE.findall(path.read_text())


def example_code(file: str, section: str | None) -> str:
    """What a block showing `file` (or its `section`) must hold: the code, dedented, without
    the section marks."""
    source = (ROOT / file).read_text()
    if section is not None:
        start, end = f"# --8<-- [start:{section}]", f"# --8<-- [end:{section}]"
        assert start in source and end in source, f"{file} has no section {section!r}"
        source = source.split(start, 1)[1].split("\n", 1)[1]
        source = source.split(end, 1)[0].rsplit("\n", 1)[0] + "\n"
    return textwrap.dedent(SECTION_MARK.sub("", source)).strip("\n") + "\n"


def synced(text: str) -> str:
    """`text` with every example block rewritten from its example file."""

    def block(m: re.Match[str]) -> str:
        marker = f"<!-- from {m[1]}{':' + m[2] if m[2] else ''} -->"
        return f"{marker}\n{m[3]}{example_code(m[1], m[2])}```"

    return FROM_EXAMPLE.sub(block, text)


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_python_in_the_docs_comes_from_examples(page: Path) -> None:
    text = page.read_text()
    run_by_tests = RUN_MARKER.findall(text)
    for test in run_by_tests:
        assert f'"{page.name}"' in (ROOT / test).read_text(), f"{test} does not read {page.name}"
    marked = {match.end() for match in RUN_MARKER.finditer(text)}
    shown = {match.start(3) for match in FROM_EXAMPLE.finditer(text)}
    for fence in FENCE.finditer(text):
        if fence.start() + len("```python") in marked:
            continue  # executed by the test its marker names
        assert fence.start() in shown, (
            f"{page.name}: a Python block with no `<!-- from examples/X.py -->` marker:\n"
            f"{fence.group(1)}"
        )
    for match in FROM_EXAMPLE.finditer(text):
        file, section, _, block = match.groups()
        assert block == example_code(file, section), (
            f"{page.name}'s block from {file}{':' + section if section else ''} differs from "
            "the example: run `python tests/test_docs.py --sync`"
        )


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_github_shows_no_build_directive(page: Path) -> None:
    """GitHub renders the markdown as it is: a directive outside the site-only comments would
    show as text (`--8<-- "examples/anyio_run.py"` instead of the program)."""
    visible = re.sub(r"<!--.*?-->", "", page.read_text(), flags=re.DOTALL)
    for line in visible.splitlines():
        assert not line.startswith((":::", "--8<--")), f"{page.name} shows {line!r} on GitHub"


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_the_site_links_stay_inside_docs(page: Path) -> None:
    """`mkdocs build --strict` refuses a link out of docs/ (the site has no such page): such a
    link must sit in a github-only part."""
    built = _hooks().on_page_markdown(page.read_text())
    outside = re.findall(r"\]\((\.\./[^)]*)\)", built)
    assert not outside, f"{page.name} links out of docs/ on the site: {outside}"


def _hooks():  # type: ignore[no-untyped-def]
    import importlib.util

    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "mkdocs_hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return hooks


def test_the_site_build_swaps_the_github_and_site_parts() -> None:
    hooks = _hooks()
    changelog = hooks.on_page_markdown((DOCS / "changelog.md").read_text())
    assert changelog.strip() == '--8<-- "CHANGELOG.md"'
    api = hooks.on_page_markdown((DOCS / "api.md").read_text())
    assert "\n::: art_trio.PipelineTrainer\n" in api and "github-only" not in api


def test_the_api_page_lists_every_export_for_github_readers() -> None:
    github = re.sub(r"<!--.*?-->", "", (DOCS / "api.md").read_text(), flags=re.DOTALL)
    missing = [name for name in exported_names() if not re.search(rf"\b{name}\b", github)]
    assert not missing, f"docs/api.md's list (read on GitHub) lacks {missing}"


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
    """The names `art_trio` exports: those its stub (`__init__.pyi`) imports."""
    tree = ast.parse((PACKAGE / "__init__.pyi").read_text())
    return [
        alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
        for alias in node.names
    ]


def test_the_api_reference_documents_every_export() -> None:
    """On the site: a `::: art_trio.NAME` directive (in a site-only comment) per export, or
    `::: art_trio.PACKAGE.NAME` for an extension's, documented with its package."""
    api = (DOCS / "api.md").read_text()
    documented = set(re.findall(r"^::: art_trio\.(?:[\w.]+\.)?(\w+)$", api, re.MULTILINE))
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


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--sync"]:
        raise SystemExit("usage: python tests/test_docs.py --sync   (rewrite the docs' blocks)")
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        if synced(text) != text:
            page.write_text(synced(text))
            print(f"rewrote {page.relative_to(ROOT)}")
