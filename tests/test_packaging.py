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
