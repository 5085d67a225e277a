"""Doctest set-up: doctests run with JAX's defaults except for 8 CPU devices, and a warning
fails the example (a docstring example follows its own advice)."""
import os
import pathlib

import pytest

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

HERE = pathlib.Path(__file__).resolve().parent


def pytest_collection_modifyitems(items):
  for item in items:
    if HERE in item.path.resolve().parents:
      item.add_marker(pytest.mark.filterwarnings("error::UserWarning"))
      item.add_marker(pytest.mark.filterwarnings("error::RuntimeWarning"))
