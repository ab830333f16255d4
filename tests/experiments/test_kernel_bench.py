"""On a machine without an accelerator the kernel benchmark says so and exits cleanly."""

import jax
import pytest


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU behaviour")
def test_cpu_says_so_and_exits_cleanly(load_experiment, capsys):
    module = load_experiment("kernel_bench")
    assert module.main([]) == []
    assert "no accelerator on this machine" in capsys.readouterr().out
