"""The container recipe (launch/Dockerfile) read statically: docker cannot build here (no daemon, no network), so
what can be known without a build is checked. The image is an NGC PyTorch release whose torch is never replaced,
with Transformer Engine checked and megatron-core and thdpack installed; every file it copies exists and is not
ignored; the SLURM script and launch/README build, import and run the same image."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "launch" / "Dockerfile").read_text()


def instructions(keyword: str) -> list[str]:
    return re.findall(rf"^{keyword} (.+)$", DOCKERFILE, flags=re.M)


def test_the_image_is_an_ngc_pytorch_release():
    (base,) = instructions("ARG")
    assert re.fullmatch(r"BASE=nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", base)
    assert instructions("FROM") == ["${BASE}"]


def test_the_images_torch_is_kept_and_no_other_is_installed():
    assert "PIP_CONSTRAINT=/etc/pip/constraint.txt" in DOCKERFILE
    installs = [
        line for line in DOCKERFILE.splitlines() if "pip install" in line and not line.startswith("#")
    ]
    assert installs and not any(re.search(r"\btorch(vision|audio)?\b", line) for line in installs)


def test_megatron_core_thdpack_and_transformer_engine_are_in_the_image():
    (install,) = [line for line in DOCKERFILE.splitlines() if line.startswith("RUN pip install")]
    assert '"megatron-core>=0.16"' in install and '-e ".[vlm]"' in install
    assert "import transformer_engine.pytorch" in DOCKERFILE and ">= (2, 9)" in DOCKERFILE
    assert "import torch, megatron.core, transformer_engine, thdpack" in DOCKERFILE


def test_every_copied_path_exists_and_is_not_ignored_by_the_build():
    ignored = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip()[:1] not in ("", "#")
    ]
    for copy in instructions("COPY"):
        *sources, _ = copy.split()
        for source in sources:
            assert (ROOT / source).exists(), source
            assert source.rstrip("/") not in ignored, source


def test_the_slurm_example_and_the_launch_readme_run_the_image_the_dockerfile_builds():
    build = "docker build -f launch/Dockerfile -t thdpack:latest ."
    imported = "enroot import -o thdpack.sqsh dockerd://thdpack:latest"
    run = "CONTAINER_IMAGE=$PWD/thdpack.sqsh CONTAINER_MOUNTS=$PWD:$PWD"
    sbatch = (ROOT / "launch" / "slurm.sbatch").read_text()
    readme = (ROOT / "launch" / "README.md").read_text()
    for text in (DOCKERFILE, readme):
        assert build in text and imported in text and run in text
    assert run in sbatch and "launch/Dockerfile" in sbatch
    assert "docker build -f launch/Dockerfile -t thdpack:latest ." in " ".join(
        sbatch.replace("#", " ").split()
    )
