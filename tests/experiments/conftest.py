"""Load an experiment script (experiments/ is a folder of scripts, not a package) by name."""

import importlib.util
import pathlib

import pytest

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[2] / "experiments"


@pytest.fixture(scope="session")  # stateless: shared by module fixtures too
def load_experiment():
    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
