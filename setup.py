"""Package-dir mapping: the folders stay where the design card puts them (model_def/, passes/,
runtime/), but they import as k3compile.model_def, k3compile.passes, k3compile.runtime so nothing
generic like `runtime` lands at the top of site-packages. Metadata lives in pyproject.toml."""
import os

from setuptools import setup

ROOTS = {"k3compile": "k3compile", "k3compile.model_def": "model_def",
         "k3compile.passes": "passes", "k3compile.runtime": "runtime"}


def _packages():
    found = {}
    for pkg, folder in ROOTS.items():
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
            if "__init__.py" in filenames:
                rel = os.path.relpath(dirpath, folder)
                name = pkg if rel == "." else pkg + "." + rel.replace(os.sep, ".")
                found[name] = dirpath
    return found


PACKAGES = _packages()
setup(packages=sorted(PACKAGES), package_dir=PACKAGES, package_data={"k3compile.bench": ["data/*.json"]})
