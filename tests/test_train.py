"""Draft training on Ray Train (2 workers, gloo), resume after a killed worker, export, vLLM load, check.

Blocks come from the tiny random verifier (extracted once for the module); the draft is speculators'
Eagle3DraftModel. One training run with an injected worker crash covers: improvement over the
untrained head, resume from the last checkpoint with the data position restored, the configured
step count; a second call on the finished run does nothing.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest

from eagle3ray import storage
from eagle3ray.draft_check import check_draft
from eagle3ray.export import export
from eagle3ray.extract import extract
from eagle3ray.prepare import prepare
from eagle3ray.artifacts import read_metrics
from eagle3ray.train import held_out_split, train
from eagle3ray.train_worker import WorkerHooks
from eagle3ray.vocab import build_vocab

from conftest import write_chat_jsonl
from test_extract import _convs

pytestmark = pytest.mark.slow

MAX_STEPS = 40


@pytest.fixture(scope="module")
def trained(ray_session, tmp_path_factory, tiny_verifier):
    """Prepare + extract 64 samples, vocab, then train with a worker killed at step 28 (checkpoints every 10)."""
    from conftest import TINY_AUX
    from eagle3ray.config import load_config
    import yaml

    tmp = tmp_path_factory.mktemp("train")
    train_file = write_chat_jsonl(tmp / "train.jsonl", _convs(64, words=20, seed=7))
    cfg_path = tmp / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "run": {"name": "tr", "storage": f"file://{tmp}/runs"},
        "verifier": {"model": tiny_verifier, "aux_layer_ids": TINY_AUX, "max_model_len": 512,
                     "cpu_kv_cache_gib": 1, "num_cpus": 0.5, "dtype": "float32"},
        "data": {"train": [{"kind": "chat", "path": str(train_file)}], "eval": [{"kind": "mtbench"}]},
        "extract": {"max_tokens_per_batch": 512},
        "vocab": {"draft_vocab_size": 512},
        "train": {"num_workers": 2, "cpus_per_worker": 0.5, "max_steps": MAX_STEPS, "checkpoint_every": 10,
                  "max_tokens_per_batch": 256, "lr": 3e-3, "warmup_steps": 5, "val_fraction": 0.15, "ttt_steps": 2,
                  "shuffle_buffer_rows": 16, "max_failures": 1,
                  "cache_shard_mib": 64,  # later epochs replay each worker's share from memory (the CPU default's path)
                  "autocast": "bfloat16"},  # the AMX default's path, on any CPU (auto would depend on the host)
    }))
    cfg = load_config(cfg_path)
    prepare(cfg)
    extract(cfg, progress=False)
    build_vocab(cfg)
    trace = tmp / "trace"
    summary = train(cfg, hooks=WorkerHooks(fail_at_step=28, trace_dir=str(trace)))
    return cfg, summary, trace, str(cfg_path)


def test_training_beats_untrained_head(trained):
    cfg, s, _, _ = trained
    assert s.untrained_metrics and s.best_metrics
    before, after = s.untrained_metrics["val_full_acc_0"], s.best_metrics["val_full_acc_0"]
    print(f"held-out accuracy at TTT position 0: untrained {before:.3f} -> trained {after:.3f}")
    assert after > before + 0.2, (before, after)


def test_killed_worker_resumes_from_checkpoint_without_skipping_data(trained):
    cfg, s, trace, _ = trained
    assert s.steps == MAX_STEPS
    # Checkpoints every 10 steps; the worker died at step 28. The restarted worker resumes from the newest
    # complete checkpoint on storage (20), also when the step-20 report had not reached Ray Train's controller.
    assert s.resumed_from == 20
    r = s.resumed_from
    history = read_metrics(storage.run_paths(cfg))
    assert {"step": r, "event": "resumed"} in history
    # Rebuild the surviving lineage: steps <= r from the first attempt, everything from the second.
    by_file: dict[str, list[dict]] = {}
    for f in glob.glob(str(trace / "*.jsonl")):
        with open(f) as fh:
            by_file[os.path.basename(f)] = [json.loads(line) for line in fh if line.strip()]
    first = [e for es in by_file.values() for e in es if es and es[0]["step"] == 1]
    second = [e for es in by_file.values() for e in es if es and es[0]["step"] == r + 1]
    assert first and second, "expected traces of both attempts"
    assert max(e["step"] for e in first) >= 28 > r  # the first attempt really ran past the checkpoint
    kept = [e for e in first if e["step"] <= r] + second
    assert sorted({e["step"] for e in kept}) == list(range(1, MAX_STEPS + 1))
    # Within each epoch, no sample id is used twice across the crash, and the epochs are complete up to the
    # tail the workers drop together.
    for epoch in {e["epoch"] for e in kept}:
        ids = [i for e in kept if e["epoch"] == epoch for i in e["ids"]]
        assert len(ids) == len(set(ids)), f"epoch {epoch}: a sample was trained twice"
    # Epoch 0 saw (nearly) all training samples: only the tail both workers drop together is missing.
    epoch0 = {i for e in kept if e["epoch"] == 0 for i in e["ids"]}
    assert len(epoch0) > 0.6 * 64 * (1 - cfg.train.val_fraction)
    # Whole later epochs (replayed from the workers' shard caches, train.cache_shard_mib) also see (nearly) all
    # training samples; the last epoch is cut short by max_steps
    epochs = sorted({e["epoch"] for e in kept})
    assert len(epochs) >= 3, epochs
    for epoch in epochs[1:-1]:
        seen = {i for e in kept if e["epoch"] == epoch for i in e["ids"]}
        assert len(seen) > 0.6 * 64 * (1 - cfg.train.val_fraction), (epoch, len(seen))


def test_a_nan_in_training_stops_the_run_naming_the_step_and_samples_and_keeps_the_last_good_checkpoint(trained,
                                                                                                      tmp_path):
    """Item 6 end to end: a NaN in the hidden states of step 4 (on every attempt, as bad data would be) stops
    training with an error naming the step, its samples and the last good checkpoint (step 3), which stays on
    storage; Ray Train's retries (train.max_failures=2) raise at once instead of training to step 4 again."""
    from eagle3ray.config import load_config
    from eagle3ray.train_worker import NonFiniteLoss

    cfg, _, _, cfg_path = trained
    src = storage.run_paths(cfg)
    nan_cfg = load_config(cfg_path, ["run.name=nan", "train.max_steps=8", "train.checkpoint_every=3",
                                     "train.max_failures=2", "train.num_workers=1"])
    dst = storage.run_paths(nan_cfg)
    for d in ("conversations", "hidden_states", "vocab"):
        shutil.copytree(src.sub(d), dst.sub(d))
    trace = tmp_path / "trace"
    with pytest.raises(NonFiniteLoss) as e:
        train(nan_cfg, hooks=WorkerHooks(nan_at_step=4, trace_dir=str(trace)))
    msg = str(e.value)
    assert "step 4 (epoch 0, samples [" in msg and "loss is nan" in msg, msg
    assert "last good checkpoint is step 3" in msg, msg
    steps = [json.loads(line)["step"] for f in glob.glob(str(trace / "*.jsonl")) for line in open(f) if line.strip()]
    assert sorted(steps) == [1, 2, 3]  # one attempt trained; the retries stopped before training
    assert len(glob.glob(str(trace / "*.jsonl"))) == 1
    history = read_metrics(dst)
    assert [m["step"] for m in history if m.get("event") is None] == [3]
    assert not any(m.get("event") == "resumed" for m in history)
    from eagle3ray.train_worker import WorkerCheckpoint

    last = WorkerCheckpoint.latest_on_storage(dst.fs, dst.sub("checkpoints", "train"))
    assert last and last[0] == 3 and not dst.fs.exists(dst.sub("checkpoints", "complete.json"))


def test_rerun_of_finished_training_does_nothing(trained):
    cfg, s, _, _ = trained
    again = train(cfg)
    assert again.skipped and again.steps == s.steps


def test_export_loads_in_vllm_and_keeps_greedy_text(trained, ray_session, tiny_verifier):
    import ray

    from eagle3ray.serving_engine import ServingEngine, acceptance

    cfg, _, _, cfg_path = trained
    e = export(cfg)
    rep = check_draft(e.local_dir, tiny_verifier)
    assert rep.ok, rep.render()
    # trained with 2 TTT steps, the draft proposes validate's k (3), which vLLM takes when given no k
    assert cfg.train.ttt_steps == 2 and cfg.validation.num_speculative_tokens == 3
    with open(os.path.join(e.local_dir, "config.json")) as f:
        assert json.load(f)["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    with open(os.path.join(e.local_dir, "provenance.json")) as f:
        assert json.load(f)["vllm_usage"]["num_speculative_tokens"] == 3
    assert export(cfg).skipped  # same checkpoint, same k
    from eagle3ray.config import load_config
    e4 = export(load_config(cfg_path, ["validation.num_speculative_tokens=4"]))  # another k: exported again
    assert not e4.skipped
    with open(os.path.join(e4.local_dir, "config.json")) as f:
        assert json.load(f)["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    e = export(cfg)  # back to the config's k for the tests below
    assert not e.skipped
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_verifier)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
               for q in ("alpha beta gamma?", "draft verifier token", "hidden state layer vllm train")]
    prompts = [p["input_ids"] if hasattr(p, "keys") else p for p in prompts]
    Engine = ray.remote(num_cpus=0.5)(ServingEngine)
    common = dict(max_model_len=512, cpu_kv_cache_gib=1)
    spec = Engine.remote(tiny_verifier, draft_dir=e.local_dir, num_speculative_tokens=3, **common)
    with_draft = ray.get(spec.generate.remote(prompts, 24))
    acc = acceptance(ray.get(spec.spec_counters.remote()))
    ray.kill(spec)
    base = Engine.remote(tiny_verifier, draft_dir=None, **common)
    without = ray.get(base.generate.remote(prompts, 24))
    ray.kill(base)
    assert with_draft["outputs"] == without["outputs"]  # speculation must not change greedy text
    assert acc["num_drafts"] > 0 and len(acc["acceptance_per_position"]) == 3


def _mutate(src: str, dst, config_edit=None, tensor_edit=None):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config_edit:
        p = os.path.join(dst, "config.json")
        with open(p) as f:
            c = json.load(f)
        config_edit(c)
        with open(p, "w") as f:
            json.dump(c, f)
    if tensor_edit:
        p = os.path.join(dst, "model.safetensors")
        t = load_file(p)
        tensor_edit(t)
        save_file(t, p)
    return str(dst)


def _cut_cols(name, n):
    def edit(t):
        t[name] = t[name][:, :n].contiguous()
    return edit


def _cut_rows(name, n):
    def edit(t):
        t[name] = t[name][:n].contiguous()
    return edit


@pytest.mark.parametrize("label, config_edit, tensor_edit, expect", [
    ("fc width", None, _cut_cols("fc.weight", 64), "fc.weight"),
    ("head_dim in q_proj", None, _cut_rows("layers.0.self_attn.q_proj.weight", 96), "q_proj"),
    ("missing d2t", None, lambda t: t.pop("d2t"), "'d2t' missing"),
    ("d2t length", None, _cut_rows("d2t", 100), "d2t"),
    ("aux layer beyond depth", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 4, 9]), None,
     "eagle_aux_hidden_state_layer_ids"),
    ("hidden size", lambda c: c["transformer_layer_config"].update(hidden_size=256), None, "hidden_size"),
])
def test_check_fails_on_mutated_exports(trained, tmp_path, tiny_verifier, label, config_edit, tensor_edit, expect):
    cfg, _, _, _ = trained
    e = export(cfg)
    bad = _mutate(e.local_dir, tmp_path / "bad", config_edit, tensor_edit)
    rep = check_draft(bad, tiny_verifier)
    assert not rep.ok, label
    assert any(expect in p for p in rep.problems), (label, rep.problems)


def test_check_resolves_nested_text_config(trained, tmp_path, tiny_verifier):
    cfg, _, _, _ = trained
    e = export(cfg)
    with open(os.path.join(tiny_verifier, "config.json")) as f:
        inner = json.load(f)
    nested = {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"], "text_config": inner,
              "vision_config": {"hidden_size": 32}}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(nested))
    rep = check_draft(e.local_dir, str(p))
    assert rep.ok, rep.render()


def test_run_after_interruption_skips_finished_stages_and_validates(trained, monkeypatch):
    """The fixture ran prepare..train (as if `run` was interrupted after train); `run` resumes from there. As a
    run on a local cluster of its own, it stops the verifier service once extract is behind it; validation's
    engines start two at a time (CPU), the greedy-check pair after the first pair."""
    from typer.testing import CliRunner

    from eagle3ray import machine
    from eagle3ray.cli import app
    from eagle3ray.verifier import VerifierSpec
    from eagle3ray.verifier_service import app_name, running_verifiers, start_for_config

    cfg, _, _, cfg_path = trained
    start_for_config(cfg)  # as the extract stage left it (running, whether or not an earlier test stopped it)
    assert app_name(VerifierSpec.from_config(cfg)) in running_verifiers()
    monkeypatch.setattr(machine, "STARTED_LOCAL_CLUSTER", True)  # the session's cluster stands in for the run's own
    # acceptance and speed in bf16, the greedy-identity check on a second pair of engines in fp32
    r = CliRunner().invoke(app, ["run", "-c", cfg_path, "validation.max_prompts=4", "validation.max_new_tokens=16",
                                 "validation.max_num_seqs=4", "validation.dtype=bfloat16",
                                 "validation.greedy_check_dtype=float32", "--no-progress"])
    assert r.exit_code == 0, r.output
    out = r.output
    assert "prepare done in 0 s: prepare: 64 conversations" in out and "tokens (already complete)" in out
    assert "extract: 64 samples" in out and "(already complete)" in out
    assert "train: 40 steps (already complete)" in out
    paths = storage.run_paths(cfg)
    rep = storage.read_json(paths.fs, f"{paths.sub('reports')}/validate.json")
    for field in ("mean_acceptance_length", "acceptance_per_position", "num_speculative_tokens", "num_prompts",
                  "eval_set", "tokens_per_s_spec", "tokens_per_s_baseline", "speedup", "checkpoint", "verifier"):
        assert field in rep, field
    assert rep["num_prompts"] == 4 and rep["eval_set"] == "mtbench" and len(rep["acceptance_per_position"]) == 3
    assert rep["mean_acceptance_length"] >= 1.0 and rep["greedy_identical"] == "4/4"
    assert rep["dtype"] == "bfloat16" and rep["verifier_dtype"] == "float32" and rep["greedy_check_dtype"] == "float32"
    assert rep["greedy_check"]["dtype"] == "float32" and rep["greedy_check"]["mean_acceptance_length"] >= 1.0
    assert rep["greedy_identical_at_dtype"].endswith("/4")
    assert "greedy outputs identical (float32)" in out
    assert app_name(VerifierSpec.from_config(cfg)) not in running_verifiers()
    eng = rep["engine_seconds"]
    assert [(e["draft"], e["dtype"], e["started_together"]) for e in eng] == [
        (True, "bfloat16", 2), (False, "bfloat16", 2), (True, "float32", 2), (False, "float32", 2)]
    assert all(e["start_s"] > 0 and e["decode_s"] > 0 for e in eng)
    with paths.fs.open(f"{paths.sub('reports')}/validate.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_validate_by_category_and_temperature_with_a_reference_draft_and_a_gate(trained, tmp_path):
    """One report: 8 MT-Bench categories, temperatures 0 and 0.7, a second draft beside the run's; a gate above
    the draft's score exits 1 and leaves the report; a gate below it passes on the stored report."""
    from typer.testing import CliRunner

    from eagle3ray.cli import app

    cfg, _, _, cfg_path = trained
    paths = storage.run_paths(cfg)
    ref = tmp_path / "older" / "export"
    shutil.copytree(paths.sub("export"), ref)  # the same weights: at T=0 it must score exactly the same
    args = ["validate", "-c", cfg_path, "validation.max_prompts=8", "validation.max_new_tokens=16",
            "validation.max_num_seqs=8", "validation.temperatures=[0.0,0.7]"]
    r = CliRunner().invoke(app, [*args, "validation.min_acceptance_length=4.0", "--draft", str(ref)])
    assert r.exit_code == 1, r.output
    assert "acceptance gate failed" in r.output and "< validation.min_acceptance_length 4.0" in r.output
    rep = storage.read_json(paths.fs, f"{paths.sub('reports')}/validate.json")
    assert rep["gate"] == {"min_acceptance_length": 4.0, "passed": False, "temperature": 0.0}
    assert [t["temperature"] for t in rep["temperatures"]] == [0.0, 0.7]
    cats = rep["by_category"]
    assert list(cats) == ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
    assert all(c["num_prompts"] == 1 for c in cats.values())
    # per-request histograms add up to vLLM's counters (validate checks it too) at every temperature
    for t in rep["temperatures"]:
        assert sum(c["num_drafts"] for c in t["by_category"].values()) == t["num_drafts"] > 0
        assert t["mean_acceptance_length"] == pytest.approx(1 + sum(t["acceptance_per_position"]))
    assert rep["temperatures"][0]["greedy_identical"] == "8/8" and rep["temperatures"][1]["greedy_identical"] \
        .startswith("n/a")
    from eagle3ray.vllm_cpu_fixes import APPLIED

    assert rep["vllm_cpu_expand_fix"] == APPLIED or rep["vllm_cpu_expand_fix"].startswith("not needed")
    (older,) = rep["reference_drafts"]
    assert older["path"] == str(ref) and older["label"].startswith("older step ")
    assert older["temperatures"][0]["mean_acceptance_length"] == rep["mean_acceptance_length"]
    assert older["temperatures"][0]["by_category"] == rep["by_category"]
    assert "reference draft older step" in r.output
    with paths.fs.open(f"{paths.sub('reports')}/validate.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    again = CliRunner().invoke(app, [*args, "validation.min_acceptance_length=1.0", "--draft", str(ref)])
    assert again.exit_code == 0, again.output
    assert "already validated: skipped" in again.output and "passed: " in again.output


def test_readme_vllm_serve_block_works_as_written_from_a_plain_shell(trained):
    """README's "serve it with stock vLLM" block, pasted into a shell where the venv is not activated, serves the
    exported draft beside its verifier: a completion comes back and vLLM counts drafts. Changed only: the run's
    folder (this test's run), and the server bound to a free port on 127.0.0.1 with a small context."""
    import signal
    import subprocess
    import time
    import urllib.request
    from pathlib import Path

    from conftest import free_port

    repo = Path(__file__).resolve().parents[1]
    text = (repo / "README.md").read_text()
    after = text[text.index("Serve it"):]
    start = after.index("```bash\n") + len("```bash\n")
    block = after[start:after.index("```", start)]
    assert "vllm.entrypoints.openai.api_server" in block and "eagle3" in block
    cfg, _, _, _ = trained
    run_dir = storage.run_paths(cfg).root  # a local path: the test's storage is file://
    port = free_port()
    script = block.replace("runs/smollm2-135m-cpu/", run_dir.rstrip("/") + "/").replace("\\\n", " ").rstrip()
    script = "set -euo pipefail\n" + script + f" --host 127.0.0.1 --port {port} --max-model-len 512 --enforce-eager\n"
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ["HOME"], "LANG": "C.UTF-8",
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    p = subprocess.Popen(["bash", "-c", script], cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and p.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(2)
        assert p.poll() is None, p.stdout.read()[-5000:]
        body = json.dumps({"model": json.load(open(os.path.join(run_dir, "export", "provenance.json")))
                           ["verifier_path"], "prompt": "The capital of France is", "max_tokens": 16,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.load(r)
        assert out["choices"][0]["text"] and out["usage"]["completion_tokens"] > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        drafts = [float(ln.split()[-1]) for ln in metrics.splitlines() if ln.startswith("vllm:spec_decode_num_drafts")]
        assert drafts and sum(drafts) > 0, "the server ran without speculative decoding"
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def _run_copy(trained, name: str, overrides: list[str]):
    """A config for a new run ``name`` holding a copy of the fixture run's conversations, blocks and vocabulary
    (training starts from step 0 on the same data), with ``overrides``."""
    from eagle3ray.config import load_config

    cfg, _, _, cfg_path = trained
    new = load_config(cfg_path, [f"run.name={name}", *overrides])
    src, dst = storage.run_paths(cfg), storage.run_paths(new)
    for d in ("conversations", "hidden_states", "vocab"):
        shutil.copytree(src.sub(d), dst.sub(d))
    return new


def _lineage(trace) -> list[dict]:
    """The steps that count, from the workers' traces (one file per worker process, named by start time): a
    later attempt that starts at step s+1 replaces every entry past s."""
    files = sorted(glob.glob(str(trace / "*.jsonl")), key=lambda f: int(f.rsplit("-", 1)[1].split(".")[0]))
    kept: list[dict] = []
    starts: list[int] = []
    for f in files:
        es = [json.loads(line) for line in open(f) if line.strip()]
        if not es:
            continue
        first = es[0]["step"]
        if not starts or starts[-1] != first:  # a new attempt (ranks of one attempt start at the same step)
            kept = [e for e in kept if e["step"] < first]
            starts.append(first)
        kept += es
    return kept


def _train_ids(cfg) -> list[str]:
    """Sample ids of the training blocks (the blocks train() does not hold out)."""
    import pyarrow.parquet as pq

    from eagle3ray import blocks

    paths = storage.run_paths(cfg)
    man, files = blocks.read_committed(paths.fs, paths.hidden_states)
    train_files, _ = held_out_split(files, [b["tokens"] for b in man["blocks"]], cfg.train.val_fraction)
    return [i for f in train_files for i in pq.read_table(f, columns=["sample_id"]).column(0).to_pylist()]


def test_two_worker_deaths_in_one_epoch_train_no_sample_twice(trained, tmp_path):
    """A worker dies at step 6 (resumed from step 4) and again at step 11 (resumed from step 8), all in epoch 0
    (one sample a step): the step-8 checkpoint written after the first resume must still hold the samples of
    steps 1-4, or the second resume trains them again."""
    cfg = _run_copy(trained, "twice", ["train.num_workers=1", "train.max_steps=16", "train.checkpoint_every=4",
                                       "train.max_failures=2", "train.max_tokens_per_batch=32"])
    trace = tmp_path / "trace"
    s = train(cfg, hooks=WorkerHooks(fail_once_at=(6, 11), trace_dir=str(trace)))
    assert s.steps == 16 and sorted(os.listdir(trace)).count("failed-6") == 1 and (trace / "failed-11").exists()
    history = read_metrics(storage.run_paths(cfg))
    assert [m["step"] for m in history if m.get("event") == "resumed"] == [4, 8]
    kept = _lineage(trace)
    assert [e["step"] for e in kept] == list(range(1, 17))
    assert {e["epoch"] for e in kept} == {0}, "the test needs all 16 steps in one epoch"
    ids = [i for e in kept for i in e["ids"]]
    assert len(ids) == len(set(ids)), f"a sample was trained twice in epoch 0: {sorted(ids)}"


def test_a_run_resumes_with_another_number_of_workers_training_each_sample_once_per_epoch(trained, tmp_path):
    """Issue 18: 4 steps with 1 worker, the same run continued to step 8 with 2 workers, then to step 32 with 1
    (the data position is kept per sample, not per rank; both changes, 1 -> 2 and 2 -> 1, in one run, as each
    Ray Train start costs a minute here): epoch 0 trains no sample twice and every training sample but the tail the
    workers drop together at the epoch's end (``epoch_tail_samples``, summed over the ranks) and the up to
    ``workers - 1`` rows Ray Train's equal split leaves out of the epoch's last segment."""
    from eagle3ray.config import load_config

    common = ["train.checkpoint_every=2", "train.max_tokens_per_batch=256", "train.max_failures=0"]
    segments = [(1, 4), (2, 8), (1, 32)]  # (workers, last step)
    trace = tmp_path / "trace"
    for i, (workers, steps) in enumerate(segments):
        overrides = [f"train.num_workers={workers}", f"train.max_steps={steps}", *common]
        cfg = _run_copy(trained, "w121", overrides) if i == 0 else load_config(trained[3], ["run.name=w121",
                                                                                             *overrides])
        assert train(cfg, hooks=WorkerHooks(trace_dir=str(trace))).steps == steps
    history = read_metrics(storage.run_paths(cfg))
    assert [m["step"] for m in history if m.get("event") == "resumed"] == [4, 8], "a run started over"
    kept = _lineage(trace)
    assert sorted({e["step"] for e in kept}) == list(range(1, 33))
    epoch0 = [i for e in kept if e["epoch"] == 0 for i in e["ids"]]
    assert len(epoch0) == len(set(epoch0)), "a sample was trained twice in epoch 0"
    assert max(e["step"] for e in kept if e["epoch"] == 0) > 8, "the test needs epoch 0 to end in the last segment"
    assert any(e["epoch"] >= 1 for e in kept), "the test needs epoch 0 to end"
    tail = next(m["epoch_tail_samples"] for m in history if m.get("event") is None and m["epoch"] >= 1)
    train_ids = _train_ids(cfg)
    assert set(epoch0) <= set(train_ids)
    assert len(train_ids) - len(epoch0) - tail == 0, (len(epoch0), tail, len(train_ids))  # 1 worker: none left out


def test_online_training_streams_the_services_states_into_ray_train_and_stores_none(trained, tmp_path):
    """Issue 18, ``train.data_source: online`` on the fixture's conversations: the draft vocabulary is counted
    from the conversations and equals the one extraction's blocks gave; 2 workers train from the verifier
    service's stream, the last one killed at step 6 (resumed from step 4); no sample is trained twice in an epoch,
    epoch 0 trains every training sample but the counted tail (and at most 1 row Ray Train's equal split leaves
    out); the draft learns; nothing is stored under
    hidden_states/; the extract stage does not run."""
    from eagle3ray import online
    from eagle3ray.config import load_config
    from eagle3ray.pipeline import run_stage

    cfg0, _, _, cfg_path = trained
    cfg = load_config(cfg_path, ["run.name=online", "train.data_source=online", "train.max_steps=16",
                                 "train.checkpoint_every=4", "train.max_tokens_per_batch=384"])
    src, dst = storage.run_paths(cfg0), storage.run_paths(cfg)
    shutil.copytree(src.sub("conversations"), dst.sub("conversations"))
    assert run_stage(cfg, "extract", progress=False).headline().startswith("extract: not run")
    with pytest.raises(ValueError, match="needs token_freq"):
        build_vocab(cfg)
    run_stage(cfg, "vocab", progress=False)
    ours, theirs = (storage.read_json(p.fs, f"{p.sub('vocab')}/vocab.json") for p in (dst, src))
    assert ours["token_freq_sha256"] == theirs["token_freq_sha256"] and ours["coverage"] == theirs["coverage"]
    trace = tmp_path / "trace"
    s = train(cfg, hooks=WorkerHooks(fail_at_step=6, trace_dir=str(trace)), stream=online.datasets)
    assert s.steps == 16 and s.resumed_from == 4
    assert s.best_metrics["val_full_acc_0"] > s.untrained_metrics["val_full_acc_0"] + 0.1, (s.untrained_metrics,
                                                                                          s.best_metrics)
    assert not dst.fs.exists(dst.hidden_states), "online training stored hidden states"
    kept = _lineage(trace)
    assert sorted({e["step"] for e in kept}) == list(range(1, 17))  # every step once (each rank traces it)
    for epoch in {e["epoch"] for e in kept}:
        ids = [i for e in kept if e["epoch"] == epoch for i in e["ids"]]
        assert len(ids) == len(set(ids)), f"epoch {epoch}: a sample was trained twice"
    assert any(e["epoch"] >= 1 for e in kept), "the test needs epoch 0 to end"
    train_s, _, _ = online.split_samples(cfg, dst)
    epoch0 = {i for e in kept if e["epoch"] == 0 for i in e["ids"]}
    assert epoch0 <= {x["sample_id"] for x in train_s}
    history = read_metrics(dst)
    tail = next(m["epoch_tail_samples"] for m in history if m.get("event") is None and m["epoch"] >= 1)
    assert 0 <= len(train_s) - len(epoch0) - tail <= 1, (len(epoch0), tail, len(train_s))  # 1: the equal split


def test_hybrid_training_commits_each_streamed_sample_once_and_a_later_offline_run_reuses_the_blocks(trained, tmp_path):
    """Issue 18, ``train.data_source: hybrid``: the train stage streams the verifier service's states as online does
    (a worker killed at step 6, resumed from step 4) and commits each unit's block; later epochs and the resumed
    samples are read back from those blocks; once every sample is committed the manifest is audited and sealed, a
    complete extraction: every sample that fits the verifier exactly once, the same token frequencies the vocab
    stage counted from the conversations. An offline run on the same run then extracts nothing and trains from the
    committed blocks."""
    import pyarrow.parquet as pq

    from eagle3ray import blocks, online
    from eagle3ray.config import load_config
    from eagle3ray.pipeline import _train, run_stage

    cfg0, _, _, cfg_path = trained
    common = ["run.name=hybrid", "train.checkpoint_every=4", "train.max_tokens_per_batch=384"]
    cfg = load_config(cfg_path, [*common, "train.data_source=hybrid", "train.max_steps=16"])
    src, dst = storage.run_paths(cfg0), storage.run_paths(cfg)
    shutil.copytree(src.sub("conversations"), dst.sub("conversations"))
    assert "commits them under hidden_states/" in run_stage(cfg, "extract", progress=False).headline()
    assert not dst.fs.exists(dst.hidden_states)
    run_stage(cfg, "vocab", progress=False)
    trace = tmp_path / "trace"
    s = _train(cfg, False, hooks=WorkerHooks(fail_at_step=6, trace_dir=str(trace)))
    assert s.steps == 16 and s.resumed_from == 4
    assert s.best_metrics["val_full_acc_0"] > s.untrained_metrics["val_full_acc_0"] + 0.1
    kept = _lineage(trace)
    for epoch in {e["epoch"] for e in kept}:
        ids = [i for e in kept if e["epoch"] == epoch for i in e["ids"]]
        assert len(ids) == len(set(ids)), f"epoch {epoch}: a sample was trained twice"
    assert any(e["epoch"] >= 1 for e in kept), "the test needs epoch 0 to end"
    # the stream committed every sample exactly once, and sealed the manifest
    train_s, val_s, _ = online.split_samples(cfg, dst)
    expected = sorted(x["sample_id"] for x in train_s + val_s)
    man, files = blocks.read_committed(dst.fs, dst.hidden_states)
    ids = [i for f in files for i in pq.read_table(f, columns=["sample_id"]).column(0).to_pylist()]
    assert sorted(ids) == expected and len(ids) == len(set(ids))
    assert man["complete"] and man["audit"]["passed"], man.get("audit")
    assert sorted("blocks/" + f.rsplit("/", 1)[-1] for f in dst.fs.ls(f"{dst.hidden_states}/blocks", detail=False)) \
        == sorted(b["path"] for b in man["blocks"])  # no orphan left
    assert s.hybrid["complete"] and s.hybrid["committed"] == s.hybrid["expected"] == len(expected)
    assert s.hybrid["samples_committed"] == len(expected)  # this run committed them all, each once
    assert s.hybrid["samples_from_storage"] >= len(train_s)  # epoch 1 (at least) read back, not re-extracted
    vocab = storage.read_json(dst.fs, f"{dst.sub('vocab')}/vocab.json")
    # an offline run on the same run: nothing extracted, the vocabulary kept, training reads the committed blocks
    off = load_config(cfg_path, [*common, "train.data_source=offline", "train.max_steps=8"])
    ex = run_stage(off, "extract", progress=False)
    assert ex.skipped and ex.samples == 0 and ex.total_samples == len(expected)
    assert run_stage(off, "vocab", progress=False).skipped
    assert storage.read_json(dst.fs, f"{dst.sub('vocab')}/vocab.json") == vocab
    t = run_stage(off, "train", progress=False)
    assert t.steps == 8 and not t.skipped
    assert blocks.read_committed(dst.fs, dst.hidden_states)[0]["blocks"] == man["blocks"]


def test_cpu_workers_start_with_tcmalloc_where_it_is_installed(trained):
    """The Ray Train workers' own /proc/self/maps (reported per checkpoint as ``worker_tcmalloc``) show tcmalloc
    exactly when eagle3ray.machine.cpu_engine_env would preload it (or this process already has it)."""
    from eagle3ray.artifacts import read_metrics
    from eagle3ray.machine import cpu_engine_env, tcmalloc_loaded

    cfg, _, _, _ = trained
    rows = [r for r in read_metrics(storage.run_paths(cfg)) if "worker_tcmalloc" in r]
    assert rows, "no metrics row carries worker_tcmalloc"
    expected = 1.0 if (cpu_engine_env("cpu") or tcmalloc_loaded()) else 0.0
    assert {r["worker_tcmalloc"] for r in rows} == {expected}


def test_the_same_blocks_settings_and_seed_train_the_same_draft(trained, tmp_path):
    """train.ordered_ingest (the default): two runs on copies of the same blocks, one worker, the same seed, step
    through the same samples in the same order (the hooks' trace) and report the same held-out accuracy and loss,
    bit for bit. Before it, Ray Data's read tasks decided the order and such runs differed from their first step
    (benchmarks/train_determinism.py on the default run's blocks, docs/results.md)."""
    overrides = ["train.num_workers=1", "train.max_steps=6", "train.checkpoint_every=3",
                 "train.max_tokens_per_batch=64", "train.max_failures=0", "train.ordered_ingest=true"]
    runs = []
    for name in ("same-a", "same-b"):
        cfg = _run_copy(trained, name, overrides)
        trace = tmp_path / name
        assert train(cfg, hooks=WorkerHooks(trace_dir=str(trace))).steps == 6
        steps = [json.loads(line) for f in glob.glob(str(trace / "*.jsonl")) for line in open(f)]
        rows = [(m["step"], m.get("val_full_acc_0"), m.get("train_loss")) for m in read_metrics(storage.run_paths(cfg))]
        runs.append((steps, rows))
    assert len(runs[0][0]) == 6 and len(runs[0][1]) == 3, runs[0]
    assert runs[0][0] == runs[1][0], "the two runs stepped through other samples or in another order"
    assert runs[0][1] == runs[1][1]


def _read_ops(ds) -> list[str]:
    """The logical plan's operators of a Ray Data dataset, read op last (``Read`` for v1, ``ReadFiles`` after
    ``ListFiles`` for v2)."""
    op, names = ds._logical_plan.dag, []
    while op is not None:
        names.append(type(op).__name__)
        op = op.input_dependencies[0] if op.input_dependencies else None
    return names


def test_blocks_are_read_with_ray_datas_v1_parquet_reader_not_its_footer_reader_pool(trained, monkeypatch):
    """``train.read_blocks`` builds Ray Data's v1 Parquet read (one ``Read`` over the listed files), not v2's
    ``ListFiles``/``ReadFiles``, whose ``FooterReader`` actor pool started up to 32 processes at every epoch and
    held-out evaluation (docs/plan.md, "Ray Data's Parquet reader"); ``RAY_DATA_USE_DATASOURCE_V2=1`` keeps v2, and
    Ray Data's own setting is left as it was either way."""
    import ray

    from eagle3ray import blocks
    from eagle3ray.train import read_blocks

    cfg, _, _, _ = trained
    paths = storage.run_paths(cfg)
    man, _ = blocks.read_committed(paths.fs, paths.hidden_states)
    files = [f"{paths.hidden_states}/{b['path']}" for b in man["blocks"]]
    ctx = ray.data.DataContext.get_current()
    before = ctx.use_datasource_v2
    monkeypatch.delenv("RAY_DATA_USE_DATASOURCE_V2", raising=False)
    ds = read_blocks(files, storage.arrow_filesystem(paths.fs))
    assert _read_ops(ds)[-1] == "Read" and "ListFiles" not in _read_ops(ds)
    assert ds.count() == man["counts"]["samples"]  # every committed sample, one row each
    assert ctx.use_datasource_v2 == before
    monkeypatch.setenv("RAY_DATA_USE_DATASOURCE_V2", "1")
    assert _read_ops(read_blocks(files, storage.arrow_filesystem(paths.fs)))[-2:] == ["ReadFiles", "ListFiles"]
    assert ctx.use_datasource_v2 == before
