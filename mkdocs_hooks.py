"""mkdocs hooks (mkdocs.yml `hooks:`): one page source that reads right on GitHub and built.

GitHub renders docs/*.md as they are and hides HTML comments; the site needs directives that
GitHub would show as text (mkdocstrings' `::: art_trio.Name`, the changelog's include). So a
page puts what only the site can show in a `<!-- site-only ... -->` comment, and what only a
GitHub reader needs (a link out of docs/, which the site build would refuse) between
`<!-- github-only -->` and `<!-- /github-only -->`. Before each page is converted, this hook
removes the GitHub-only parts and uncomments the site-only ones. tests/test_docs.py checks
that no directive is left visible on GitHub.
"""

from __future__ import annotations

import re
from typing import Any

GITHUB_ONLY = re.compile(r"<!-- github-only -->.*?<!-- /github-only -->\n?", re.DOTALL)
SITE_ONLY = re.compile(r"<!-- site-only\n(.*?)\n-->", re.DOTALL)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return SITE_ONLY.sub(lambda m: m.group(1), GITHUB_ONLY.sub("", markdown))
