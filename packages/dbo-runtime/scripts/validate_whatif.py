"""Run the what-if check again on a ``dbo-runtime bench --out DIR`` (``dbo_runtime.reference.whatif_check``).

    .venv/bin/python packages/dbo-runtime/scripts/validate_whatif.py [bench-results] [--format md|json]
"""

import sys

from dbo_runtime.reference.whatif_check import main

if __name__ == "__main__":
    sys.exit(main())
