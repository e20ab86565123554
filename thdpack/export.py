"""``python -m thdpack.export CHECKPOINT_DIR OUT_DIR``: a checkpoint of a run that imported a Hugging Face model,
as a Hugging Face directory (:mod:`thdpack.models.export`). Runs on CPU, in one process."""

import os

if __name__ == "__main__":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # one CPU process: Megatron's CPU mode, whatever the host has
    from thdpack.models.export import main

    main()
