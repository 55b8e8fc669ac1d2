"""``python -m zerobatch.cli``."""

import sys

from zerobatch.cli.main import main

sys.exit(main())
