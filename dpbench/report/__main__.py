"""python -m dpbench.report DIR: the same as dpbench-report DIR."""

import sys

from dpbench.report.cli import main

sys.exit(main())
