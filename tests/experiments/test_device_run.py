"""The accelerator session script parses, and every flag it passes is one its experiment takes."""

import pathlib
import re
import shutil
import subprocess

import pytest

SCRIPT = pathlib.Path(__file__).parents[2] / "experiments" / "device_run.sh"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)


@pytest.mark.parametrize("name", ["accelerator_check", "decode_bench", "decode_loop_bench",
                                  "prefill_diagnosis", "engine_check", "serving_bench"])
def test_flags_exist(name):
    text = SCRIPT.read_text()
    source = (SCRIPT.parent / f"{name}.py").read_text()
    calls = re.findall(rf"experiments/{name}\.py(.*?)(?:\n(?!\s)|$)", text, re.S)
    assert calls, f"device_run.sh does not run {name}.py"
    for call in calls:
        for flag in set(re.findall(r"(--[a-z][a-z-]*)", call)) - {"--smoke"}:
            assert f'"{flag}"' in source, f"device_run.sh passes {flag} to {name}.py"
