"""The package list, which pyproject.toml cannot express: every package under kvtrace/
(found, never listed, so a new subpackage ships) plus kvtrace.bpf, which is probes/
(mapped in pyproject's package-dir).  Everything else is in pyproject.toml."""
from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["kvtrace", "kvtrace.*"]), "kvtrace.bpf"])
