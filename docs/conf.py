"""Sphinx configuration: MyST pages, the API reference generated from ``adamkit.__all__``.

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html`` (warnings are errors).
"""

from __future__ import annotations

import inspect
import os
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the checkout's adamkit, when built from a checkout
# The docstrings' examples need no devices, but importing adamkit starts JAX: keep it quiet.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import adamkit  # noqa: E402

project = "adamkit"
author = "adamkit developers"
release = version = adamkit.__version__
copyright = "adamkit developers"  # noqa: A001 - the name Sphinx reads

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
]
try:  # MathJax served with the site, so pages render without a network (CI, offline readers)
  import importlib.util
  if importlib.util.find_spec("sphinx-mathjax-offline") is not None:
    extensions.append("sphinx-mathjax-offline")
except ValueError:
  pass

# textmacros: \_ inside \text{...} (the docstrings' ``\text{(eps\_mode="hat")}``) is an
# underscore, as in LaTeX, instead of a literal backslash.
mathjax3_config = {"loader": {"load": ["[tex]/textmacros"]},
                   "tex": {"packages": {"[+]": ["textmacros"]}}}
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "README.md"]
html_theme = "furo"
html_title = f"adamkit {release}"
html_static_path = ["_static"]
html_css_files = ["adamkit.css"]

autodoc_member_order = "bysource"
autodoc_typehints = "none"  # compact signatures; the Args say what each takes
autodoc_typehints_format = "short"
autodoc_default_options = {"show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
autosummary_generate = False
suppress_warnings: list[str] = []

# -------------------------------------------------------------------------- API pages
# One page per name of ``adamkit.__all__``, written at configuration time into docs/api/
# (git-ignored), so a name another module exports appears without editing any page.
API_DIR = HERE / "api"


def _directive(name: str, obj) -> str:
  full = f"adamkit.{name}"
  if inspect.ismodule(obj):
    return f".. automodule:: {obj.__name__}\n   :members:\n"
  if inspect.isclass(obj):
    if issubclass(obj, tuple) and hasattr(obj, "_fields"):  # NamedTuple states
      return f".. autoclass:: {full}\n   :members:\n   :undoc-members:\n"
    return f".. autoclass:: {full}\n   :members:\n"
  if callable(obj):
    return f".. autofunction:: {full}\n"
  return f".. autodata:: {full}\n"


def write_api_pages() -> list[str]:
  API_DIR.mkdir(exist_ok=True)
  names = list(adamkit.__all__)
  wanted = {f"{n}.md" for n in names}
  for old in API_DIR.glob("*.md"):
    if old.name not in wanted:
      old.unlink()
  for name in names:
    text = (f"# ak.{name}\n\n```{{eval-rst}}\n.. currentmodule:: adamkit\n\n"
            f"{_directive(name, getattr(adamkit, name))}```\n")
    page = API_DIR / f"{name}.md"
    if not page.exists() or page.read_text() != text:  # unchanged pages keep their mtime
      page.write_text(text)
  return names


API_NAMES = write_api_pages()
API_MARKER = "<!-- adamkit: api table -->"


def _api_table(app, docname, source):
  """Replaces the marker in api.md by a summary table of every public name."""
  if docname != "api" or API_MARKER not in source[0]:
    return
  rows = "\n".join(f"   {n}" for n in API_NAMES)
  pages = "\n".join(f"api/{n}" for n in API_NAMES)
  table = (f"```{{eval-rst}}\n.. currentmodule:: adamkit\n\n.. autosummary::\n   :nosignatures:\n\n"
           f"{rows}\n```\n\n```{{toctree}}\n:hidden:\n\n{pages}\n```\n")
  source[0] = source[0].replace(API_MARKER, table)


def setup(app):
  app.connect("source-read", _api_table)
