"""Small PromQL text helpers for the dashboard tests: selectors, variable substitution.

Not a PromQL parser: it finds `metric{matchers}` selectors by pattern, which is all the lint
rules need; whether a query is valid PromQL is decided by the real Prometheus (e2e test) and by
promtool (rules).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

_SELECTOR = re.compile(r"(?<![\w:])(vigil[_:][A-Za-z0-9_:]*|up)(\{[^}]*\})?")
_KEYWORDS = {"by", "on", "without", "ignoring", "group_left", "group_right", "bool", "and"}


def selectors(expr: str) -> Iterator[tuple[str, str]]:
    """(metric, matcher text) for every vigil metric (or `up`) the expression selects."""
    for match in _SELECTOR.finditer(expr):
        name, matchers = match.group(1), match.group(2) or ""
        start = match.start()
        # `by (vigil_x)` never happens; a name right after "by (" would be a label, skip it.
        if expr[max(0, start - 4) : start].strip().endswith("("):
            before = expr[:start].rstrip("( ").split()[-1:] or [""]
            if before[0] in _KEYWORDS:
                continue
        yield name, matchers


def substitute(expr: str, values: dict[str, str]) -> str:
    """Replace Grafana variables ($name and ${name}) with values, longest names first."""
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", values[name]).replace("$" + name, values[name])
    return expr


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from board["panels"]


def targets(board: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for panel in board["panels"]:
        for target in panel["targets"]:
            yield panel, target
