#!/usr/bin/env bash
# The real-failure fault tests, ROUNDS times in a row (default 10), each round one fresh pytest process; stops at
# the first failing round. Prints one line per round; each round's log is $LOGS/round_<i>.log.
# Usage: bash scripts/fault_loop.sh            (from a checkout with .venv; about 8 min a round on 2 cores)
#        ROUNDS=3 LOGS=/tmp/faults bash scripts/fault_loop.sh
# The full-disk test mounts a tmpfs (root only; skipped elsewhere, which the round's summary line shows).
set -uo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-10}
LOGS=${LOGS:-/tmp/eagle3ray-fault-loop}
mkdir -p "$LOGS"
echo "fault loop at $(git log --oneline -1 2>/dev/null), $ROUNDS rounds, logs in $LOGS"
for i in $(seq 1 "$ROUNDS"); do
  s=$(date +%s)
  .venv/bin/python -m pytest -q -x \
    "tests/test_cluster.py::test_node_killed_mid_extraction_every_sample_exactly_once" \
    "tests/test_cluster.py::test_engine_crash_hang_and_regeneration_crash_are_survived_and_the_poisonous_sample_rejected" \
    "tests/test_cluster.py::test_driver_sigkilled_mid_extract_and_mid_train_loses_nothing_and_repeats_nothing" \
    "tests/test_storage_faults.py::test_a_full_disk_mid_extraction_fails_naming_it_and_a_rerun_finishes_exactly_once" \
    "tests/test_storage_faults.py::test_the_s3_endpoint_stopped_mid_extraction_fails_and_a_rerun_finishes_exactly_once" \
    > "$LOGS/round_$i.log" 2>&1
  rc=$?
  echo "round $i rc=$rc $(tail -1 "$LOGS/round_$i.log") $(( $(date +%s) - s )) s, ended $(date -u +%H:%M) UTC"
  [ "$rc" -ne 0 ] && exit "$rc"
done
