"""On a machine without an accelerator the kernel benchmark says so and exits cleanly."""

import importlib.util
import pathlib

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU behaviour")
def test_cpu_says_so_and_exits_cleanly(capsys):
    spec = importlib.util.spec_from_file_location("kernel_bench",
                                                  ROOT / "experiments" / "kernel_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main([]) == []
    assert "no accelerator on this machine" in capsys.readouterr().out
