"""The wheel's packages: ``splitfed``, with the Flower glue installed under it as ``splitfed.strategies`` and
``splitfed.apps``, so that installing splitfed adds one top-level name to site-packages. In the repository the
folders stay at the top (``strategies/``, ``apps/``), where ``flwr run .`` loads ``apps.server_app:app``."""

from setuptools import find_packages, setup

GLUE = {"splitfed.strategies": "strategies", "splitfed.apps": "apps"}

setup(packages=find_packages(include=["splitfed", "splitfed.*"]) + list(GLUE), package_dir=GLUE)
