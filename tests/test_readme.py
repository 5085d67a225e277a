"""The README's Python examples run as written."""

import pathlib
import re

import jax
import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
  assert BLOCKS


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index):
  # README examples are written for JAX's default (standard) promotion, as users run them.
  with jax.numpy_dtype_promotion("standard"):
    exec(compile(BLOCKS[index], f"README.md[python block {index}]", "exec"), {})
