"""`python -m mesp …` (and `torchrun … -m mesp train …`) runs the CLI."""

import sys

from mesp.cli import main

sys.exit(main())
