"""``python -m thdpack.train [group=option ...] [key=value ...]``: train from a Hydra recipe (see
:mod:`thdpack.training.loop`); ``--help`` lists the recipe groups and keys (:mod:`thdpack.training.recipe_help`)."""

import thdpack.training.recipe_help  # noqa: F401 - registers ${thdpack_recipe_help:}, train.yaml's help template
from thdpack.training.loop import main

if __name__ == "__main__":
    main()
