"""Prompt sources, the chat template's loss mask (token by token), held-out de-duplication."""

from __future__ import annotations

import json

import pytest

from eagle3ray.chat import tokenize_conversation
from eagle3ray.sources import Record, Rejected, read_chat, read_sharegpt


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_loss_mask_covers_exactly_the_assistant_tokens_multi_turn(tokenizer):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "Seven is prime."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "Eleven.\nAlso 13."},
    ]
    ids, mask = tokenize_conversation(tokenizer, msgs)
    assert len(ids) == len(mask)
    # Token by token: group consecutive masked tokens into runs and decode each run.
    runs, cur = [], []
    for tok, m in zip(ids, mask):
        if m:
            cur.append(tok)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    assert [tokenizer.decode(r) for r in runs] == ["Seven is prime.<|im_end|>", "Eleven.\nAlso 13.<|im_end|>"]
    # Everything unmasked is template, system or user text.
    unmasked = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    assert "Name a prime." in unmasked and "Another?" in unmasked and "Seven" not in unmasked
    assert unmasked.count("<|im_start|>assistant\n") == 2


def test_loss_mask_when_template_injects_a_system_prompt(tokenizer):
    ids, mask = tokenize_conversation(tokenizer, [{"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": "hello"}])
    assert "SmolLM" in tokenizer.decode(ids)  # SmolLM2's template adds its default system prompt
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == "hello<|im_end|>"


def test_sharegpt_truncated_file_keeps_every_complete_record(tmp_path):
    recs = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
            for i in range(3)]
    text = json.dumps(recs, indent=2)
    cut = text[: text.index('"r2"') + 10]  # truncated inside the third record
    p = tmp_path / "sharegpt.json"
    p.write_text(cut)
    out = list(read_sharegpt(p))
    assert [r.sample_id for r in out if isinstance(r, Record)] == ["sharegpt:r0", "sharegpt:r1"]
    assert [r.reason for r in out if isinstance(r, Rejected)] == ["malformed_json"]
    assert out[0].messages == [{"role": "user", "content": "q0"}, {"role": "assistant", "content": "a0"}]


def test_packaged_sharegpt_reads_records():
    out = list(read_sharegpt(max_records=50))
    good = [r for r in out if isinstance(r, Record)]
    assert len(out) == 50 and len(good) >= 40
    assert all(any(m["role"] == "assistant" for m in r.messages) for r in good)


def test_chat_jsonl_reasons_name_file_and_line(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_bytes(b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n'
                  b'{not json\n'
                  b'{"messages": [{"role": "user", "content": "\xff"}]}\n'
                  b'{"messages": [{"role": "user"}]}\n'
                  b'{"other": 1}\n')
    out = list(read_chat(p))
    assert isinstance(out[0], Record) and out[0].sample_id == "chat:c.jsonl:1"
    assert [(r.reason, r.where.rsplit(":", 1)[-1].split()[0]) for r in out[1:]] == [
        ("malformed_json", "2"), ("invalid_utf8", "3"), ("bad_message", "4"), ("empty_conversation", "5")]
    assert "messages" in out[-1].where + out[-1].detail


def test_training_prompts_in_eval_set_are_removed(tmp_path, make_cfg):
    from eagle3ray.prepare import collect_records
    from eagle3ray.sources import RejectCounter, read_mtbench

    q = read_mtbench()[0]["turns"][0]
    p = tmp_path / "t.jsonl"
    rows = [[{"role": "user", "content": "  " + q.upper() + " "}, {"role": "assistant", "content": "x"}],
            [{"role": "user", "content": "fresh"}, {"role": "assistant", "content": "y"}],
            [{"role": "user", "content": "fresh"}, {"role": "assistant", "content": "z"}]]
    p.write_text("\n".join(json.dumps({"messages": m}) for m in rows))
    rej = RejectCounter()
    kept = collect_records(make_cfg([p]), rej)
    assert [r.messages[1]["content"] for r in kept] == ["y"]
    assert rej.counts == {"in_eval_set": 1, "duplicate": 1}


def test_prepare_refuses_to_redo_conversations_under_blocks_of_another_dtype(tmp_path, make_cfg):
    from eagle3ray import storage
    from eagle3ray.blocks import ManifestMismatch
    from eagle3ray.prepare import prepare

    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}))
    cfg = make_cfg([p], "data.regenerate=true")  # the tiny verifier is pinned to float32
    paths = storage.run_paths(cfg)
    storage.write_json_atomic(paths.fs, f"{paths.hidden_states}/manifest.json",
                              {"verifier": {"compute_dtype": "bfloat16"}, "complete": False})
    with pytest.raises(ManifestMismatch, match=r"verifier.dtype 'bfloat16' .* 'float32'.*verifier.dtype=bfloat16"):
        prepare(cfg)
    assert not paths.fs.exists(f"{paths.conversations}/manifest.json")  # nothing was regenerated or written


def test_changing_data_sets_the_old_conversations_and_their_blocks_aside(tmp_path, make_cfg):
    """Re-running prepare with another data.* setting never overwrites what a partial extraction was made from."""
    from eagle3ray import storage
    from eagle3ray.prepare import prepare

    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                                   {"role": "assistant", "content": f"a{i}"}]}) for i in range(6)))
    cfg = make_cfg([p], "data.max_samples=3")
    paths = storage.run_paths(cfg)
    first = prepare(cfg)
    assert first.samples == 3
    old_conv = paths.fs.cat_file(f"{paths.conversations}/conversations.parquet")
    storage.write_json_atomic(paths.fs, f"{paths.hidden_states}/manifest.json", {"complete": False, "entries": []})
    paths.fs.pipe_file(f"{paths.hidden_states}/block-000001.parquet", b"a partial extraction's block")
    again = prepare(make_cfg([p], "data.max_samples=5"))
    assert again.samples == 5 and not again.skipped
    assert paths.fs.cat_file(paths.sub("conversations.superseded-1", "conversations.parquet")) == old_conv
    assert paths.fs.cat_file(paths.sub("hidden_states.superseded-1", "block-000001.parquet")) == \
        b"a partial extraction's block"
    assert not paths.fs.exists(paths.hidden_states)  # the new conversations start a new extraction
    prepare(make_cfg([p], "data.max_samples=4"))  # a second change: superseded-2, the first kept
    assert paths.fs.exists(paths.sub("conversations.superseded-2")) and paths.fs.exists(
        paths.sub("conversations.superseded-1"))
    assert prepare(make_cfg([p], "data.max_samples=4")).skipped  # the same settings again: nothing moves
    assert not paths.fs.exists(paths.sub("conversations.superseded-3"))
    # moved back (docs/faults.md: "move them back to resume"), the first conversations are the run's again: the
    # first setting's prepare is satisfied by them, and the partial extraction beside them is untouched
    paths.fs.mv(paths.conversations, paths.sub("conversations.mine"), recursive=True)
    paths.fs.mv(paths.sub("conversations.superseded-1"), paths.conversations, recursive=True)
    paths.fs.mv(paths.sub("hidden_states.superseded-1"), paths.hidden_states, recursive=True)
    back = prepare(cfg)
    assert back.skipped and back.samples == 3
    assert paths.fs.cat_file(f"{paths.conversations}/conversations.parquet") == old_conv
    assert paths.fs.cat_file(f"{paths.hidden_states}/block-000001.parquet") == b"a partial extraction's block"


def test_a_conversations_table_that_differs_from_its_manifest_is_refused_and_prepared_again(tmp_path, make_cfg,
                                                                                             caplog):
    """Review row 22: prepare writes the table before its manifest, so a prepare killed between the two (or a file
    replaced by hand) pairs an old manifest with another table. Reading it names the file and both hashes; the
    next prepare sees it and prepares the table again instead of skipping."""
    from eagle3ray import storage
    from eagle3ray.artifacts import read_conversations
    from eagle3ray.prepare import prepare

    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                                   {"role": "assistant", "content": f"a{i}"}]}) for i in range(6)))
    cfg = make_cfg([p], "data.max_samples=3")
    paths = storage.run_paths(cfg)
    prepare(cfg)
    good = paths.fs.cat_file(f"{paths.conversations}/conversations.parquet")
    other = make_cfg([p], "data.max_samples=4", "run.name=other")
    prepare(other)
    swapped = storage.run_paths(other).fs.cat_file(f"{storage.run_paths(other).conversations}/conversations.parquet")
    paths.fs.pipe_file(f"{paths.conversations}/conversations.parquet", swapped)  # a valid table, not this one
    with pytest.raises(ValueError, match=r"conversations/conversations.parquet: .* manifest.json records"):
        read_conversations(paths)
    with caplog.at_level("WARNING", logger="eagle3ray.prepare"):
        again = prepare(cfg)
    assert not again.skipped and again.samples == 3 and "preparing it again" in caplog.text
    assert paths.fs.cat_file(f"{paths.conversations}/conversations.parquet") == good  # deterministic
    assert read_conversations(paths)[1].num_rows == 3


def _chat_file(tmp_path, n):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"tell me about number {i}"},
                                                   {"role": "assistant", "content": "old"}]}) for i in range(n)))
    return p


@pytest.mark.slow
def test_regeneration_survives_a_killed_engine_and_resumes_without_redoing_answers(ray_session, tmp_path, make_cfg):
    """A real SIGKILL of the regeneration engine's process mid-run: its chunk is retried on a new engine. An
    interrupted prepare resumes from the committed chunks, regenerating only the rest."""
    import os
    import signal

    import psutil

    from eagle3ray import storage
    from eagle3ray.prepare import prepare
    from eagle3ray.artifacts import read_conversations

    args = ("data.regenerate=true", "data.regenerate_engine=dedicated", "data.max_new_tokens=6",
            "verifier.max_num_seqs=2")
    cfg = make_cfg([_chat_file(tmp_path, 6)], *args)
    paths = storage.run_paths(cfg)
    killed = []

    def kill_engine_after_first_chunk(k, n):
        if not killed:  # the engine actor's process (Ray titles it ray::ServingEngine...)
            (pid,) = [p.pid for p in psutil.process_iter(["cmdline"])
                      if any("ray::ServingEngine" in c for c in (p.info["cmdline"] or []))]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    s = prepare(cfg, on_chunk=kill_engine_after_first_chunk)
    assert killed and s.samples == 6
    _, table = read_conversations(paths)
    assert table.num_rows == 6
    assert not [f for f in paths.fs.ls(paths.conversations, detail=False) if "answers-" in f]

    cfg2 = make_cfg([_chat_file(tmp_path, 6)], *args, "data.seed=1")  # other settings: a run of their own
    paths2 = storage.run_paths(cfg2)
    seen = []

    class Interrupted(Exception):
        pass

    def stop_after_two(k, n):
        seen.append(n)
        if len(seen) == 2:
            raise Interrupted()

    with pytest.raises(Interrupted):
        prepare(cfg2, on_chunk=stop_after_two)
    committed = [f for f in paths2.fs.find(paths2.conversations) if "/answers-" in f]
    assert len(committed) == 2 and not paths2.fs.exists(f"{paths2.conversations}/manifest.json")
    redone = []
    s2 = prepare(cfg2, on_chunk=lambda k, n: redone.append(n))
    assert s2.samples == 6 and sum(redone) == 2  # 4 answers were committed before the interruption
