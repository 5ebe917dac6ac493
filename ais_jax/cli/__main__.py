"""``python -m ais_jax.cli``: the ``ais-jax`` command."""

import sys

from ais_jax.cli.main import main

sys.exit(main())
