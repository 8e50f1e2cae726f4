"""Every ```python block of README.md and docs/*.md runs, as a reader would run it.

The conventions the pages follow:

* A ```python block is a snippet that runs as written: no elisions, no undefined names. Shell
  commands are fenced ```bash, program output and excerpts that do not run ```text; these two
  are not run, and no other fence hides code.
* The ```python blocks of one page build on each other: a page runs as one script, its blocks
  concatenated in the order they appear (a later block may use what an earlier one defined).
* A block whose first line is ``# slow`` belongs to the slow tier (``pytest -m slow``): every
  block that starts processes (``autopar.testing.run``), every block that takes more than
  about 3 s, and blocks that would take the fast tier's total past about 15 s. The fast tier
  runs, per page, the blocks without the marker, concatenated (so a fast block never needs a
  slow one); the slow tier runs, per page that has a slow block, all its blocks concatenated.
* A script runs in a subprocess (``sys.executable``, ``OMP_NUM_THREADS=1``) in a temporary
  directory, with a timeout. ``autopar.testing.run`` starts its ranks from a server that
  imports the script again in each rank, so a page that starts processes keeps its driving
  code under ``if __name__ == "__main__":`` and its rank functions at module level.
"""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
SLOW = "# slow"
FAST_TIMEOUT = 60        # seconds a page's fast blocks may take (they take a few)
SLOW_TIMEOUT = 240       # seconds a page's blocks may take with its processes


def blocks(page: pathlib.Path) -> list[tuple[str, str]]:
    """(fence language, body) of every fenced block of ``page``, in order."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(page.read_text())]


def is_slow(body: str) -> bool:
    return body.lstrip().startswith(SLOW)


def python_blocks(page: pathlib.Path) -> list[str]:
    return [body for lang, body in blocks(page) if lang == "python"]


def _name(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


FAST = [p for p in PAGES if any(not is_slow(b) for b in python_blocks(p))]
SLOW_PAGES = [p for p in PAGES if any(is_slow(b) for b in python_blocks(p))]


def run_script(source: str, tmp_path: pathlib.Path, timeout: float) -> str:
    script = tmp_path / "page.py"
    script.write_text(source)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"exit {done.returncode}\n--- stdout\n{done.stdout[-4000:]}\n--- stderr\n" \
                                 f"{done.stderr[-6000:]}"
    return done.stdout


def test_every_page_has_a_snippet_that_runs():
    """Each guide page shows at least one ```python block, and only the known fences occur."""
    for page in PAGES:
        langs = {lang for lang, _ in blocks(page)}
        assert "python" in langs, f"{_name(page)} has no ```python block"
        assert langs <= {"python", "bash", "text"}, f"{_name(page)} uses fences {langs - {'python', 'bash', 'text'}}"


def test_relative_links_resolve():
    """Every relative link of README.md and docs/ names a file that exists."""
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            assert path.exists(), f"{_name(page)} links to {target}, which does not exist"


@pytest.mark.timeout(FAST_TIMEOUT + 30)
@pytest.mark.parametrize("page", FAST, ids=_name)
def test_fast_blocks_run(page, tmp_path):
    run_script("\n".join(b for b in python_blocks(page) if not is_slow(b)), tmp_path, FAST_TIMEOUT)


@pytest.mark.slow
@pytest.mark.timeout(SLOW_TIMEOUT + 30)
@pytest.mark.parametrize("page", SLOW_PAGES, ids=_name)
def test_every_block_runs(page, tmp_path):
    run_script("\n".join(python_blocks(page)), tmp_path, SLOW_TIMEOUT)
