"""The wheel's packages, derived from the tree: posgpt, and each package at the checkout's top as posgpt.NAME. Mapped
here, not found through the links posgpt/NAME -> ../NAME, so that a checkout whose links are files (git on Windows
without symlinks) builds the same wheel. The rest of the metadata is in pyproject.toml."""

from setuptools import find_packages, setup

found = find_packages(exclude=["posgpt", "posgpt.*", "tests", "tests.*"])
setup(
    packages=["posgpt", *(f"posgpt.{name}" for name in found)],
    package_dir={f"posgpt.{name}": name for name in found if "." not in name},
)
