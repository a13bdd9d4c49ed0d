"""``docs/troubleshooting.md`` against the library's source.

Every message the page quotes (each entry's bold line, and the messages quoted inside an entry) is worded so in
``lightning_muon/``, ``...`` standing for any text the message fills in; and every message a user can meet (a
raise of a user-facing exception with a message, a warning, an argparse error) is quoted by the page, or listed in
`INTERNAL` (a user cannot reach it) or `RELAYS` (it passes on a message made elsewhere), with the reason.

The source is read with `ast`, never imported: a message is the text of one string expression, its adjacent
literals, f-string parts and ``+`` concatenations joined, with `HOLE` wherever the code fills something in.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_muon"
PAGE = ROOT / "docs" / "troubleshooting.md"

#: Where a message fills something in (a placeholder, a variable, a call): any text stands there.
HOLE = "\0"
#: Between two string expressions of the source: neither a quote's text nor its ``...`` reaches across it.
APART = "\1"

#: The exceptions whose messages the completeness check covers. AttributeError is left out: the package raises it
#: only in module ``__getattr__``s, in Python's own words (``module ... has no attribute ...``).
USER_EXCEPTIONS = {
    "MisconfigurationException", "ValueError", "TypeError", "RuntimeError", "UnsupportedAttentionError",
    "SystemExit", "FileNotFoundError", "ArgumentTypeError",
}
#: Calls whose first argument a user reads as a warning or an error: ``rank_zero_warn``, ``warnings.warn`` and
#: argparse's ``parser.error``.
MESSAGE_CALLS = {"rank_zero_warn", "warn", "error"}

#: The code spans of four words or more on the page that are commands or code, not messages.
NOT_MESSAGES = {
    "lightning-muon configs --copy NAME",
    "lightning-muon inspect --config FILE",
    "lightning-muon convert-checkpoint DIR last.ckpt",
    "lightning-muon fit --config gpt_adamw.yaml",
    "q.unflatten(-1, (heads, head_dim)).transpose(1, 2)",
    "(batch, 1, T, S)",
}

#: The messages a user cannot meet, as ``"<module>: <the whole message>"`` (``...`` where it fills something
#: in), each with the reason. A long list here would mean entries are missing from the page.
INTERNAL = {
    # compare checks --max_steps and --val_points before any fit (`--val_points and --max_steps must be >= 1`)
    "commands/compare/fit.py: max_steps and points must be >= 1, got ... and ...",
    # NearTargetValidation refuses a val_check_interval below 1 before it builds its schedule from it
    "commands/compare/target.py: every must be a number of steps >= 1, got ...",
    # every side has an lr: check_lrs and check_multipliers refuse an empty grid, a side read back holds a run
    "commands/compare/sweep.py: no lr to choose from",
    # FitState.hold corrects the optimizers only while they hold no state
    "lightning/_pair.py: lightning_muon: the routing can only be corrected before the optimizers' first step",
    # FitState._place_reached keeps a parameter whose optimizer the fit lacks where it is (warn_lacking) first
    "lightning/_late.py: lightning_muon: ... would go to an optimizer this fit lacks",
    # route_parameters' own invariant (one route per trainable parameter): a bug in the package, never the user's
    "routing/_rules.py: lightning_muon routed ... for the trainable parameters ...",
    # Algorithm.from_key: the package never calls it with a key of its own
    "routing/_vocabulary.py: ... is none of ...",
}

#: The messages that pass on one made elsewhere, as ``"<module>: <the message expression>"``, with a piece of the
#: message they pass on (the page must quote it), or None where they pass on other sites' messages.
RELAYS = {
    # QKClipper's ValueErrors (tau, chunk_elements, no attention, the attention families'), "QKClip: " in front
    "callbacks/qk_clip.py: f'QKClip: {error}'": None,
    # check_multipliers', check_seeds' and parse_lrs' ValueErrors, as argparse errors
    "commands/compare/run.py: str(error)": None,
    # side_grid's and the read-back's ValueErrors (load_side, outcomes, baseline_index), "lightning-muon compare: "
    "commands/compare/tuned.py: f'lightning-muon compare: {error}'": None,
    # the plain path's read-back (load_run's FileNotFoundError, baseline_index's ValueError), the same way
    "commands/compare/run.py: f'lightning-muon compare: {error}'": None,
    # consolidate's ValueError (not a ModelParallelStrategy checkpoint directory), as an argparse error
    "commands/convert.py: str(error)": None,
    # not_found's line
    "commands/config_files.py: not_found(path)": "and no shipped config of that name",
    # missing_requirements' lines
    "commands/config_files.py: '\\n'.join(missing)": "which is not installed",
    # replaced_message's sentence (INFO, or a warning where something of the parent's is ignored)
    "lightning/_checks.py: message": "configure_optimizers is replaced by MuonMixin's",
    # the optimizer's rank-zero line on its path: a warning for a fallback, where every rank does all the work
    "optim/_choice.py: message": "every rank gathers and orthogonalises every whole matrix (not split:",
}


# ------------------------------------------------------------------------------------------------ the source


def _spaced(text: str) -> str:
    """Runs of whitespace as one space (messages wrap across lines, on the page and in the source)."""
    return re.sub(r"\s+", " ", text).strip()


def _is_string(node: ast.AST) -> bool:
    """Whether ``node`` is a string expression: a literal, an f-string, or a ``+`` chain with one among them."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, ast.JoinedStr):
        return True
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and (
        _is_string(node.left) or _is_string(node.right))


def _render(node: ast.AST, constants: dict[str, str]) -> str:
    """A string expression as text, `HOLE` wherever the code fills something in; the name of a module-level string
    constant (``TOGGLE_REFUSED``, ``_checks.BY_HAND.format(...)``, ``f"{VAL_LOSS}"``) as the constant's text."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_render(value, constants) for value in node.values)
    if isinstance(node, ast.FormattedValue) and node.conversion == -1 and node.format_spec is None:
        return _render(node.value, constants)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _render(node.left, constants) + _render(node.right, constants)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
        return re.sub(r"\{\w*\}", HOLE, _render(node.func.value, constants))
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return constants.get(name, HOLE) if name is not None and name.lstrip("_").isupper() else HOLE


def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of a module's docstring nodes (its own, its classes' and functions')."""
    owners = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef,
                                                                      ast.AsyncFunctionDef)))]
    return {id(owner.body[0].value) for owner in owners if owner.body and isinstance(owner.body[0], ast.Expr)
            and isinstance(owner.body[0].value, ast.Constant)}


def string_texts(tree: ast.Module, constants: dict[str, str]) -> list[str]:
    """Every string expression of ``tree`` outside docstrings, rendered (`_render`) and spaced."""
    docstrings = _docstrings(tree)
    parts = {id(side) for node in ast.walk(tree) if isinstance(node, ast.BinOp) and _is_string(node)
             for side in (node.left, node.right)}
    return [_spaced(_render(node, constants)) for node in ast.walk(tree)
            if _is_string(node) and id(node) not in parts and id(node) not in docstrings]


@cache
def _modules() -> dict[str, ast.Module]:
    """Every module of the package, parsed, by its path in ``lightning_muon/``."""
    return {path.relative_to(PACKAGE).as_posix(): ast.parse(path.read_text())
            for path in sorted(PACKAGE.rglob("*.py"))}


@cache
def _constants() -> dict[str, str]:
    """The module-level string constants of the package, by name (a name two modules give different texts is
    left out: it cannot be told apart without following imports)."""
    found: dict[str, set[str]] = {}
    for tree in _modules().values():
        for node in tree.body:
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                continue
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                pairs = [(target, node.value)]
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):  # A, B = "a", "b"
                    pairs = list(zip(target.elts, node.value.elts))
                for name, value in pairs:
                    if isinstance(name, ast.Name) and _is_string(value):
                        found.setdefault(name.id, set()).add(_render(value, {}))
    return {name: texts.pop() for name, texts in found.items() if len(texts) == 1}


@cache
def source_texts() -> str:
    """Every string expression of the package outside docstrings (`string_texts`), `APART` between them: where a
    quoted message must be found."""
    return APART.join(text for tree in _modules().values() for text in string_texts(tree, _constants()))


@dataclass(frozen=True)
class Site:
    """A raise or a warning with a message: its module, the message as `_render` gives it, and the message
    expression as written (what names a relay, whose message has no text of its own)."""

    module: str
    message: str
    expression: str

    @property
    def text(self) -> str:
        """The message with ``...`` for each hole."""
        return self.message.replace(HOLE, "...")

    @property
    def key(self) -> str:
        """How `RELAYS` names a relay: its module and its message expression."""
        return f"{self.module}: {self.expression}"


def _callee(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.IfExp):  # (rank_zero_warn if is_warning else rank_zero_info)(message)
        func = func.body
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def message_of(node: ast.AST) -> ast.expr | None:
    """The message expression of a ``raise`` (or a ``return``: a function that builds the exception) of a user
    exception, or of a warning or ``parser.error`` call; ``None`` for anything else (``SystemExit(2)`` has no
    message)."""
    if isinstance(node, (ast.Raise, ast.Return)):
        call = node.exc if isinstance(node, ast.Raise) else node.value
        if not (isinstance(call, ast.Call) and _callee(call) in USER_EXCEPTIONS and call.args):
            return None
        message = call.args[0]
        return None if isinstance(message, ast.Constant) and not isinstance(message.value, str) else message
    if isinstance(node, ast.Call) and _callee(node) in MESSAGE_CALLS and node.args:
        return node.args[0]
    return None


@cache
def sites() -> tuple[Site, ...]:
    """Every raise of a user exception with a message in the package, every warning and every ``parser.error``."""
    found = []
    for module, tree in _modules().items():
        for node in ast.walk(tree):
            message = message_of(node)
            if message is not None:
                found.append(Site(module, _spaced(_render(message, _constants())), ast.unparse(message)))
    return tuple(found)


# ------------------------------------------------------------------------------------------------ the page


def quote_pattern(quote: str, whole: bool = False) -> re.Pattern[str]:
    """A quote from the page as a pattern: its literal pieces in order, each ``...`` any text (a hole too) within
    one string expression. Unless it is to match a ``whole`` message, a ``...`` at either end is dropped: it adds
    nothing to a search, and slows it down."""
    pieces = [re.escape(piece) for piece in _spaced(quote).split("...")]
    while not whole and len(pieces) > 1 and not pieces[0]:
        pieces.pop(0)
    while not whole and len(pieces) > 1 and not pieces[-1]:
        pieces.pop()
    return re.compile(f"[^{APART}]*?".join(pieces))


def found_in(quote: str, texts: str) -> bool:
    """Whether a text of ``texts`` (`APART` between them) holds a message worded as ``quote``."""
    return quote_pattern(quote).search(texts) is not None


#: An entry: a ``###`` heading that is one code span, the message (a heading: in the table of contents and the
#: search index, and a link of its own). `BOLD_ENTRY` is the form entries had before, still read as one.
_ENTRY = re.compile(r"^(?:### (`+) ?(.+?) ?\1|\*\*(`+) ?(.+?) ?\3\*\*)$", re.MULTILINE)
BOLD_ENTRY = re.compile(r"^\*\*`.*`\*\*$", re.MULTILINE)
_CODE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)


def entries(text: str) -> list[str]:
    """The quotes of a page's entries: the code span each entry's heading is."""
    return [_spaced(match.group(2) or match.group(4)) for match in _ENTRY.finditer(text)]


def inline_quotes(text: str) -> list[str]:
    """The code spans of a page's paragraphs (entries' headings left out) with four words or more: the messages
    quoted inside an entry, and a few commands and code (`NOT_MESSAGES`)."""
    spans = (_spaced(match.group(2)) for match in _CODE.finditer(_ENTRY.sub("", text)))
    return [span for span in spans if len(span.split()) >= 4]


def quotes(text: str) -> list[str]:
    """Every message a page quotes: its entries' and those inside them."""
    return entries(text) + [quote for quote in inline_quotes(text) if quote not in NOT_MESSAGES]


def quoting(site: Site, patterns: list[re.Pattern[str]]) -> bool:
    """Whether one of the page's quotes (``patterns``) words ``site``'s message."""
    return any(pattern.search(site.message) for pattern in patterns)


def listed_internal(site: Site) -> bool:
    """Whether `INTERNAL` lists ``site``."""
    return any(module == site.module and quote_pattern(message, whole=True).fullmatch(site.message)
               for module, _, message in (key.partition(": ") for key in INTERNAL))


PAGE_TEXT = PAGE.read_text()


# ------------------------------------------------------------------------------------------------ the page's quotes


@pytest.mark.parametrize("quote", entries(PAGE_TEXT))
def test_every_entry_quotes_a_message_of_the_library(quote):
    assert found_in(quote, source_texts()), f"no message in lightning_muon/ is worded as the entry's {quote!r}"


@pytest.mark.parametrize("quote", [q for q in inline_quotes(PAGE_TEXT) if q not in NOT_MESSAGES])
def test_every_message_quoted_inside_an_entry_is_worded_so(quote):
    assert found_in(quote, source_texts()), f"no message in lightning_muon/ is worded as {quote!r}"


def test_what_is_not_a_message_is_on_the_page_and_not_in_the_source():
    assert set(inline_quotes(PAGE_TEXT)) >= NOT_MESSAGES, "a NOT_MESSAGES span is no longer on the page"
    assert [span for span in NOT_MESSAGES if found_in(span, source_texts())] == [], "a message after all"


def test_every_entry_is_a_heading():
    """A bold line is not in the table of contents or the search index and cannot be linked: write ``### `...```."""
    assert BOLD_ENTRY.findall(PAGE_TEXT) == []
    assert entries("**`old form ...`**\n\n### `new form ...`\n") == ["old form ...", "new form ..."]
    assert BOLD_ENTRY.findall("**`old form ...`**\n") == ["**`old form ...`**"]


def test_the_page_starts_from_symptoms():
    symptoms = PAGE_TEXT.split("## Symptoms\n", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^### (.+)$", symptoms, re.MULTILINE) == [
        "Muon is slower per step than AdamW", "My loss got worse after switching to Muon", "Which lr should I use?",
        "Does it run on a GPU?"]


# ------------------------------------------------------------------------------------------------ completeness


def test_every_message_a_user_can_meet_is_quoted():
    patterns = [quote_pattern(quote) for quote in quotes(PAGE_TEXT)]
    missing = [f"{site.module}: {site.text}" for site in sites()
               if site.key not in RELAYS and not listed_internal(site) and not quoting(site, patterns)]
    assert missing == [], "messages with no entry in docs/troubleshooting.md (add one, or, where a user cannot " \
        "meet it, list it in INTERNAL with the reason):\n" + "\n".join(missing)


@pytest.mark.parametrize("key", sorted(INTERNAL))
def test_an_internal_message_is_the_library_s_and_unquoted(key):
    listed = [site for site in sites() if listed_internal(site) and key.startswith(site.module + ": ")
              and quote_pattern(key.partition(": ")[2], whole=True).fullmatch(site.message)]
    assert listed, f"INTERNAL names no message of the library: {key!r}"
    patterns = [quote_pattern(quote) for quote in quotes(PAGE_TEXT)]
    assert not any(quoting(site, patterns) for site in listed), f"the page quotes it: drop {key!r} from INTERNAL"


@pytest.mark.parametrize("key", sorted(RELAYS))
def test_a_relay_is_the_library_s_and_what_it_passes_on_is_quoted(key):
    assert key in {site.key for site in sites()}, f"RELAYS names no raise or warning of the library: {key!r}"
    passed_on = RELAYS[key]
    if passed_on is not None:
        origins = [text for text in source_texts().split(APART) if passed_on in text]
        assert origins, f"no string in lightning_muon/ holds {passed_on!r}"
        patterns = [quote_pattern(quote) for quote in quotes(PAGE_TEXT)]
        assert any(quoting(Site("", text, ""), patterns) for text in origins), f"no quote of {passed_on!r}"


def test_the_sites_are_many_and_the_lists_short():
    assert len(sites()) > 150  # every raise, warning and parser.error of the package, as of this writing ~180
    assert len(INTERNAL) <= 8 and len(RELAYS) <= 10
    assert len(entries(PAGE_TEXT)) >= 75


# ------------------------------------------------------------------------------------------------ the matcher


def _texts(code: str) -> str:
    return APART.join(string_texts(ast.parse(code), {}))


CODE = """
def check(tau, name):
    '''A docstring: tau must be a positive number.'''
    raise ValueError(f"{name}: tau must be a finite number > 0, "
                     "got " + repr(tau) + "; see the guide")
"""


def test_the_matcher_takes_placeholders_split_literals_and_starts():
    texts = _texts(CODE)
    assert found_in("...: tau must be a finite number > 0, got ...; see the guide", texts)
    assert found_in("tau must be a finite number > 0, got", texts)  # the start of a message
    assert found_in("tau must be a finite number > 0, got ...", texts)


def test_the_matcher_refuses_a_reworded_message():
    texts = _texts(CODE)
    assert not found_in("tau must be a finite number >= 0, got ...", texts)
    assert not found_in("tau must be a finite number > 0, got ...; see the docs", texts)
    assert not found_in("tau must be a finite number > 0; got ...", texts)
    assert not found_in("tau must be a finite number > 0, got ...", _texts(CODE.replace("finite", "real")))
    assert not found_in("tau must be a positive number", texts)  # a docstring is not a message
    assert not found_in("see the guide ... not across strings", _texts(CODE + "x = 'not across strings'\n"))


def test_the_matcher_refuses_a_made_up_word_in_a_real_quote():
    quote = "MuonMixin cannot run under strategy='fsdp' (FSDP1)"
    assert quote in entries(PAGE_TEXT) and found_in(quote, source_texts())
    assert not found_in(quote.replace("cannot run", "cannot ever run"), source_texts())
    assert not found_in("MuonMixin cannot run under strategy='deepspeed'", source_texts())


def test_the_page_is_read_as_entries_and_the_messages_inside_them():
    text = (
        "# Page\n\n### `first message ...`\n\nIt means `the second message, quoted here` and `code`.\n\n"
        "### ``parameter `...` matches ...``\n\nThe `other message of\nthe library` says so.\n"
    )
    assert entries(text) == ["first message ...", "parameter `...` matches ..."]
    assert inline_quotes(text) == ["the second message, quoted here", "other message of the library"]


def test_a_site_is_its_message_and_a_relay_its_expression():
    tree = ast.parse("raise MisconfigurationException(f'{n} GradientAccumulationScheduler' f' callbacks' + X)")
    message = message_of(tree.body[0])
    assert message is not None and _render(message, {"X": "!"}) == HOLE + " GradientAccumulationScheduler callbacks!"
    assert message_of(ast.parse("raise SystemExit(2)").body[0]) is None
    assert message_of(ast.parse("raise KeyError('x')").body[0]) is None
    assert "commands/convert.py: str(error)" in {site.key for site in sites()}  # parser.error(str(error))
    toggle = [site for site in sites() if site.expression == "_checks.TOGGLE_REFUSED"]  # a constant, resolved
    assert toggle and all(site.message.startswith("toggle_optimizer ") for site in toggle)
    by_hand = [site for site in sites() if site.expression.startswith("BY_HAND.format(")]  # returned by by_hand
    assert [site.text.split(" optimizes")[0] for site in by_hand] == ["...: ..."]
