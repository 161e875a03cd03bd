"""Render a conversation with the verifier's own chat template and mark the assistant tokens.

``loss_mask[t] = 1`` exactly for the tokens of every assistant answer, including the template's
end-of-turn token that closes it (the draft must learn to predict it), and 0 for system/user text,
role headers and the whitespace after an end-of-turn token.

Method: the character span of assistant turn ``i`` is the difference between the rendering of
``messages[:i]`` with the generation prompt and the rendering of ``messages[:i+1]`` (both must be
prefixes of the full rendering, which holds for ChatML, Llama-3 and most templates; a template
that rewrites earlier turns is reported, not guessed). Tokens whose character offsets fall inside a
span are masked in. This works for any tokenizer with offset mapping, without ``{% generation %}``
tags in the template.
"""

from __future__ import annotations

import hashlib


class ChatTemplateError(ValueError):
    """The chat template cannot be used to locate assistant turns."""


def _render(tokenizer, messages, add_generation_prompt: bool) -> str:
    """The chat template's text for ``messages``.

    Raises:
        ChatTemplateError: the template refused the conversation (jinja2 ``TemplateError``, e.g. its
            ``raise_exception("roles must alternate")``).
    """
    return render_checked(tokenizer, messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def render_checked(tokenizer, messages, **kw):
    """``tokenizer.apply_chat_template(messages, **kw)``, with a template's own refusal raised as
    :class:`ChatTemplateError` (its message), so that the caller counts the record instead of failing the stage."""
    from jinja2.exceptions import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, **kw)
    except TemplateError as e:
        roles = ", ".join(m.get("role", "?") for m in messages)
        raise ChatTemplateError(f"chat template refused the conversation (roles {roles}): {e}") from None


def assistant_spans(tokenizer, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """Full rendered text and the [start, end) character spans of each assistant answer.

    Raises:
        ChatTemplateError: the template is not prefix-stable for this conversation.
    """
    full = _render(tokenizer, messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True) if i else ""
        upto = _render(tokenizer, messages[: i + 1], False)
        if not full.startswith(before) or not full.startswith(upto) or len(upto) < len(before):
            raise ChatTemplateError(
                f"chat template is not prefix-stable at turn {i}: rendering the first {i} turns is not a "
                "prefix of the whole conversation"
            )
        end = len(upto.rstrip())  # keep the end-of-turn token, drop the newline after it
        spans.append((len(before), end))
    return full, spans


def tokenize_conversation(tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of a conversation rendered with the tokenizer's chat template.

    Returns:
        (input_ids [T], loss_mask [T] with 1 on assistant-answer tokens).

    Raises:
        ChatTemplateError: see :func:`assistant_spans`.
    """
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    mask = [0] * len(ids)
    si = 0
    for t, (a, b) in enumerate(enc["offset_mapping"]):
        if b <= a:
            continue
        while si < len(spans) and spans[si][1] <= a:
            si += 1
        if si < len(spans) and a >= spans[si][0] and b <= spans[si][1]:
            mask[t] = 1
    return ids, mask


def tokenizer_identity(tokenizer) -> dict[str, str]:
    """Hashes (sha256, 16 hex) of the tokenizer vocabulary and the chat template."""
    vocab = sorted(tokenizer.get_vocab().items())
    template = tokenizer.chat_template or ""
    return {
        "tokenizer_hash": hashlib.sha256(repr(vocab).encode()).hexdigest()[:16],
        "chat_template_hash": hashlib.sha256(template.encode()).hexdigest()[:16],
    }
