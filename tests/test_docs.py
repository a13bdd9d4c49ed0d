"""The documentation site (``mkdocs.yml``, ``docs/``): it builds with no warning (a broken link or
cross-reference, a missing page, a docstring mkdocstrings cannot read fails), its API reference covers the declared
public surface and reads right (values, not source expressions, as defaults; no reStructuredText left over), the
examples in the docstrings parse (and run where they can), and every Markdown table in it and in the README renders
as a table."""

from __future__ import annotations

import ast
import contextlib
import functools
import html
import inspect
import itertools
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

import lightning_muon
import lightning_muon.attention
import lightning_muon.optim.groups
from lightning_muon.optim import defaults

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PACKAGE = ROOT / "lightning_muon"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """The site, built once for this module's tests (``mkdocs build --strict``): the build's result and folder."""
    site_dir = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    return result, site_dir


def test_the_site_builds_strictly(site):
    result, site_dir = site
    assert result.returncode == 0, result.stderr[-3000:]
    assert (site_dir / "api" / "optimizers" / "index.html").is_file()


# ------------------------------------------------------------------ the API reference as a browser shows it


@pytest.fixture(scope="module")
def api_pages(site) -> dict[str, str]:
    """Each API page's rendered article (the HTML between ``<article>`` and ``</article>``), by page name."""
    result, site_dir = site
    assert result.returncode == 0, result.stderr[-3000:]
    pages = {}
    for source in sorted((DOCS / "api").glob("*.md")):
        built = site_dir / "api" / ("index.html" if source.stem == "index" else f"{source.stem}/index.html")
        text = built.read_text()
        pages[source.stem] = text[text.index("<article"): text.index("</article>")]
    return pages


def plain_text(fragment: str) -> str:
    """What a reader sees of an HTML fragment: the tags dropped, the entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


def rendered_signature(page: str, path: str) -> str:
    """The signature block under the heading of the object ``path``, as text."""
    heading = page.index(f'id="{path}"')
    block = re.search(r'<div class="[^"]*doc-signature[^"]*">(.*?)</div>', page[heading:], re.S)
    assert block is not None, f"no signature under {path}"
    return plain_text(block.group(1))


def signature_defaults(signature: str) -> dict[str, str]:
    """The default of each parameter of a rendered signature, as Python source (``ast.unparse``): the signature
    must itself read as Python."""
    tree = ast.parse(f"def {signature.strip()}: pass")
    arguments = tree.body[0].args
    positional = [*arguments.posonlyargs, *arguments.args]
    pairs = [*zip(positional[len(positional) - len(arguments.defaults):], arguments.defaults),
             *zip(arguments.kwonlyargs, arguments.kw_defaults)]
    return {arg.arg: ast.unparse(default) for arg, default in pairs if default is not None}


def rendered_defaults(page: str) -> list[str]:
    """Every place a page shows a default: its signatures, and the Default column of its parameter tables."""
    shown = [plain_text(block) for block in re.findall(r'<div class="[^"]*doc-signature[^"]*">(.*?)</div>', page, re.S)]
    for table in re.findall(r"<table>(.*?)</table>", page, re.S):
        if "<th>Default</th>" in table:
            for row in re.findall(r"<tr[^>]*>(.*?)</tr>", table, re.S):
                cells = re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)
                shown += [plain_text(cells[-1])] if cells else []
    return shown


def constant_defaults() -> set[str]:
    """The source text of every parameter default in the package that names a module-level constant
    (``MUON_CLASS.lr``, ``PAIRED_ADAMW.betas``, ``DEFAULT_CHUNK_ELEMENTS``): what a reader must not see."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.arguments):
                for default in [*node.defaults, *node.kw_defaults]:
                    root = default
                    while isinstance(root, ast.Attribute):
                        root = root.value
                    if isinstance(root, ast.Name) and re.fullmatch(r"[A-Z][A-Z0-9_]+", root.id):
                        found.add(ast.unparse(default))
    return found


def test_no_page_shows_a_constant_s_name_as_a_default(api_pages):
    names = constant_defaults()
    assert {"MUON_CLASS.lr", "PAIRED_MUON.lr", "PAIRED_ADAMW.betas", "DEFAULT_CHUNK_ELEMENTS"} <= names
    shown = {name: rendered_defaults(page) for name, page in api_pages.items()}
    assert len(shown["optimizers"]) > 20  # the signatures and tables were found at all
    leftovers = {name: sorted({n for n in names for text in texts if re.search(rf"\b{re.escape(n)}\b", text)})
                 for name, texts in shown.items()}
    assert {name: found for name, found in leftovers.items() if found} == {}


@pytest.mark.parametrize(("page", "path"), [
    ("optimizers", "lightning_muon.Muon"),
    ("optimizers", "lightning_muon.MuonWithAdamW"),
    ("lightning", "lightning_muon.MuonMixin"),
    ("maths", "lightning_muon.zeropower_via_newtonschulz"),
    ("attention", "lightning_muon.attention.QKClipper"),
], ids=lambda value: value.rsplit(".", 1)[-1])
def test_a_signature_shows_the_values_its_defaults_evaluate_to(api_pages, page, path):
    module_path, name = path.rsplit(".", 1)
    obj = getattr(__import__(module_path, fromlist=[name]), name)
    expected = {p.name: repr(p.default) for p in inspect.signature(obj).parameters.values()
                if p.default is not inspect.Parameter.empty}
    assert signature_defaults(rendered_signature(api_pages[page], path)) == expected


def test_muon_s_signature_shows_its_default_lr(api_pages):
    rendered = signature_defaults(rendered_signature(api_pages["optimizers"], "lightning_muon.Muon"))
    assert ast.literal_eval(rendered["lr"]) == defaults.MUON_CLASS.lr


@pytest.fixture(scope="module")
def site_pages(site) -> dict[str, str]:
    """Every built page's HTML, by its path in the site."""
    result, site_dir = site
    assert result.returncode == 0, result.stderr[-3000:]
    return {page.relative_to(site_dir).as_posix(): page.read_text() for page in site_dir.rglob("*.html")}


def private_paths(html_text: str) -> list[str]:
    """The dotted ``lightning_muon`` paths of a page's heading ids and cross-reference links (``href="...#path"``)
    that pass through a ``_`` module (``lightning_muon.optim._choice.StrategyInfo``)."""
    paths = re.findall(r'<h\d id="(lightning_muon[\w.]*)"', html_text)
    paths += re.findall(r'href="[^"]*#(lightning_muon[\w.]*)"', html_text)
    return sorted({path for path in paths if any(part.startswith("_") for part in path.split(".")[:-1])})


def test_no_heading_or_cross_reference_carries_a_private_module_path(site_pages):
    assert len(site_pages) > 20
    assert private_paths('<h2 id="lightning_muon.optim._choice.StrategyInfo">') == [
        "lightning_muon.optim._choice.StrategyInfo"]
    assert private_paths('<a href="../api/#lightning_muon.optim.StrategyInfo">') == []
    found = {name: private_paths(text) for name, text in site_pages.items()}
    assert {name: paths for name, paths in found.items() if paths} == {}


def test_the_api_reference_renders_under_the_paths_users_import(api_pages):
    ids = {i for page in api_pages.values() for i in re.findall(r'<h\d id="([\w.]+)"', page)}
    for name in lightning_muon.__all__:
        assert f"lightning_muon.{name}" in ids, name
    assert "lightning_muon.optim.StrategyInfo" in ids


@pytest.mark.parametrize("page", sorted((DOCS / "api").glob("*.md")), ids=lambda p: p.name)
def test_every_api_page_shows_the_import_line_of_what_it_renders(page):
    text = page.read_text()
    rendered = re.findall(r"^::: ([\w.]+)", text, flags=re.MULTILINE)
    if not rendered:
        return  # the index
    block = python_blocks(text)[0]  # the import line comes first
    namespace: dict = {}
    exec(compile(block, str(page), "exec"), namespace)
    for path in rendered:
        module, _, name = path.rpartition(".")
        shown = getattr(__import__(module, fromlist=[name]), name)
        if inspect.ismodule(shown):  # a whole module's page: the module, or names from it
            assert namespace.get(name) is shown or f"from {path} import" in block, path
        else:
            assert namespace.get(name) is shown, path


def literal_markers(page: str) -> list[str]:
    """The paragraphs of a page that end in ``::``, reStructuredText's literal-block marker (Markdown prints it)."""
    paragraphs = (plain_text(p).strip() for p in re.findall(r"<p>(.*?)</p>", page, re.S))
    return [p for p in paragraphs if p.endswith("::")]


def test_no_restructuredtext_literal_marker_is_left(api_pages):
    stray = {name: literal_markers(page) for name, page in api_pages.items()}
    assert {name: found for name, found in stray.items() if found} == {}
    assert literal_markers("<p>For every <code>p</code> (as <code>torch</code>)::</p><p>a: b</p>") == [
        "For every p (as torch)::"]


def test_no_page_renders_a_private_name(api_pages):
    """``__all__`` and ``_helpers`` stay out of the reference (the module pages filter by ``__all__``)."""
    ids = {name: re.findall(r'<h\d id="([\w.]+)"', page) for name, page in api_pages.items()}
    assert len(ids["groups"]) > 10
    private = {name: [i for i in found if i.rsplit(".", 1)[-1].startswith("_")] for name, found in ids.items()}
    assert {name: found for name, found in private.items() if found} == {}


def test_attribute_comments_render_as_their_docs(api_pages):
    """The ``#:`` comment above each public constant of ``groups`` is the text under its heading."""
    source = (PACKAGE / "optim" / "groups.py").read_text().splitlines()
    page = " ".join(plain_text(api_pages["groups"]).split())
    for name in ("ADJUST_LR_FNS", "LAYOUTS", "DEFAULT_BATCH_BYTES", "DEFAULT_BATCH_BYTES_ACCELERATOR"):
        line = next(i for i, text in enumerate(source) if text.startswith(f"{name} ="))
        comment = []
        while source[line - 1 - len(comment)].startswith("#:"):
            comment.insert(0, source[line - 1 - len(comment)][2:].strip())
        assert comment, name
        assert " ".join(" ".join(comment).replace("`", "").split()) in page, name


# ------------------------------------------------------------------ the code blocks in the docstrings


def docstring_blocks() -> dict[str, tuple[str, str]]:
    """Every fenced block in the package's docstrings: ``module.qualname#n`` -> (language, code)."""
    blocks: dict[str, tuple[str, str]] = {}

    def visit(node: ast.AST, qualname: str) -> None:
        doc = ast.get_docstring(node) if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef) else None
        fences = re.findall(r"^( *)```(\w*)\n(.*?)^\1```$", doc or "", re.M | re.S)
        for n, (_, language, code) in enumerate(fences):
            blocks[f"{qualname}#{n}"] = (language, textwrap.dedent(code))
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, f"{qualname}.{child.name}")

    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        visit(ast.parse(path.read_text()), ".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return blocks


def test_docstrings_use_fences_not_restructuredtext():
    """A docstring line ending in ``::`` is a reStructuredText literal block, which mkdocstrings (Markdown) shows
    as a stray ``::``: examples go in an ``Examples:`` section, in a fenced block."""
    marked = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (ast.get_docstring(node) or "").splitlines()
                marked += [f"{path.relative_to(ROOT)}: {line.strip()}" for line in lines if line.endswith("::")]
    assert marked == []


#: The Python blocks run by `test_a_docstring_example_runs`, with the names each needs: a block stands alone but
#: for the names a reader has imported (Lightning, the class it shows) or brings (their own module).
RUN = {
    "lightning_muon.callbacks.monitor.MuonMonitor#0": ("MuonMonitor",),
    "lightning_muon.callbacks.qk_clip.QKClip#0": ("QKClip", "CSVLogger"),
    "lightning_muon.callbacks.clock.WallClock#0": ("WallClock", "CSVLogger"),
    "lightning_muon.callbacks.schedules.MomentumSchedule#0": ("MomentumSchedule",),
    "lightning_muon.callbacks.schedules.WeightDecaySchedule#0": ("WeightDecaySchedule",),
    "lightning_muon.attention.layout.QKLayout#0": ("nn", "F", "QKLayout", "QKProjection", "record_qk"),
    "lightning_muon.lightning.mixin#0": ("MuonMixin", "MyExistingModule"),
    # the core classes' examples stand alone: they import what they use
    "lightning_muon.optim.muon.Muon#1": (),  # #0 is the update rule, a text block
    "lightning_muon.combined.muon_with_adamw.MuonWithAdamW#0": (),
    "lightning_muon.optim.adamw.AdamW#0": (),
    "lightning_muon.lightning.finetuning.MuonBackboneFinetuning#0": (),
    "lightning_muon.routing._rules.route_parameters#0": (),
    "lightning_muon.optim.newton_schulz.zeropower_via_newtonschulz#1": (),  # #0 is the iteration, a text block
    "lightning_muon.optim.newton_schulz.orthogonality_error#0": (),
    "lightning_muon.optim.groups.adjust_lr#0": (),
    "lightning_muon.optim._bucket.ParamDiagnostics#0": (),
    "lightning_muon.routing._routing.Routing#0": (),
    "lightning_muon.routing._trace.GraphRoles#0": (),
    "lightning_muon.routing._trace.trace_roles#0": (),
    "lightning_muon.lightning._named.muon_subclass#0": (),
    "lightning_muon.lightning.mixin.MuonMixin#0": ("MuonMixin", "MyExistingModule", "functools", "lightning_muon"),
}
#: The Python blocks that only parse, and why they cannot run on their own.
PARSE_ONLY = {
    "lightning_muon.attention.clipper.QKClipper#0":
        "a training loop over the reader's model, data loader and optimizer (tests/attention run the clipper)",
}


def test_every_python_block_in_a_docstring_is_run_or_said_why_not():
    python = {key for key, (language, _) in docstring_blocks().items() if language == "python"}
    assert python == set(RUN) | set(PARSE_ONLY)
    assert not set(RUN) & set(PARSE_ONLY)


@pytest.mark.parametrize("key", sorted(key for key, (lang, _) in docstring_blocks().items() if lang == "python"))
def test_a_docstring_python_block_parses(key):
    ast.parse(docstring_blocks()[key][1], filename=key)


@pytest.mark.parametrize("key", sorted(key for key, (lang, _) in docstring_blocks().items() if lang == "yaml"))
def test_a_docstring_yaml_block_loads_and_names_real_classes(key):
    data = yaml.safe_load(docstring_blocks()[key][1])
    paths = re.findall(r"'class_path': '([\w.]+)'", repr(data))
    assert paths, key
    for path in paths:
        module, name = path.rsplit(".", 1)
        assert hasattr(__import__(module, fromlist=[name]), name), path


def promised_output(code: str) -> list[str]:
    """What a block says its top-level ``print`` lines write: the comment after each (``print(x)  # 0.04: why``
    promises a line that starts with ``0.04``, the comment up to the ``": "`` that starts a why)."""
    return [line.split("  # ", 1)[1].split(": ", 1)[0]
            for line in code.splitlines() if line.startswith("print(") and "  # " in line]


def test_a_promised_output_is_read_up_to_its_why():
    assert promised_output('print(x)  # 0.04: a 4:1 matrix\nprint(y)  # [\'a\']\n    print(z)  # no\n') == [
        "0.04", "['a']"]
    assert promised_output("print(x)\nprint(y)  # 0.1109: 0.2 sqrt(768) times\n") == ["0.1109"]


@pytest.mark.parametrize("key", sorted(RUN))
def test_a_docstring_example_runs(key, monkeypatch, tmp_path, capsys):
    import lightning as L
    import torch.nn.functional as F
    from lightning.pytorch.loggers import CSVLogger
    from torch import nn

    from lightning_muon import MomentumSchedule, MuonMixin, MuonMonitor, QKClip, WallClock, WeightDecaySchedule
    from lightning_muon.attention import QKLayout, QKProjection, record_qk

    class MyExistingModule(L.LightningModule):
        pass

    available = {"MuonMonitor": MuonMonitor, "QKClip": QKClip, "WallClock": WallClock, "CSVLogger": CSVLogger,
                 "nn": nn, "F": F, "QKLayout": QKLayout, "QKProjection": QKProjection, "record_qk": record_qk,
                 "MuonMixin": MuonMixin, "MyExistingModule": MyExistingModule, "functools": functools,
                 "lightning_muon": lightning_muon, "MomentumSchedule": MomentumSchedule,
                 "WeightDecaySchedule": WeightDecaySchedule}
    monkeypatch.chdir(tmp_path)  # a Trainer or a logger that writes anything writes it here
    namespace = {"L": L, **{name: available[name] for name in RUN[key]}}
    code = docstring_blocks()[key][1]
    capsys.readouterr()
    exec(compile(code, key, "exec"), namespace)
    made = {k: v for k, v in namespace.items() if k not in available and k not in ("L", "__builtins__")}
    assert made, f"{key} defined nothing"
    printed = iter(capsys.readouterr().out.splitlines())
    for promise in promised_output(code):  # each, in order, starts a printed line
        assert any(line.startswith(promise) for line in printed), f"{key} does not print {promise!r}"


def documented() -> set[str]:
    """The objects the API pages render (``::: dotted.path`` lines), by their last name; a whole module's
    page renders every name in its ``__all__``."""
    names: set[str] = set()
    for page in (DOCS / "api").glob("*.md"):
        for path in re.findall(r"^::: ([\w.]+)", page.read_text(), flags=re.MULTILINE):
            module = {"lightning_muon.attention": lightning_muon.attention,
                      "lightning_muon.optim.groups": lightning_muon.optim.groups}.get(path)
            names |= set(module.__all__) if module is not None else {path.rsplit(".", 1)[-1]}
    return names


@pytest.mark.parametrize("tier", [lightning_muon, lightning_muon.attention, lightning_muon.optim.groups],
                         ids=lambda m: m.__name__)
def test_the_api_reference_covers_every_public_name(tier):
    missing = sorted(set(tier.__all__) - documented())
    assert not missing, f"{tier.__name__} names with no place in docs/api/: {missing}"


def glued_to_a_table(text: str) -> list[str]:
    """Lines of text directly under a Markdown table (outside code blocks): a renderer reads them as more rows."""
    glued, fenced, previous = [], False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and previous.startswith("|") and line.strip() and not line.startswith("|"):
            glued.append(line)
        previous = "" if fenced else line
    return glued


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))], ids=lambda p: p.name)
def test_every_table_stands_alone(page):
    assert glued_to_a_table(page.read_text()) == []


def test_text_glued_under_a_table_is_caught():
    assert glued_to_a_table("| a | b |\n|---|---|\n| 1 | 2 |\nglued\n") == ["glued"]
    assert glued_to_a_table("| a | b |\n|---|---|\n| 1 | 2 |\n\napart\n") == []


def misindented_list_items(text: str) -> list[str]:
    """List items (outside code blocks) indented by a number of spaces that is not a multiple of 4: Python-Markdown
    nests a list only 4 spaces in, so a sub-list 3 spaces in renders as more items of the list above it."""
    found, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"^( +)(?:[-*+]|\d+\.) ", line)) and len(match.group(1)) % 4:
            found.append(line)
    return found


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))], ids=lambda p: p.name)
def test_every_nested_list_is_indented_to_nest(page):
    assert misindented_list_items(page.read_text()) == []


def test_a_list_nested_three_spaces_in_is_caught():
    assert misindented_list_items("1. one\n   - sub\n2. two\n") == ["   - sub"]
    assert misindented_list_items("1. one\n    - sub\n2. two\n```\n   - code\n```\n") == []


def test_the_mixin_s_update_renders_as_its_seven_steps(site_pages):
    """The ordered list of the mixin guide's update, as a browser shows it: 7 steps, two bullets under step 4."""
    page = site_pages["guides/mixin/index.html"]
    ordered = page[page.index("<ol>"):]
    depth, items, position = 0, 0, 0
    for tag in re.finditer(r"<(/?)(ol|ul|li)\b", ordered):
        closing, name = tag.group(1), tag.group(2)
        if name in ("ol", "ul"):
            depth += -1 if closing else 1
            if depth == 0:
                break
        elif not closing and depth == 1:
            items += 1
        position = tag.end()
    assert items == 7, ordered[:position]
    source = (DOCS / "guides" / "mixin.md").read_text()
    assert len(re.findall(r"^[1-7]\. \*\*", source, re.MULTILINE)) == 7


def test_the_mixin_s_example_on_its_api_page_trains(monkeypatch, tmp_path, capsys):
    """The example above `MuonMixin` on the Lightning API page (it lives on the page: the class stays under 250
    lines, tests/test_layout.py), run as written."""
    monkeypatch.chdir(tmp_path)
    example = python_blocks((DOCS / "api" / "lightning.md").read_text())[1]
    exec(compile(example, "docs/api/lightning.md block 1", "exec"), {"__name__": "api_example"})
    assert capsys.readouterr().out.strip().splitlines()[-1] == "['net.2.weight']"


#: The pages whose Python blocks the tests run, and how many each has: the guides' in the tests that read them
#: (tests/test_readme.py, tests/optim/test_one_optimizer_readme.py, tests/attention/test_qk_readme.py,
#: tests/optim/test_user_rules.py, tests/routing/test_routing_guide.py, tests/test_migration.py,
#: tests/test_getting_started.py: the getting-started
#: page and the README's ten lines), and the API pages' import lines here.
RUN_BY_TESTS = {"guides/plain-pytorch.md": 2, "guides/one-optimizer.md": 4, "guides/qk-clip.md": 2,
                "guides/routing.md": 1, "guides/migration.md": 7, "guides/optimizer.md": 2, "index.md": 3,
                "api/optimizers.md": 1, "api/lightning.md": 2, "api/maths.md": 1, "api/routing.md": 1,
                "api/attention.md": 1, "api/groups.md": 1}


def test_every_python_block_is_run_by_a_test():
    pages = {page.relative_to(DOCS).as_posix(): page.read_text() for page in DOCS.rglob("*.md")}
    counts = {name: text.count("```python\n") for name, text in pages.items() if "```python\n" in text}
    assert counts == RUN_BY_TESTS


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_the_readme_links_pages_that_exist():
    """The README is the newcomer's first screen: each capability a paragraph and a relative link to its page,
    which a Git host makes clickable (tests/test_packaging.py says what a package index page does with them); no
    page is named as a bare path any more."""
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    pages = [link for link in links if not link.startswith("http")]
    assert {"docs/guides/mixin.md", "docs/guides/fine-tuning.md", "docs/guides/distributed.md",
            "docs/troubleshooting.md", "docs/benchmarks.md", "docs/explanations/how-muon-works.md"} <= set(pages)
    assert [page for page in pages if not (ROOT / page).is_file()] == []
    assert re.findall(r"`(docs/[\w/-]+\.md)`", text) == []
    assert len(text.splitlines()) <= 200


# ------------------------------------------------------------------ output readable on screen

#: How many columns a code block shows at 1400 px with both sidebars (docs/stylesheets/extra.css, measured with a
#: headless browser): an aligned line of output (a table's row) must fit; other output lines wrap on screen.
COLUMNS = 100


def aligned_lines_too_wide(text: str) -> list[str]:
    """The lines of a page's output blocks (```text) wider than `COLUMNS` that are aligned in columns (two spaces
    between words, or a box drawn by rich): the CSS wraps a long line, and a wrapped table row falls apart."""
    found = []
    for block in re.findall(r"```text\n(.*?)```", text, re.S):
        found += [line for line in block.splitlines()
                  if len(line) > COLUMNS and re.search(r"\S {2,}\S|[│┃─━]", line)]
    return found


def test_a_wide_table_row_in_an_output_block_is_caught():
    row = "name" + " " * 60 + "AdamW" + " " * 40 + "rule"
    assert aligned_lines_too_wide(f"```text\n{row}\n```\n") == [row]
    assert aligned_lines_too_wide(f"```text\n{'a log line ' * 20}\n```\n") == []  # it wraps
    assert aligned_lines_too_wide(f"```python\n{row}\n```\n") == []


@pytest.mark.parametrize("page", sorted(DOCS.rglob("*.md")), ids=lambda p: p.relative_to(DOCS).as_posix())
def test_every_table_in_an_output_block_fits_the_code_column(page):
    assert aligned_lines_too_wide(page.read_text()) == []


def test_python_on_the_pages_and_in_the_docstrings_fits_the_code_column():
    """Python does not wrap (a wrapped line reads as two): each line of the pages' blocks and the docstrings'
    examples fits `COLUMNS`."""
    blocks = {f"{page.relative_to(DOCS)} #{n}": code for page in sorted(DOCS.rglob("*.md"))
              for n, code in enumerate(python_blocks(page.read_text()))}
    blocks |= {key: code for key, (language, code) in docstring_blocks().items() if language == "python"}
    wide = {key: [line for line in code.splitlines() if len(line) > COLUMNS] for key, code in blocks.items()}
    assert {key: lines for key, lines in wide.items() if lines} == {}


def test_output_blocks_wrap_and_the_copy_button_covers_no_text(site_pages):
    """Output and shell blocks carry their language as a class (``pygments_lang_class``), which the site's CSS
    wraps; every code block keeps its text clear of the copy button's corner."""
    css = (DOCS / "stylesheets" / "extra.css").read_text()
    rules = {selectors.strip(): body for selectors, body in re.findall(r"([^{}]+)\{([^}]*)\}", re.sub(
        r"/\*.*?\*/", "", css, flags=re.S))}
    wrapped = next(body for selectors, body in rules.items() if ".language-text pre > code" in selectors)
    assert "white-space: pre-wrap" in wrapped
    assert any(".language-bash pre > code" in selectors for selectors in rules)
    assert "padding-right" in rules[".md-typeset pre > code"]
    page = site_pages["index.html"]
    assert '<div class="language-text highlight">' in page and '<div class="language-python highlight">' in page


# ------------------------------------------------------------------ links


def raw_references(page: str) -> list[str]:
    """Markdown references a page shows as text (``[Muon][lightning_muon.Muon]``, ``[page][]``) instead of a link:
    what an unresolved cross-reference looks like; code blocks, which may index with brackets, left out."""
    article = page[page.find("<article"): page.find("</article>")]
    text = plain_text(re.sub(r"<pre\b.*?</pre>", "", article, flags=re.S))
    return re.findall(r"\[[^\[\]\n]{1,120}\]\[(?:[A-Za-z_][\w.-]*)?\]", text)


def test_a_raw_reference_is_caught():
    assert raw_references('<article><p>[<code>Muon</code>][lightning_muon.Muon] and [the page][]</p></article>') == [
        "[Muon][lightning_muon.Muon]", "[the page][]"]
    assert raw_references('<article><p><a href="#m"><code>Muon</code></a></p><pre>x[0][i]</pre></article>') == []


def test_every_cross_reference_resolves(site_pages):
    found = {name: raw_references(page) for name, page in site_pages.items() if name.endswith(".html")}
    assert {name: refs for name, refs in found.items() if refs} == {}


def test_pages_link_to_the_next_and_sections_have_index_pages(site_pages):
    """Previous and next at every page's foot (Material's ``navigation.footer``), and the sections open on their
    own page (``navigation.indexes``: ``guides/index.md``, ``explanations/index.md``, ``api/index.md``)."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert {"navigation.footer", "navigation.indexes"} <= set(config["theme"]["features"])
    sections = {name: pages for entry in config["nav"] if isinstance(entry, dict) for name, pages in entry.items()}
    for section, index in [("Guides", "guides/index.md"), ("Explanations", "explanations/index.md"),
                           ("API reference", "api/index.md")]:
        assert sections[section][0] == index, section
    page = site_pages["guides/routing/index.html"]
    assert all(f'class="md-footer__link md-footer__link--{way}"' in page for way in ("prev", "next"))


# ------------------------------------------------------------------ a complete reference


def public_objects() -> dict[str, object]:
    return {name: getattr(lightning_muon, name) for name in lightning_muon.__all__}


@pytest.mark.parametrize("name", lightning_muon.__all__)
def test_every_public_name_has_an_example(name):
    """Each name ``lightning_muon`` exports shows how it is used, in an ``Examples:`` section whose block a test
    runs (`RUN`, or a config that `test_a_docstring_yaml_block_loads_and_names_real_classes` loads)."""
    doc = inspect.getdoc(public_objects()[name]) or ""
    assert re.search(r"^Examples:\n", doc, re.M), f"{name} has no Examples section"
    assert "```" in doc.split("Examples:", 1)[1], f"{name}'s Examples section has no code block"


def documented_parameters(obj: object) -> set[str]:
    """The names an object's docstring documents: its ``Args:`` entries, and for a dataclass or named tuple the
    fields with a ``#:`` comment (the reference renders those as the fields' docs)."""
    doc = inspect.getdoc(obj) or ""
    section = re.search(r"^Args:\n((?:(?: {4}.*)?\n)*)", doc + "\n", re.M)
    names = set(re.findall(r"^ {4}(\w+)(?: \([^)]*\))?:", section.group(1), re.M)) if section else set()
    if inspect.isclass(obj):
        source = inspect.getsource(obj).splitlines()
        names |= {match.group(1) for above, line in itertools.pairwise(source)
                  if above.strip().startswith("#:") and (match := re.match(r"\s+(\w+):", line))}
    return names


@pytest.mark.parametrize("name", lightning_muon.__all__)
def test_every_parameter_of_a_public_name_is_documented(name):
    obj = public_objects()[name]
    signature = inspect.signature(obj)
    parameters = [p for p, spec in signature.parameters.items()
                  if spec.kind not in (spec.VAR_POSITIONAL, spec.VAR_KEYWORD)]
    missing = [p for p in parameters if p not in documented_parameters(obj)]
    assert missing == [], f"{name}: no entry for {missing}"


def test_a_missing_parameter_entry_is_caught():
    def f(a, b):
        """Does.

        Args:
            a: the first.
        """

    assert documented_parameters(f) == {"a"}


def package_names() -> set[str]:
    """The names the package defines at the top level of its modules (classes, functions, constants)."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return {name for name in names if not name.startswith("_")}


def public_parameter_names() -> set[str]:
    """Every parameter name of the public tiers' callables and their methods (``momentum``, ``parent_lr``): a
    docstring naming one names an argument, not an object."""
    names: set[str] = set()
    for tier in (lightning_muon, lightning_muon.attention, lightning_muon.optim.groups):
        for obj in (getattr(tier, name) for name in tier.__all__):
            members = [obj, *(m for _, m in inspect.getmembers(obj, callable))] if inspect.isclass(obj) else [obj]
            for member in members:
                with contextlib.suppress(TypeError, ValueError):
                    names |= set(inspect.signature(member).parameters)
    return names


def test_every_object_a_docstring_names_has_an_entry(api_pages):
    """A name the reference shows as code (`` `split_state_dict` ``) that is one of the package's own objects has
    its own entry on an API page; internals are described, not named."""
    entries = {path.rsplit(".", 1)[-1]
               for page in api_pages.values() for path in re.findall(r'id="(lightning_muon[\w.]*)"', page)}
    shown = {html.unescape(code).rsplit(".", 1)[-1]
             for page in api_pages.values() for code in re.findall(r"<code>([A-Za-z_][\w.]*)</code>", page)}
    dangling = (shown & package_names()) - entries - public_parameter_names()
    assert sorted(dangling) == [], sorted(dangling)
