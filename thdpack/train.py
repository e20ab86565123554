"""``python -m thdpack.train [group=option ...] [key=value ...]``: train from a Hydra recipe (see
:mod:`thdpack.training.loop`); ``--help`` lists the recipe groups and keys (:mod:`thdpack.training.recipe_help`)."""

from thdpack.training.processes import start_of_run

if __name__ == "__main__":
    start_of_run()  # before the heavy imports: a stop signal is noted from here on

import thdpack.training.recipe_help  # noqa: E402, F401 - registers ${thdpack_recipe_help:}, train.yaml's help
from thdpack.training.loop import main  # noqa: E402

if __name__ == "__main__":
    main()
