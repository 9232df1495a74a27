"""`python -m sparkdl_avg ...`: the command line (see `sparkdl_avg.ps.cli`)."""

import sys

from sparkdl_avg.ps.cli import main

if __name__ == "__main__":
    sys.exit(main())
