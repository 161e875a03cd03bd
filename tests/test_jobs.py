"""The pipeline as Ray Jobs on a local cluster started like a user would (`ray start --head`), with the
dashboard and token authentication on, bound to 127.0.0.1. A second job reuses the running verifier.

This module starts its own cluster in subprocesses (its own ports and temp dir) and stops exactly
those processes, leaving the in-process test cluster of the other modules alone.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import TINY_AUX, write_chat_jsonl
from conftest import cluster_ports as _cluster_ports
from conftest import stop_cluster as _stop_cluster
from test_extract import _convs

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent


def _client(address: str):
    from ray.job_submission import JobSubmissionClient

    # Token authentication is on: the README block's `ray get-auth-token --generate` wrote ~/.ray/auth_token.
    token = (Path.home() / ".ray" / "auth_token").read_text().strip()
    return JobSubmissionClient(address, headers={"Authorization": f"Bearer {token}"})


def _job_logs(address: str) -> str:
    """The logs of the one job submitted so far to the cluster at ``address`` (drivers that connected without
    `ray job submit`, such as `eagle3ray check --cluster`, are listed too, with no submission id)."""
    client = _client(address)
    jobs = [j.submission_id for j in client.list_jobs() if j.submission_id]
    assert len(jobs) == 1, jobs
    return client.get_job_logs(jobs[0])


def _submit_and_wait(address: str, entrypoint: str, timeout: float = 900) -> tuple[str, str]:
    from ray.job_submission import JobStatus

    client = _client(address)
    deadline = time.time() + 120
    while True:  # right after `ray start` the dashboard answers before its job agent is up
        try:
            job = client.submit_job(entrypoint=entrypoint, runtime_env={"working_dir": str(REPO),
                                                                        "excludes": [".venv", "runs", ".git"]})
            break
        except RuntimeError as e:
            if "No available agent" not in str(e) or time.time() > deadline:
                raise
            time.sleep(3)
    t0 = time.time()
    while time.time() - t0 < timeout:
        status = client.get_job_status(job)
        if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
            return str(status), client.get_job_logs(job)
        time.sleep(3)
    client.stop_job(job)
    return "TIMEOUT", client.get_job_logs(job)


def _readme_block(heading: str) -> str:
    """The first ```bash block after ``heading`` in README.md."""
    text = (REPO / "README.md").read_text()
    after = text[text.index(heading):]
    start = after.index("```bash\n") + len("```bash\n")
    return after[start:after.index("```", start)]


def test_readme_jobs_block_works_as_written_from_a_plain_shell(tmp_path, tiny_verifier):
    """README's Ray Jobs block, pasted into a shell where the venv is not activated, runs the pipeline as a job;
    a second job on the same cluster (another run on the same verifier) reuses the running verifier service: the
    same replica process, which loaded its engine once.

    The test changes only what must differ on a shared test machine: the cluster's ports and temp dir (so that
    it stops exactly its own processes instead of `ray stop`, which would stop every cluster here), the address
    `auto` (another test cluster may be the machine's latest), and small sizes for the job (the tiny verifier).
    One cluster serves both jobs: each `ray start` and pipeline costs minutes on 2 cores.
    """
    import shlex

    block = _readme_block("## Ray Jobs")
    assert "ray job submit" in block and "jobs/run.py" in block
    temp_dir = f"/tmp/e3r-readme-{os.getpid()}"
    gcs, dash, cluster_args = _cluster_ports(temp_dir)
    train_file = write_chat_jsonl(tmp_path / "train.jsonl", _convs(24, seed=5))
    small = [f"run.storage=file://{tmp_path}/runs", "run.name=readme-jobs", f"verifier.model={tiny_verifier}",
             f"verifier.aux_layer_ids={TINY_AUX}", "verifier.max_model_len=512", "verifier.cpu_kv_cache_gib=1",
             "verifier.num_cpus=0.5", "verifier.dtype=float32", f"data.train=[{{kind: chat, path: {train_file}}}]",
             "data.regenerate=false", "data.max_prompt_tokens=null", "extract.max_tokens_per_batch=512",
             "vocab.draft_vocab_size=256", "train.max_steps=4", "train.checkpoint_every=2",
             "train.max_tokens_per_batch=256", "train.val_fraction=0.2", "validation.max_prompts=2",
             "validation.max_new_tokens=8", "validation.max_num_seqs=2", "validation.greedy_check_dtype=null"]
    lines = []
    for line in block.replace("\\\n", " ").splitlines():
        if line.strip().startswith(".venv/bin/ray stop"):
            continue  # stopped below, this cluster only
        line = line.replace("127.0.0.1:8265", f"127.0.0.1:{dash}").replace("ray.address=auto",
                                                                          f"ray.address=127.0.0.1:{gcs}")
        if "ray start" in line:
            line += " " + " ".join(cluster_args)
        if "eagle3ray check" in line or "jobs/run.py" in line:
            line += " " + " ".join(shlex.quote(o) for o in small)
        lines.append(line)
    script = "set -euo pipefail\n" + "\n".join(lines) + "\n"
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ["HOME"], "LANG": "C.UTF-8",
           "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x"}
    try:
        r = subprocess.run(["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        out = r.stdout + r.stderr
        assert r.returncode == 0, script + "\n----\n" + out[-5000:]
        assert "mean acceptance length" in out
        report = yaml.safe_load((tmp_path / "runs" / "readme-jobs" / "reports" / "validate.json").read_text())
        assert report["num_prompts"] == 2 and report["greedy_identical"] == "2/2"
        address = f"http://127.0.0.1:{dash}"
        first_logs = _job_logs(address)
        started = re.search(r"verifier service (\S+) started .*?replica pid (\d+), engine loads in that process "
                            r"(\d+)", first_logs)
        assert started, first_logs[-3000:]

        # Second job, another run on the same verifier: the running service is reused, not loaded again.
        second = " ".join(shlex.quote(o) for o in [*small, "run.name=job2"])
        status2, logs2 = _submit_and_wait(address, f"{VENV_BIN / 'python'} jobs/extract.py -c "
                                                    f"configs/smollm2-135m-cpu.yaml {second} --no-progress")
        assert status2 == "SUCCEEDED", logs2[-4000:]
        reused = re.search(r"verifier service (\S+) reusing running: replica pid (\d+), engine loads in that "
                           r"process (\d+)", logs2)
        assert reused, logs2[-3000:]
        assert reused.group(1) == started.group(1) and reused.group(2) == started.group(2)
        assert reused.group(3) == "1"  # the replica process loaded its engine once
    finally:
        _stop_cluster(temp_dir, gcs)
