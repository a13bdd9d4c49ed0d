"""Griffe extensions for the API reference (``mkdocs.yml``: the python handler's ``extensions``).

Both make the rendered pages say what the code says, with no change to the code:

- `EvaluatedDefaults`: the package keeps its default settings in one place (``lightning_muon.optim.defaults``),
  so a signature reads ``lr: float = MUON_CLASS.lr``. That source text tells a reader nothing; the reference
  shows the value it evaluates to (``lr: float = 0.001``), in the signature and in the parameter table.
- `CommentDocstrings`: the package documents attributes with ``#:`` comments above them (Sphinx's
  doc-comments), which griffe does not read; an attribute without a docstring gets its comment as one.

Not part of the package (nothing here ships in the wheel): mkdocstrings loads this file by its path.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import griffe

#: The package whose module-level constants are evaluated; defaults naming anything else stay as written.
PACKAGE = "lightning_muon"

logger = griffe.get_logger("griffe_api_reference")

_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _resolves_to(text: str, value: object) -> bool:
    """Whether the dotted name ``text`` (``torch.bfloat16``) imports back as ``value`` itself."""
    parts = text.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for part in parts[cut:]:
                obj = getattr(obj, part)
        except AttributeError:
            return False
        return obj is value
    return False


def source_text(value: object) -> str | None:
    """``value`` as Python source a reader can take at its word (a literal, or a dotted name such as
    ``torch.bfloat16`` that reads back as the same object); ``None`` when it has no such spelling."""
    if value is None or isinstance(value, bool | int | float | complex):
        return repr(value)
    if isinstance(value, str):
        plain = '"' not in value and "\\" not in value and value.isprintable()
        return f'"{value}"' if plain else repr(value)
    if isinstance(value, tuple | list):
        items = [text for text in map(source_text, value) if text is not None]
        if len(items) < len(value):
            return None
        inner = ", ".join(items) + ("," if isinstance(value, tuple) and len(items) == 1 else "")
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    if isinstance(value, dict):
        pairs = [(source_text(key), source_text(item)) for key, item in value.items()]
        if any(key is None or item is None for key, item in pairs):
            return None
        return "{" + ", ".join(f"{key}: {item}" for key, item in pairs) + "}"
    text = repr(value)
    return text if _DOTTED.fullmatch(text) and _resolves_to(text, value) else None


def _constant_path(default: str | griffe.Expr | None, scope: griffe.Object) -> tuple[str, list[str]] | None:
    """For a default that is a dotted reference to a module-level constant of `PACKAGE` (``MUON_CLASS.lr``,
    ``DEFAULT_EPS``), the constant's module and the names to follow from it; ``None`` for any other default."""
    if not isinstance(default, griffe.ExprName | griffe.ExprAttribute):
        return None
    if isinstance(default, griffe.ExprAttribute) and not all(
        isinstance(part, griffe.ExprName) for part in default.values
    ):
        return None  # a call or a subscript somewhere in the chain: not a plain reference
    path = default.canonical_path
    if not path.startswith(f"{PACKAGE}."):
        return None
    parts = path.split(".")
    modules = scope.modules_collection
    for cut in range(len(parts) - 1, 0, -1):
        module_path = ".".join(parts[:cut])
        try:
            module = modules.get_member(module_path)
        except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            continue
        if module.is_module:
            constant = module.members.get(parts[cut])
            # a module-level attribute (not a class, a function or a submodule): a constant
            if constant is not None and not constant.is_alias and constant.is_attribute:
                return module_path, parts[cut:]
            return None
    return None


class EvaluatedDefaults(griffe.Extension):
    """Render a default that names a module-level constant of the package (``MUON_CLASS.lr``,
    ``DEFAULT_NS_STEPS``) as the value it evaluates to, imported from the package itself.

    A value with no plain spelling (a sentinel object) keeps its name. A default that cannot be evaluated, or
    whose module imports from another file than the one the reference reads (another installed copy), is a
    warning: ``mkdocs build --strict`` fails rather than show a name, or a value, the code does not have.
    """

    def on_function(self, *, func: griffe.Function, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        for parameter in func.parameters:
            found = _constant_path(parameter.default, func)
            if found is None:
                if isinstance(parameter.default, griffe.ExprAttribute):
                    # any other dotted default (``torch.bfloat16``) as written: the parameter table would
                    # shorten it to its last name (``bfloat16``)
                    parameter.default = str(parameter.default)
                continue
            module_path, names = found
            try:
                value: Any = importlib.import_module(module_path)
                imported = Path(value.__file__).resolve()
                for name in names:
                    value = getattr(value, name)
            except Exception as error:  # an import error of any kind: say it, keep the source text
                logger.warning("%s: cannot evaluate the default %s=%s (%r)", func.path, parameter.name,
                               parameter.default, error)
                continue
            read = func.modules_collection.get_member(module_path).filepath
            if not isinstance(read, Path) or imported != read.resolve():
                logger.warning("%s: the default %s=%s is evaluated from %s, but the reference reads %s", func.path,
                               parameter.name, parameter.default, imported, read)
                continue
            text = source_text(value)
            if text is None:  # a sentinel object, say: its name is the best spelling there is
                logger.debug("%s: the default %s=%s evaluates to %r, which has no plain spelling", func.path,
                             parameter.name, parameter.default, value)
                continue
            parameter.default = text


class CommentDocstrings(griffe.Extension):
    """Give an attribute without a docstring the ``#:`` comment lines right above it as its docstring.

    An attribute assigned only in a method (``self.split_ns = split_ns``) is shown without that right-hand
    side: an expression over the method's locals, which reads as nonsense outside it.
    """

    def on_attribute(self, *, attr: griffe.Attribute, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if "instance-attribute" in attr.labels and "class-attribute" not in attr.labels:
            attr.value = None
        filepath = attr.filepath
        if attr.docstring is not None or attr.lineno is None or not isinstance(filepath, Path):
            return
        if filepath not in attr.lines_collection:
            return
        lines = attr.lines_collection[filepath]
        first = attr.lineno - 1  # the attribute's own line, 0-based
        while first > 0 and lines[first - 1].lstrip().startswith("#:"):
            first -= 1
        comment = [line.lstrip()[2:].removeprefix(" ") for line in lines[first : attr.lineno - 1]]
        if comment:
            attr.docstring = griffe.Docstring(
                "\n".join(comment), lineno=first + 1, endlineno=attr.lineno - 1, parent=attr,
                parser=loader.docstring_parser, parser_options=loader.docstring_options,
            )
