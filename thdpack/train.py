"""``python -m thdpack.train [group=option ...] [key=value ...]``: train from a Hydra recipe (see
:mod:`thdpack.training.loop`)."""

from thdpack.training.loop import main

if __name__ == "__main__":
    main()
