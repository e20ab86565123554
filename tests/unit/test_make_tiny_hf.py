"""``python tests/make_tiny_hf.py DIR --family qwen2_5_vl`` (the README's vision-language section) writes a tiny
vision-language directory without pytest installed, which thdpack's processor reads: a chat with an image encodes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_tiny_vision_language_directory_is_made_without_pytest(tmp_path):
    from PIL import Image

    from thdpack.hf.processor import VLProcessor

    blocked = "import sys, runpy; sys.modules['pytest'] = None; sys.argv = sys.argv[1:]; "
    runner = blocked + "runpy.run_path(sys.argv[0], run_name='__main__')"
    argv = [
        sys.executable,
        "-c",
        runner,
        str(ROOT / "tests/make_tiny_hf.py"),
        str(tmp_path / "vl"),
        "--family",
        "qwen2_5_vl",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    subprocess.run(argv, check=True, capture_output=True, env=env, cwd=tmp_path)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "A red square."},
    ]
    encoded = VLProcessor(tmp_path / "vl").encode_chat(messages, [Image.new("RGB", (56, 56))], "row")
    assert int(encoded.mm_token_type_ids.sum()) == 4 and encoded.target_mask.any()
