#!/usr/bin/env python
"""Packed-refresh benchmark from the shell: ``sur-lab bench``'s :func:`sur_lab.runtime.bench.main` (same options,
``--help``).

    .venv/bin/python scripts/bench_packed_refresh.py --context-lens 1024 --warmups 1 --repeats 3 --budgets 5
"""

import sys

from sur_lab.runtime.bench import main

if __name__ == "__main__":
    sys.exit(main())
