"""Ray Job entrypoint for `eagle3ray run`.

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python jobs/run.py -c CONFIG [overrides]

Inside a job the driver attaches to the job's cluster (RAY_ADDRESS), so the verifier service and
workers run on the cluster; arguments are those of `eagle3ray run --help`.
"""

import sys

from eagle3ray.cli import main

if __name__ == "__main__":
    sys.argv = ["eagle3ray", "run", *sys.argv[1:]]
    main()
