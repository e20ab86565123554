"""Hugging Face interop: checkpoints in (config, mapping, load) and out (export), tokenizers and chat templates,
processors (imported by module, lazily)."""
