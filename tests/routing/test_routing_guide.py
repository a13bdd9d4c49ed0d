"""The routing guide (docs/guides/routing.md): its example runs as written and prints the table the page shows."""

from __future__ import annotations

import contextlib
import io

from helpers import code_blocks


def test_the_example_prints_the_table_on_the_page():
    (example,) = code_blocks("guides/routing.md")
    (shown,) = code_blocks("guides/routing.md", "text")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(example, "docs/guides/routing.md block 0", "exec"), {"__name__": "routing_guide"})
    lines = [line.rstrip() for line in printed.getvalue().rstrip("\n").splitlines()]
    assert lines == shown.rstrip("\n").splitlines()
    assert max(map(len, lines)) <= 100  # fits the site's code column (docs/stylesheets/extra.css)
    assert "loc.weight      1x64   AdamW      head" in shown  # the point the page makes about it
