"""Bad input, record by record (../shared/REVIEW-reliability.md, rows B2-B5, B10, B14): each bad record is counted
with a reason that says what is wrong, and the good records beside it are kept; a bad file is named with its line."""

from __future__ import annotations

import json

import pytest

from eagle3ray import storage
from eagle3ray.chat import ChatTemplateError, tokenize_conversation
from eagle3ray.sources import Record, Rejected, read_chat, read_mtbench, read_sharegpt


def _split(items):
    items = list(items)
    return [i for i in items if isinstance(i, Record)], [i for i in items if isinstance(i, Rejected)]


def _conv(i: int, extra: str = "") -> dict:
    return {"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}{extra}"},
                                        {"role": "assistant", "content": f"a{i}"}]}


def test_a_chat_json_with_one_bad_utf8_record_keeps_the_others(tmp_path):
    good = [json.dumps(_conv(i)).encode() for i in range(3)]
    bad = json.dumps(_conv(9, "BAD")).encode().replace(b"BAD", b"caf\xe9")
    p = tmp_path / "chat.json"
    p.write_bytes(b"[" + b",".join([good[0], bad, good[1], good[2]]) + b"]")
    kept, rej = _split(read_chat(p))
    assert [r.sample_id for r in kept] == ["chat:r0", "chat:r1", "chat:r2"]
    assert [(r.reason, r.where) for r in rej] == [("invalid_utf8", f"{p}#record1")]


def test_a_sharegpt_file_with_a_bad_byte_rejects_only_that_record_and_keeps_no_replacement_chars(tmp_path):
    recs = [{"id": f"s{i}", "conversations": [{"from": "human", "value": f"q{i}" + ("BAD" if i == 1 else "")},
                                              {"from": "gpt", "value": f"a{i}"}]} for i in range(3)]
    p = tmp_path / "sg.json"
    p.write_bytes(json.dumps(recs).encode().replace(b"BAD", b"caf\xe9"))
    kept, rej = _split(read_sharegpt(p))
    assert [r.sample_id for r in kept] == ["sharegpt:s0", "sharegpt:s2"]
    assert all("\ufffd" not in m["content"] for r in kept for m in r.messages)
    assert [r.reason for r in rej] == ["invalid_utf8"] and rej[0].where.endswith("#record1")


def test_odd_conversations_get_reasons_that_say_what_is_wrong(tmp_path):
    p = tmp_path / "odd.jsonl"
    rows = [{"id": "str", "messages": "hello"},
            {"id": "sys", "messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]},
            {"id": "tool", "messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "{}"},
                                        {"role": "assistant", "content": "a"}]},
            {"id": "null", "messages": [{"role": "user", "content": None}]},
            _conv(0)]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kept, rej = _split(read_chat(p))
    assert [r.sample_id for r in kept] == ["chat:r0"]
    got = {r.where.split(" ")[0].rsplit(":", 1)[1]: (r.reason, r.detail) for r in rej}
    assert got["1"] == ("bad_message", "not a list of turns but str")
    assert got["2"] == ("no_user_turn", "no user turn")  # was kept, then every such record a 'duplicate'
    assert got["3"][0] == "bad_message" and got["3"][1].startswith("turn 1: unsupported role 'tool'")
    assert got["4"] == ("bad_message", "turn 0: content missing or not a string")


class _RaisingTemplate:
    """A tokenizer whose chat template raises on two user turns in a row (as Mistral's and Gemma's do)."""

    def apply_chat_template(self, messages, **kw):
        from jinja2 import Environment

        tpl = Environment().from_string(
            "{% for m in messages %}{% if loop.index0 > 0 and m.role == messages[loop.index0 - 1].role %}"
            "{{ raise_exception('roles must alternate') }}{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}")

        def raise_exception(msg):
            from jinja2.exceptions import TemplateError

            raise TemplateError(msg)

        text = tpl.render(messages=messages, raise_exception=raise_exception)
        return list(text.encode()) if kw.get("tokenize") else text


def test_a_template_that_refuses_a_conversation_raises_a_countable_error_naming_the_roles():
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]
    with pytest.raises(ChatTemplateError, match=r"roles user, user.*roles must alternate"):
        tokenize_conversation(_RaisingTemplate(), msgs)
    from eagle3ray.prepare import _prompt_ids

    with pytest.raises(ChatTemplateError):
        _prompt_ids(_RaisingTemplate(), msgs[:2])


def test_prepare_counts_a_conversation_its_template_refuses_and_keeps_the_others(tmp_path, tiny_verifier, make_cfg):
    """B5 through prepare: a verifier whose chat template raises (raise_exception) for one conversation; that record
    is counted as chat_template with its file and record, and every other conversation is prepared."""
    import shutil

    from eagle3ray.prepare import prepare

    model = tmp_path / "refusing-verifier"
    shutil.copytree(tiny_verifier, model)
    guard = ("{%- for m in messages %}{%- if 'REFUSE' in m['content'] %}"
             "{{ raise_exception('this template refuses REFUSE') }}{%- endif %}{%- endfor %}")
    jinja = model / "chat_template.jinja"
    if jinja.exists():
        jinja.write_text(guard + jinja.read_text())
    tok_cfg = json.loads((model / "tokenizer_config.json").read_text())
    if "chat_template" in tok_cfg:
        tok_cfg["chat_template"] = guard + tok_cfg["chat_template"]
        (model / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    src = tmp_path / "chat.jsonl"
    convs = [[{"role": "user", "content": f"question {i}" + (" REFUSE" if i == 2 else "")},
              {"role": "assistant", "content": f"answer {i}"}] for i in range(4)]
    src.write_text("\n".join(json.dumps({"messages": m}) for m in convs) + "\n")
    s = prepare(make_cfg([src], f"verifier.model={model}"))
    assert s.samples == 3 and s.rejected.counts == {"chat_template": 1}, s.rejected.to_json()
    (example,) = s.rejected.examples["chat_template"]
    assert "chat.jsonl:3" in example and "this template refuses REFUSE" in example  # file and line


def test_a_verifier_path_that_does_not_exist_is_named_without_a_hub_lookup(tmp_path):
    from eagle3ray.verifier_source import VerifierSourceError, resolve_verifier

    for bad in ("/nonexistent/dir", str(tmp_path / "missing"), "./models/x", "a/b/c"):
        with pytest.raises(VerifierSourceError, match="does not exist"):
            resolve_verifier(bad)
    assert resolve_verifier("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_a_malformed_mtbench_line_and_a_corrupt_manifest_are_named_with_their_path(tmp_path):
    q = tmp_path / "question.jsonl"
    q.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["a"]}) + "\n{not json\n")
    with pytest.raises(ValueError, match=rf"{q}:2: not a JSON object"):
        read_mtbench(q)
    fs, root = storage.filesystem(f"file://{tmp_path}")
    fs.pipe_file(f"{root}/manifest.json", b'{"blocks": [')
    with pytest.raises(json.JSONDecodeError, match=rf"{root}/manifest.json: not valid JSON"):
        storage.read_json(fs, f"{root}/manifest.json")


def test_the_export_check_reports_truncated_weights_and_a_broken_config_instead_of_a_traceback(tmp_path, tiny_verifier):
    import torch

    from eagle3ray.config import load_config
    from eagle3ray.draft import build_draft
    from eagle3ray.draft_check import check_draft

    d2t, t2d = torch.zeros(512, dtype=torch.long), torch.zeros(49152, dtype=torch.bool)
    t2d[:512] = True
    tc = load_config(None, ["vocab.draft_vocab_size=512", "train.optimizer=muon"]).train.model_dump()
    out = tmp_path / "export"
    build_draft(tiny_verifier, [2, 4, 5], d2t, t2d, tc).save_pretrained(out)
    assert check_draft(str(out), tiny_verifier).ok
    weights = next(out.glob("*.safetensors"))
    whole = weights.read_bytes()
    for cut, why in ((4, "truncated"), (len(whole) - 100, "truncated"), (20, "truncated or not safetensors")):
        weights.write_bytes(whole[:cut])
        rep = check_draft(str(out), tiny_verifier)
        assert not rep.ok and any(why in p and str(weights) in p for p in rep.problems), (cut, rep.problems)
    weights.write_bytes(whole)
    cfg = out / "config.json"
    cfg.write_text(cfg.read_text()[:40])
    rep = check_draft(str(out), tiny_verifier)
    assert not rep.ok and "config.json: not valid JSON" in rep.problems[0]


def test_a_huge_jsonl_line_is_rejected_unread_and_the_next_lines_are_kept(tmp_path):
    import tracemalloc

    p = tmp_path / "huge.jsonl"
    with open(p, "wb") as f:
        f.write((json.dumps(_conv(0)) + "\n").encode())
        f.write(b'{"id": "big", "messages": "' + b"x" * (64 << 20) + b'"}\n')  # 64 MiB on one line
        f.write((json.dumps(_conv(2)) + "\n").encode())
    tracemalloc.start()
    kept, rej = _split(read_chat(p, max_line_bytes=1_000_000))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [r.sample_id for r in kept] == ["chat:r0", "chat:r2"]
    assert [(r.reason, r.where) for r in rej] == [("line_too_long", f"{p}:2")]
    assert peak < 16 << 20  # the 64 MiB line was never held whole
