"""`python -m mesp.cli …` runs the CLI."""

import sys

from mesp.cli import main

sys.exit(main())
