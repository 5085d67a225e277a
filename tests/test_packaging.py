"""What an installed adamkit carries: type information and the notebooks' data."""

import pathlib
from importlib.resources import files

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_package_is_typed():
  assert (files("adamkit") / "py.typed").is_file()


def test_shipped_trajectories_are_the_golden_files():
  shipped = sorted(p.name for p in (files("adamkit") / "_data").iterdir() if p.name.endswith(".npz"))
  assert shipped  # notebooks/02_porting.ipynb reads these
  for name in shipped:
    assert (files("adamkit") / "_data" / name).read_bytes() == \
        (ROOT / "tests" / "golden" / name).read_bytes(), name


def test_notebook_links_resolve():
  import json
  import re
  for nb_path in sorted((ROOT / "notebooks").glob("*.ipynb")):
    cells = json.loads(nb_path.read_text())["cells"]
    text = "".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    for target in re.findall(r"\]\(([^)#\s]+)\)", text) + re.findall(r"`(\w+\.ipynb)`", text):
      if "://" not in target:
        assert (nb_path.parent / target).exists(), (nb_path.name, target)


def test_one_version_everywhere():
  """adamkit.__version__ is the one source: the build reads it (hatch), the docs import it,
  and CHANGELOG.md has a section for it under "Unreleased"."""
  import re

  import adamkit
  tomllib = __import__("pytest").importorskip("tomllib")  # Python >= 3.11
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())
  assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
  path = project["tool"]["hatch"]["version"]["path"]
  # hatch's default pattern: the one __version__ assignment of that file
  found = re.findall(r'^__version__\s*=\s*["\']([^"\']+)["\']', (ROOT / path).read_text(), re.M)
  assert found == [adamkit.__version__]
  assert re.fullmatch(r"\d+\.\d+\.\d+", adamkit.__version__)
  conf = (ROOT / "docs" / "conf.py").read_text()
  assert "release = version = adamkit.__version__" in conf
  assert not re.search(r"\b\d+\.\d+\.\d+\b", conf)  # no second copy of a version number
  sections = re.findall(r"^## (.+)$", (ROOT / "CHANGELOG.md").read_text(), re.M)
  assert sections[:2] == ["Unreleased", adamkit.__version__]


def test_installed_metadata_matches_the_checkout():
  """An install made from this checkout reports this checkout's version (an editable
  install made before a version change does not: reinstall it)."""
  import json
  from importlib import metadata

  import pytest

  import adamkit
  try:
    dist = metadata.distribution("adamkit")
  except metadata.PackageNotFoundError:
    pytest.skip("adamkit is not installed (imported from the checkout)")
  url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
  if pathlib.Path(adamkit.__file__).resolve().parent.parent != ROOT or \
      url.rstrip("/") != ROOT.as_uri():
    pytest.skip("the installed adamkit is not this checkout's")
  assert dist.version == adamkit.__version__, (
      f"installed metadata says {dist.version}, the checkout {adamkit.__version__}: "
      "reinstall with pip install -e .")
