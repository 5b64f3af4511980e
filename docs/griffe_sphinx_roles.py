"""A griffe extension for the API pages: the docstrings in src/aiayn/ mix Google sections with
a few reStructuredText habits. Sphinx roles (:class:`~aiayn.config.Config`) become code spans
(`Config`), and a paragraph ending in "::" ends in ":" (its indented block stays code)."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def _role(m: re.Match[str]) -> str:
    short, target = m.group(1), m.group(2)
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def _literal_marker(line: str) -> str:
    if line.strip() == "::":
        return ""
    return line[:-1] if line.endswith("::") else line


def rewrite(text: str) -> str:
    text = _ROLE.sub(_role, text)
    return "\n".join(_literal_marker(line) for line in text.split("\n"))


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
