"""The README's install and test lines and CI's entry point (.ci/run) tell one story: CI runs the README's test
command exactly, and installs the same torch the README's CPU line installs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [line.split("  #")[0].strip() for block in blocks for line in block.splitlines() if line.strip()]


def ci_commands() -> list[str]:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith(("#", "set ", "cd "))]


def test_ci_runs_the_readmes_test_command_exactly():
    (readme_test,) = [c for c in readme_commands() if "pytest" in c]
    (ci_test,) = [c for c in ci_commands() if "pytest" in c and "pip" not in c]
    assert ci_test == readme_test == "python -m pytest tests -q"


def test_ci_installs_the_torch_the_readmes_cpu_line_installs_then_the_dev_extra():
    (cpu_torch,) = [c for c in readme_commands() if "download.pytorch.org/whl/cpu" in c]
    assert cpu_torch == "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    installs = [c for c in ci_commands() if "pip install" in c]
    assert installs == ["python3 -m pip install -q torch==2.13.0", 'python3 -m pip install -q -e ".[dev]"']


def test_ci_refuses_a_cuda_build_of_torch():
    assert any("torch.version.cuda" in c for c in ci_commands())


def extra_requirements(name: str) -> list[str]:
    """The requirements of pyproject.toml's extra ``name``, the thdpack[...] ones it names followed."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    out = []
    for requirement in extras[name]:
        nested = re.fullmatch(r"thdpack\[(\w+)\]", requirement)
        out += extra_requirements(nested.group(1)) if nested else [requirement]
    return out


def test_the_vision_language_extra_never_pulls_a_second_torch():
    names = [re.split(r"[<>=\[;! ]", r, maxsplit=1)[0].lower() for r in extra_requirements("vlm")]
    assert "transformers" in names and "pillow" in names
    assert not {"torch", "torchvision", "torchaudio"} & set(names)
