"""Ray Job entrypoint for `eagle3ray extract`.

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python jobs/extract.py -c CONFIG [overrides]

Inside a job the driver attaches to the job's cluster (RAY_ADDRESS), so the verifier service and
workers run on the cluster; arguments are those of `eagle3ray extract --help`.
"""

import sys

from eagle3ray.cli import main

if __name__ == "__main__":
    sys.argv = ["eagle3ray", "extract", *sys.argv[1:]]
    main()
