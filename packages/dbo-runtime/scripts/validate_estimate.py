"""Validate ``dbo-runtime estimate`` against the reference sweep (``dbo_runtime.estimate_check``).

    .venv/bin/python packages/dbo-runtime/scripts/validate_estimate.py [bench-results/dbo_runtime.json] [--format md|json]
"""

import sys

from dbo_runtime.estimate_check import main

if __name__ == "__main__":
    sys.exit(main())
