"""The text the documentation is made of, and the site built from it.

A ``"\\frac"`` written without the backslash doubled (or a docstring that is not a raw
string) turns ``\\f``, ``\\b``, ``\\t`` into control characters, and MathJax shows "Math
input error" on the site. These tests read every tracked text file and every docstring
for control characters, then build the site and let a headless browser typeset its math.
"""

import atexit
import importlib
import importlib.util
import json
import pathlib
import pkgutil
import re
import shutil
import subprocess
import sys
import tempfile

import background
import pytest

import adamkit

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Every C0 control character but the newline, and DEL: tabs and carriage returns included
# (the project's text is indented with spaces and has Unix line ends).
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f]")
TEXT_SUFFIXES = {".py", ".md", ".toml", ".cc", ".css", ".txt", ".cfg", ".ini", ".yml", ".yaml",
                 ".sh", ".gitignore", ".ipynb", ""}


def control_characters(text: str) -> list[tuple[int, str]]:
  """``(line, repr)`` of each control character of ``text`` (1-based lines)."""
  return [(text.count("\n", 0, m.start()) + 1, repr(m.group())) for m in CONTROL.finditer(text)]


def tracked_text_files() -> list[pathlib.Path]:
  try:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    paths = [ROOT / n for n in names]
  except (OSError, subprocess.CalledProcessError):  # not a git checkout: the known folders
    paths = [p for d in ("adamkit", "docs", "tests", "notebooks", "benchmarks", "examples", ".ci")
             for p in (ROOT / d).rglob("*") if "_build" not in p.parts]
    paths += [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "pyproject.toml"]
  return sorted(p for p in paths if p.is_file() and p.suffix in TEXT_SUFFIXES)


def test_the_scan_finds_what_it_looks_for():
  assert control_characters("a\n\x08ar g\n") == [(2, r"'\x08'")]
  assert control_characters("x = 1\n\tfrac") == [(2, r"'\t'")]
  assert control_characters("plain\ntext\n") == []


def test_no_control_characters_in_text_files():
  files = tracked_text_files()
  assert ROOT / "README.md" in files and ROOT / "docs" / "composition.md" in files
  found = {}
  for path in files:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".ipynb":  # JSON escapes (\u0008) hide them: read the cells' sources
      text = "\n".join("".join(c["source"]) for c in json.loads(text)["cells"])
    if hits := control_characters(text):
      found[str(path.relative_to(ROOT))] = hits
  assert not found, f"control characters (line, char): {found}"


def adamkit_docstrings():
  """``(qualified name, docstring)`` of every module, class, function and method of adamkit."""
  seen = set()
  for info in pkgutil.walk_packages(adamkit.__path__, "adamkit."):
    if info.name.startswith("adamkit._cpu.lib"):  # the compiled kernel, not a Python module
      continue
    module = importlib.import_module(info.name)
    objects = [(info.name, module)]
    for name, obj in vars(module).items():
      if getattr(obj, "__module__", None) == info.name:
        objects.append((f"{info.name}.{name}", obj))
        if isinstance(obj, type):
          objects += [(f"{info.name}.{name}.{k}", v) for k, v in vars(obj).items()]
    for name, obj in objects:
      doc = obj.__doc__ if not isinstance(obj, (staticmethod, classmethod)) else obj.__func__.__doc__
      if isinstance(doc, str) and id(doc) not in seen:
        seen.add(id(doc))
        yield name, doc


def test_no_control_characters_in_docstrings():
  docs = dict(adamkit_docstrings())
  assert "adamkit._adam.scale_by_adam" in docs  # the walk reaches the maths
  found = {name: hits for name, doc in docs.items() if (hits := control_characters(doc))}
  assert not found, f"control characters in docstrings (write them as r\"\"\"...\"\"\"): {found}"


# ------------------------------------------------------------------------- the built site


def _build_site():
  """The site built as CI builds it (warnings are errors) into a temporary folder, removed
  when the tests end: ``(folder, None)``, or ``(None, why)`` where it cannot be built
  here (``"skip: ..."``) or the build failed."""
  for module in ("sphinx", "myst_parser", "furo"):
    if importlib.util.find_spec(module) is None:
      return None, f"skip: {module} is not installed"
  out = pathlib.Path(tempfile.mkdtemp(prefix="adamkit-site-"))
  atexit.register(shutil.rmtree, out, ignore_errors=True)
  done = background.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b",
                         "html", str(ROOT / "docs"), str(out)], timeout=900)
  return (out, None) if done.returncode == 0 else (None, done.stderr[-4000:])


def _typeset():
  """Each page with math of the site, rendered by a headless browser: ``(errors,
  untypeset pages)``, or a ``"skip: ..."`` reason (or the build's error) instead."""
  site, failed = background.result(_build_site, timeout=1800)
  if site is None:
    return failed
  browser = _browser()
  if browser is None:
    return "skip: no headless chromium to run MathJax in"
  if not (site / "_static" / "mathjax").is_dir():
    return "skip: MathJax is not served with the site (sphinx-mathjax-offline is not installed)"
  errors, untypeset = {}, []
  for page in math_pages(site):
    dom = background.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                          "--virtual-time-budget=15000", page.as_uri()], timeout=120).stdout
    name = str(page.relative_to(site))
    if "<mjx-container" not in dom:
      untypeset.append(name)
    if hits := re.findall(r'<mjx-merror[^>]*>|data-mjx-error="[^"]*"', dom):
      errors[name] = hits
  return errors, untypeset


# Built (and typeset) in the background from the end of collection on (tests/background.py).
BACKGROUND = {_build_site: {"test_built_pages_have_no_control_characters",
                            "test_mathjax_typesets_every_formula"},
              _typeset: {"test_mathjax_typesets_every_formula"}}


def _skip_or_fail(why: str):
  if why.startswith("skip: "):
    pytest.skip(why[len("skip: "):])
  pytest.fail(f"the documentation did not build:\n{why}")


@pytest.fixture(scope="module")
def site():
  out, why = background.result(_build_site, timeout=1800)
  if out is None:
    _skip_or_fail(why)
  return out


def math_pages(site) -> list[pathlib.Path]:
  return sorted(p for p in site.rglob("*.html") if 'class="math' in p.read_text(encoding="utf-8"))


def test_built_pages_have_no_control_characters(site):
  pages = math_pages(site)
  assert any(p.name == "composition.html" for p in pages)
  found = {}
  for page in site.rglob("*.html"):
    if hits := [h for h in control_characters(page.read_text(encoding="utf-8")) if h[1] != r"'\t'"]:
      found[str(page.relative_to(site))] = hits  # tabs: Sphinx's own indentation
  assert not found, f"control characters in the built HTML: {found}"


def _browser():
  return next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")
               if shutil.which(b)), None)


@pytest.mark.slow
def test_mathjax_typesets_every_formula():
  """Each page with math, rendered by a headless browser: MathJax ran and reported no error
  (an error shows as "Math input error" on the page)."""
  found = background.result(_typeset, timeout=1800)
  if isinstance(found, str):
    _skip_or_fail(found)
  errors, untypeset = found
  assert not errors, f"MathJax errors: {errors}"
  assert not untypeset, f"MathJax did not typeset these pages: {untypeset}"
