"""Every ```python block of README.md and docs/**/*.md runs as written.

The blocks of one page run in order in one namespace (a page may build on its earlier
blocks), so each page is one test; a failure names the page and the block.
"""

import pathlib
import re

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PAGES = [p for p in PAGES if "_build" not in p.parts and "api" not in p.relative_to(ROOT).parts[1:2]]
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", flags=re.S | re.M)
# Examples are copied: they follow their own advice, so a warning (UncommittedParamsWarning,
# JAX's unusable donation...) fails the page.
pytestmark = [pytest.mark.filterwarnings("error::UserWarning"),
              pytest.mark.filterwarnings("error::RuntimeWarning")]


def python_blocks(text: str) -> list[str]:
  """The bodies of the ```python fences of a Markdown text, in order."""
  return FENCE.findall(text)


def test_block_extraction():
  text = "a\n```python\nx = 1\n```\n```bash\nls\n```\n```python\ny = 2\n\nz = 3\n```\n"
  assert python_blocks(text) == ["x = 1\n", "y = 2\n\nz = 3\n"]


def test_readme_and_docs_have_examples():
  assert python_blocks((ROOT / "README.md").read_text())
  assert sum(len(python_blocks(p.read_text())) for p in PAGES) >= 10


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_examples_run(page):
  namespace: dict = {"__name__": "__docs__"}
  # The examples are written for JAX's default (standard) promotion, as users run them.
  with jax.numpy_dtype_promotion("standard"):
    for index, block in enumerate(python_blocks(page.read_text())):
      name = f"{page.relative_to(ROOT)}[python block {index}]"
      exec(compile(block, name, "exec"), namespace)
