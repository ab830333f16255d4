"""Load an experiment (a module of the experiments package, e.g. experiments.decode.decode_bench)
by its name alone, a fresh module each time."""

import importlib.util
import pathlib

import pytest

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[2] / "experiments"


def module_name(name: str) -> str:
    """experiments.<group>.<name> of the script called name."""
    found = [p for p in EXPERIMENTS.glob(f"*/{name}.py")]
    assert len(found) == 1, (name, found)
    return f"experiments.{found[0].parent.name}.{name}"


@pytest.fixture(scope="session")  # stateless: shared by module fixtures too
def load_experiment():
    def load(name: str):
        spec = importlib.util.find_spec(module_name(name))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
