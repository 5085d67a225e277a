"""The text the documentation is made of, and the site built from it.

A ``"\\frac"`` written without the backslash doubled (or a docstring that is not a raw
string) turns ``\\f``, ``\\b``, ``\\t`` into control characters, and MathJax shows "Math
input error" on the site. These tests read every tracked text file and every docstring
for control characters, then build the site and let a headless browser typeset its math.
"""

import importlib
import json
import pathlib
import pkgutil
import re
import shutil
import subprocess
import sys

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


@pytest.fixture(scope="module")
def site(tmp_path_factory):
  """The site built as CI builds it (warnings are errors) into a temporary folder."""
  pytest.importorskip("sphinx")
  pytest.importorskip("myst_parser")
  pytest.importorskip("furo")
  out = tmp_path_factory.mktemp("html")
  done = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                         str(ROOT / "docs"), str(out)], capture_output=True, text=True,
                        timeout=900)
  assert done.returncode == 0, done.stderr[-4000:]
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
def test_mathjax_typesets_every_formula(site):
  """Each page with math, rendered by a headless browser: MathJax ran and reported no error
  (an error shows as "Math input error" on the page)."""
  browser = _browser()
  if browser is None:
    pytest.skip("no headless chromium to run MathJax in")
  if not (site / "_static" / "mathjax").is_dir():
    pytest.skip("MathJax is not served with the site (sphinx-mathjax-offline is not installed)")
  errors, untypeset = {}, []
  for page in math_pages(site):
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                          "--virtual-time-budget=15000", page.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    name = str(page.relative_to(site))
    if "<mjx-container" not in dom:
      untypeset.append(name)
    if hits := re.findall(r'<mjx-merror[^>]*>|data-mjx-error="[^"]*"', dom):
      errors[name] = hits
  assert not errors, f"MathJax errors: {errors}"
  assert not untypeset, f"MathJax did not typeset these pages: {untypeset}"
