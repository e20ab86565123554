"""Hugging Face interop: checkpoints, tokenizers and chat templates, processors (imported by module, lazily)."""
