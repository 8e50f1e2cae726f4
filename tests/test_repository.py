"""The repository itself: its text speaks of the software and nothing else, the relative links of
its documents resolve, the cost model's modules stay short, no module reaches into another's
private names, the benchmarks and the tests share code only through the library, and ``import
autopar`` stays light.

Every check reads files (the last also starts one interpreter); each failure lists
``file:line`` of what it found."""
import ast
import bisect
import os
import pathlib
import re
import subprocess
import sys
import urllib.parse

ROOT = pathlib.Path(__file__).resolve().parent.parent
HERE = pathlib.Path(__file__).resolve().relative_to(ROOT).as_posix()


def _repository_files() -> list[str]:
    """Paths (relative, POSIX) of the repository's files: git's tracked files and the untracked
    ones it does not ignore; without git, every file outside hidden and build folders."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True, timeout=30).stdout.decode()
        names = sorted({n for n in out.split("\0") if n})
    except (OSError, subprocess.SubprocessError):
        skip = {"__pycache__", "build", "dist"}
        names = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if p.is_file()
                       and not any(part.startswith(".") or part in skip or part.endswith(".egg-info")
                                   for part in p.relative_to(ROOT).parts))
    return [n for n in names if (ROOT / n).is_file()]


FILES = _repository_files()
TEXT_SUFFIXES = (".py", ".md", ".txt", ".toml")


def _is_text(name: str) -> bool:
    return name.endswith(TEXT_SUFFIXES) or name.startswith(".ci/")


class _Lines:
    """Line numbers of offsets into a text."""

    def __init__(self, text: str):
        self.starts = [0] + [m.end() for m in re.finditer("\n", text)]

    def __call__(self, offset: int) -> int:
        return bisect.bisect_right(self.starts, offset)


# ---- no words about how the project was made -----------------------------------------------------

# "stop", "run", "issue" or "item" and a number (a range, a list) naming a step of the project's
# history, with what follows it. A count of things ("run 3 steps", "runs 12 pairs") is followed by
# the things' name; a history reference by punctuation, a possessive, a parenthesis or one of
# NUMBERED_HISTORY_WORDS ("from that one on", "it read ...").
NUMBERED = re.compile(r"(?<![-\w])(?:stop|run|issue|item)s?\s+\d+(?:\s*(?:-|–|,|and)\s*\d+)*", re.I)
FOLLOWING_WORD = re.compile(r"\s+([A-Za-z][\w-]*)")
NUMBERED_HISTORY_WORDS = {"and", "or", "to", "on", "onward", "onwards", "through", "read", "reads", "measured",
                          "took", "ran", "had", "has", "was", "were", "is", "showed", "found", "gave", "picked",
                          "with", "in", "at", "from", "here", "there", "did", "left", "kept", "the", "a",
                          "an", "this", "that", "its", "it", "as", "but", "so", "for", "by", "which", "where"}
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
# a hash of 10 to 40 hex digits (letters and digits both), or "commit" and a short one
HEX = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{10,40}\b")
COMMIT = re.compile(r"\bcommits?\s+[0-9a-f]{7,40}\b", re.I)
BEFORE = re.compile(r"\(before\b(?::|\s+(?:\d|runs?\b|stops?\b|commits?\b|sessions?\b))", re.I)
SESSION = re.compile(r"\bsessions?\b", re.I)
# pytest's session (the fixtures' scope, its hooks' argument, what a fixture keeps for it)
PYTEST_SESSION = re.compile(r"scope\s*=\s*[\"']session[\"']|\bsession\s+fixtures?\b|\(session\)"
                            r"|\b(?:per|for\s+the)\s+(?:pytest\s+|test\s+)?session\b|\b(?:pytest|test)\s+session\b",
                            re.I)

# Where a date is a fact of the text: BENCHMARKS.md and the benchmarks' recorded outputs state the
# machine and the date of each figure they hold.
DATED = ("BENCHMARKS.md", "benchmarks/results/")
# Generated text that may hold hex digits: the golden files are the compiler's own output.
HEX_FREE = ("tests/golden/",)
# (file, exact text) that one of the patterns matches and is about the software
ALLOWED = {
    ("tests/test_cluster.py", "0123456789ab"),              # a stand-in for the calibration code's hash
    ("tests/test_dump_explain.py", "the session's calibration"),    # conftest's local_cluster fixture
}


def _allowed(name: str, text: str, start: int, end: int) -> bool:
    return any(name == f and text.find(s, max(0, start - len(s)), end + len(s)) != -1 for f, s in ALLOWED)


def _process_words(name: str, text: str):
    """(match, what) of every word about the project's making in ``text`` of file ``name``."""
    for m in NUMBERED.finditer(text):
        follow = FOLLOWING_WORD.match(text, m.end())
        if follow and follow.group(1).lower() not in NUMBERED_HISTORY_WORDS:
            continue                 # a count: "run 3 steps"
        yield m, "a numbered step of the project's history"
    if not name.startswith(DATED):
        for m in DATE.finditer(text):
            yield m, "a date"
    if not name.startswith(HEX_FREE):
        for m in HEX.finditer(text):
            yield m, "a commit hash"
    for m in COMMIT.finditer(text):
        yield m, "a commit"
    for m in BEFORE.finditer(text):
        yield m, "what the code was before"
    sessions = list(SESSION.finditer(text))
    pytest_session = [p.span() for p in PYTEST_SESSION.finditer(text)] if sessions else []
    for m in sessions:
        if not any(a <= m.start() < b for a, b in pytest_session):
            yield m, "a working session"


def test_the_text_speaks_of_the_software_only():
    """No tracked text (code, comments, documents, tests) says how the project was made: no
    numbered stops, runs, issues or items of its history, no dates of work (BENCHMARKS.md and
    the recorded benchmark outputs date their figures), no working sessions (pytest's session is
    the software's), no commit hashes, no "what it was before"."""
    found = []
    for name in FILES:
        if name == HERE or not _is_text(name):
            continue                 # this file names the patterns it looks for
        text = (ROOT / name).read_text(encoding="utf-8", errors="replace")
        line = _Lines(text)
        for m, what in _process_words(name, text):
            if not _allowed(name, text, m.start(), m.end()):
                found.append((name, line(m.start()), what, m.group(0)))
    found.sort()
    assert not found, (f"{len(found)} words about how the project was made (say what the code is and where it "
                       "is measured instead):\n" +
                       "\n".join(f"{n}:{ln}: {what}: {' '.join(s.split())!r}" for n, ln, what, s in found))


def test_the_process_words_are_told_from_the_softwares():
    history = ["since run 7 the fit", "hold-out runs 3-4)", "Runs 4, 5 and 6: within", "stop 9's code",
               "(issue 2)", "from run 4 on", "(before: one a tensor)", "measured on 2000-01-31",
               "commit abc1234", "at 0a1b2c3d4e5f", "this session", "in the fourth session"]
    software = ["run 3 steps under the profiler", "runs\n    2 stages", "[--runs 2]", "issues 8 collectives",
                "2.0 s before: ValueError", '@pytest.fixture(scope="session")', "measured once per session",
                "kept for the\nsession", "def pytest_collection_finish(session):", "item 0 of the tuple"]
    for text in history:
        assert list(_process_words("x.py", text)), text
    for text in software:
        assert not list(_process_words("x.py", text)), text
    assert not list(_process_words("BENCHMARKS.md", "measured 2026-12-07 on the 2-core CPU machine"))


# ---- the documents' relative links resolve -------------------------------------------------------

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
ATX = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")


def _documents() -> list[str]:
    docs = [n for n in ("README.md", "BENCHMARKS.md") if n in FILES]
    return docs + [n for n in FILES if n.startswith("docs/") and n.endswith(".md")]


def _prose_lines(text: str):
    """(line number, line) of a Markdown text outside its fenced code blocks."""
    fence = None
    for i, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m:
            if fence is None:
                fence = m.group(1)
            elif m.group(1) == fence:
                fence = None
            continue
        if fence is None:
            yield i, line


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text in lower case, without what is not a letter, a
    digit, a space, a hyphen or an underscore, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)     # a link: its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a Markdown text's headings (a repeated one gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    previous = None
    for _, line in _prose_lines(text):
        m = ATX.match(line)
        heading = m.group(2) if m else None
        if heading is None and previous and previous.strip() and re.match(r"^\s{0,3}(=+|-+)\s*$", line) \
                and not ATX.match(previous) and not previous.lstrip().startswith(("-", "*", ">", "|")):
            heading = previous.strip()        # a setext heading
        previous = line
        if heading is None:
            continue
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def _links(text: str):
    """(line number, target) of every link and image of a Markdown text outside code."""
    for i, line in _prose_lines(text):
        prose = INLINE_CODE.sub("", line)
        for m in LINK.finditer(prose):
            yield i, m.group(1)
        m = REFERENCE.match(prose)
        if m:
            yield i, m.group(1)


def test_the_documents_relative_links_resolve():
    """Every relative link of README.md, BENCHMARKS.md and docs/*.md names a file of the
    repository, and its anchor, if any, a heading of that file (GitHub's anchors)."""
    bad, cache = [], {}
    for doc in _documents():
        text = (ROOT / doc).read_text(encoding="utf-8")
        for line, target in _links(text):
            target = target.strip("<>")
            if SCHEME.match(target):
                continue             # a URL
            path, _, anchor = target.partition("#")
            path = urllib.parse.unquote(path)
            file = (ROOT / doc).parent / path if path else ROOT / doc
            where = f"{doc}:{line}: ({target})"
            if not file.exists():
                bad.append(f"{where}: no file {os.path.relpath(file, ROOT)}")
                continue
            if anchor and file.is_file() and file.suffix == ".md":
                if file not in cache:
                    cache[file] = anchors(file.read_text(encoding="utf-8"))
                if urllib.parse.unquote(anchor).lower() not in cache[file]:
                    bad.append(f"{where}: no heading of {os.path.relpath(file, ROOT)} has the anchor #{anchor}")
    assert not bad, "links that do not resolve:\n" + "\n".join(bad)


def test_anchors_are_githubs():
    assert slug("bench_holdout.py: the planner's picks, measured") == "bench_holdoutpy-the-planners-picks-measured"
    assert slug("Check a machine: `python -m autopar doctor`") == "check-a-machine-python--m-autopar-doctor"
    assert slug("[Links](x.md) and *emphasis*") == "links-and-emphasis"
    assert anchors("# A\n\n```\n# not a heading\n```\n## A\nB\n-\n") == {"a", "a-1", "b"}


# ---- the cost model's modules stay short ---------------------------------------------------------

COST_MAX_LINES = 600


def test_no_cost_module_is_longer_than_600_lines():
    """A file of cost/ longer than COST_MAX_LINES lines holds more than one subject: split it."""
    long = [f"{n}:{len((ROOT / n).read_text(encoding='utf-8', errors='replace').splitlines())}"
            for n in FILES if n.startswith("cost/")]
    long = [x for x in long if int(x.rsplit(":", 1)[1]) > COST_MAX_LINES]
    assert not long, f"files of cost/ over {COST_MAX_LINES} lines (path:lines):\n" + "\n".join(long)


# ---- no module imports another module's private names --------------------------------------------

PACKAGES = {"autopar": "autopar", "autopar.passes": "passes", "autopar.cost": "cost"}
SCRIPT_FOLDERS = ("tests", "benchmarks", "examples")      # their folders are on sys.path when they run


def _project_modules() -> dict[str, str]:
    """{module name: file} of every Python module of the project, as it is imported."""
    out = {}
    for name in FILES:
        if not name.endswith(".py"):
            continue
        parts = pathlib.PurePosixPath(name).with_suffix("").parts
        for pkg, folder in PACKAGES.items():
            if parts[0] == folder:
                out[".".join([pkg, *[p for p in parts[1:] if p != "__init__"]])] = name
        if parts[0] in SCRIPT_FOLDERS and len(parts) > 1:
            out[".".join(p for p in parts[1:] if p != "__init__")] = name
    return out


def _packages(modules) -> set[str]:
    """Every package that holds one of ``modules``."""
    return {".".join(m.split(".")[:i]) for m in modules for i in range(1, m.count(".") + 1)}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


IMPORT_STATEMENT = re.compile(r"^[ \t]*(?:from[ \t]+[\w.]+[ \t]+import[ \t]+(?:\([^)]*\)|(?:[^\n]*\\\n)*[^\n]*)"
                              r"|import[ \t]+[^\n]*)", re.M)


def _may_import_private(source: str) -> bool:
    """Whether an import statement of ``source`` names a private name (a cheap filter before
    the syntax tree)."""
    return any(_private(w) for m in IMPORT_STATEMENT.finditer(source) for w in re.findall(r"\w+", m.group(0)))


def private_imports(module: str, source: str, is_package: bool, modules: dict[str, str], packages=None):
    """(line, statement) of each import in ``source`` (module ``module``; ``is_package``: its
    ``__init__``) of a private name of another of the project's ``modules``, or of a private
    module from outside the package that holds it. ``packages``: ``_packages(modules)``."""
    packages = _packages(modules) if packages is None else packages
    known = lambda m: m in modules or m in packages     # noqa: E731

    def outsider(dotted: str) -> bool:
        """``dotted`` has a private part that ``module`` stands outside of: a private name of
        a module, or a private module and ``module`` not in its package."""
        parts = dotted.split(".")
        for i, p in enumerate(parts):
            if _private(p):
                owner = ".".join(parts[:i])
                if not known(".".join(parts[:i + 1])) or not (module + ".").startswith(owner + "."):
                    return True
        return False

    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if known(a.name) and outsider(a.name):
                    yield node.lineno, f"import {a.name}"
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if not known(target) or target == module:
                continue
            for a in node.names:
                if outsider(target) or (_private(a.name) and outsider(f"{target}.{a.name}")):
                    yield node.lineno, f"from {target} import {a.name}"


def test_no_module_imports_another_modules_private_names():
    """A leading underscore says: this module's own. No module of the project (the library,
    the tests, the benchmarks, the examples) imports another's private name, nor a private
    module from outside the package that holds it; what two modules share is public. PyTorch's
    private modules (torch._C, torch.utils._pytree, ...) are not the project's."""
    modules = _project_modules()
    packages = _packages(modules)
    sources = {module: (ROOT / file).read_text(encoding="utf-8") for module, file in modules.items()}
    bad = sorted(f"{modules[module]}:{line}: {what}" for module, source in sources.items()
                 if _may_import_private(source)
                 for line, what in private_imports(module, source, modules[module].endswith("__init__.py"),
                                                   modules, packages))
    assert not bad, "imports of another module's private name:\n" + "\n".join(bad)


def test_the_private_import_check_sees_them():
    modules = {"autopar.a": "autopar/a.py", "autopar._b": "autopar/_b.py", "autopar.c._d": "autopar/c/_d.py",
               "autopar.c": "autopar/c/__init__.py", "autopar.c.e": "autopar/c/e.py"}
    src = {"from autopar.a import _x": True, "from autopar.a import x, __version__": False,
           "from ..a import _x": True, "import autopar._b": False, "from autopar import _b": False,
           "from autopar._b import y": False, "from . import _d": False, "from ._d import y": False,
           "import torch._C": False, "from torch.utils import _pytree": False}
    for code, flagged in src.items():
        got = list(private_imports("autopar.c.e", code, False, modules))
        assert bool(got) == flagged, (code, got)
        assert _may_import_private(code) or not flagged, code
    assert list(private_imports("autopar.a", "from .c import _d", False, modules))     # outside autopar.c


# ---- benchmarks and tests stand apart ------------------------------------------------------------

PATH_INSERT = re.compile(r"sys\.path\.(?:insert|append)\((?P<args>[^\n]*)")


def test_benchmarks_and_tests_do_not_import_each_other():
    """What the benchmarks and the tests share lives in the library (autopar/, cost/, passes/):
    no benchmark imports a module of tests/ (the jobs, the test files) or puts tests/ on
    ``sys.path``, and no test imports a benchmark or puts benchmarks/ on it."""
    modules = _project_modules()
    top = {folder: {m.split(".")[0] for m, file in modules.items() if file.startswith(folder + "/")}
           for folder in ("tests", "benchmarks")}
    bad = []
    for folder, other in (("benchmarks", "tests"), ("tests", "benchmarks")):
        for module, file in modules.items():
            if not file.startswith(folder + "/"):
                continue
            source = (ROOT / file).read_text(encoding="utf-8")
            for node in ast.walk(ast.parse(source)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else []
                bad += [f"{file}:{node.lineno}: imports {n} ({other}/)" for n in names
                        if n.split(".")[0] in top[other] and n.split(".")[0] not in top[folder]]
            lines = _Lines(source)
            bad += [f"{file}:{lines(m.start())}: puts {other}/ on sys.path" for m in PATH_INSERT.finditer(source)
                    if re.search(rf"[\"']{other}[\"'/]", m.group("args"))]
    assert not bad, "benchmarks and tests that reach into each other:\n" + "\n".join(sorted(bad))


# ---- import autopar stays light ------------------------------------------------------------------

def _module_level_imports(source: str):
    """(line, module) of each import that runs when ``source`` is imported: outside function
    bodies (a function's imports run when it is called)."""
    def walk(nodes):
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(node, ast.Import):
                yield from ((node.lineno, a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                yield from ((node.lineno, f"{node.module}.{a.name}") for a in node.names)
            yield from walk(ast.iter_child_nodes(node))
    yield from walk(ast.parse(source).body)


def test_import_autopar_does_not_import_the_testing_helpers():
    """``import autopar`` loads the compiler, not its testing helpers: not ``autopar.testing``,
    and no module it loads imports ``torch.testing._internal`` (the fake and threaded process
    groups) as it is imported; a function that needs them imports them when called. (PyTorch
    itself loads a few modules of ``torch.testing._internal``: ``import torch`` does, and
    ``torch.distributed.fsdp`` does; those are torch's.)"""
    code = "import sys, autopar; print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] == 'autopar')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = out.stdout.split()
    assert "autopar" in loaded and "autopar.testing" not in loaded, \
        "import autopar imports autopar.testing (autopar/__init__.py and what it imports)"
    files = _project_modules()
    bad = [f"{files[m]}:{line}: import {name}" for m in loaded if m in files
           for line, name in _module_level_imports((ROOT / files[m]).read_text(encoding="utf-8"))
           if name == "torch.testing._internal" or name.startswith("torch.testing._internal.")]
    assert not bad, "modules that import autopar loads import torch.testing._internal as they load:\n" + "\n".join(bad)


def test_module_level_imports_leave_out_function_bodies():
    src = "import a\nif x:\n    from b.c import d\ndef f():\n    import e\nclass K:\n    import g\n"
    assert list(_module_level_imports(src)) == [(1, "a"), (3, "b.c.d"), (7, "g")]
