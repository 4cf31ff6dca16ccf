"""python -m dpbench.tools.report DIR: the same as dpbench-report DIR."""

import sys

from dpbench.tools.report.cli import main

sys.exit(main())
