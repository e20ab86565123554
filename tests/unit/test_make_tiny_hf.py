"""``python tests/make_tiny_hf.py DIR --family qwen2_5_vl`` (the README's vision-language section) writes a tiny
vision-language directory without pytest installed, which thdpack's processor reads: a chat with an image encodes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_tiny_vision_language_directory_is_made_without_pytest(tmp_path, monkeypatch):
    from PIL import Image

    from thdpack.hf.processor import VLProcessor

    # the script and the model helpers it imports, loaded afresh where importing pytest fails
    monkeypatch.setitem(sys.modules, "pytest", None)
    monkeypatch.delitem(sys.modules, "tests.vlm_models", raising=False)
    spec = importlib.util.spec_from_file_location("make_tiny_hf", ROOT / "tests" / "make_tiny_hf.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(sys, "argv", ["make_tiny_hf.py", str(tmp_path / "vl"), "--family", "qwen2_5_vl"])
    script.main()

    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "A red square."},
    ]
    encoded = VLProcessor(tmp_path / "vl").encode_chat(messages, [Image.new("RGB", (56, 56))], "row")
    assert int(encoded.mm_token_type_ids.sum()) == 4 and encoded.target_mask.any()
