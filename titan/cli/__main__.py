"""`python -m titan.cli` is `titan`."""

import sys

from titan.cli import main

sys.exit(main())
