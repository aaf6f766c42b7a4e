"""`python -m muninn_worker` is the same as the `muninn-worker` console script."""

import sys

from muninn_worker.cli import main

sys.exit(main())
