"""The project's Python sources parsed once a session: the tests that read the source tree
(imports, finding kinds, the architecture document) walk the same trees."""

from __future__ import annotations

import ast
import functools
from pathlib import Path


@functools.cache
def parsed(path: Path) -> ast.Module:
    """The syntax tree of one source file (shared: read it, never change it)."""
    return ast.parse(path.read_text(), filename=str(path))
