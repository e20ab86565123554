"""``python -m thdpack.compare [overrides...]``: the same recipe trained packed and padded, side by side (see
:mod:`thdpack.training.compare`)."""

from thdpack.training.compare import main

if __name__ == "__main__":
    main()
