"""Package layout the pyproject table cannot express: the CUDA sources live at the top-level csrc/
(the project's layout) and ship inside the wheel as the data package megascale.csrc, where
megascale.kernels.build finds them in an installed copy."""

from setuptools import find_packages, setup

CSRC_PATTERNS = ["*.cu", "*.cuh", "*.h", "*.cpp"]

setup(
    packages=[*find_packages(include=["megascale", "megascale.*"]), "megascale.csrc"],
    package_dir={"megascale.csrc": "csrc"},
    package_data={"megascale": ["py.typed"], "megascale.csrc": CSRC_PATTERNS},
)
