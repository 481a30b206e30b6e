"""Token categories: what kind of token a drafted or target token is (special, whitespace, number, code, word
start ...), read from the tokenizer's own token strings.

Its own module because it is the one part of the deviation analysis that needs a tokenizer: the replay
calls :class:`TokenCategories` when it writes a run (the ``target_category`` / ``draft_category`` columns),
and every later view reads the recorded column, loading no tokenizer.
"""

from __future__ import annotations

import keyword
import re
import unicodedata
from typing import Any

CATEGORIES: dict[str, str] = {
    "special": "special and chat-template tokens (the tokenizer's special / added special tokens)",
    "whitespace": "spaces, newlines and indentation",
    "number": "digits and numbers",
    "punctuation": "punctuation and symbols",
    "code": "code identifiers and keywords",
    "word_start": "natural-language word starts",
    "word_continuation": "word continuations (sub-word pieces)",
    "other": "anything else (byte pieces, mixed scripts, emoji)",
}
UNCATEGORISED = "uncategorised"  # runs recorded before target_category existed

# Byte-level BPE (GPT-2, Llama-3, Qwen, SmolLM) writes a leading space as "Ġ", SentencePiece (Llama-2,
# Gemma, Mistral) as "▁": a piece starting with one begins a word whatever the language.
WORD_START_MARKERS = ("Ġ", "▁")
# Keywords and builtins of common programming languages that are not also everyday English words ("for",
# "if", "return", "class" are left out: in prose they are words). Identifiers are mostly recognised by
# their shape (snake_case, camelCase, dunder, letters mixed with digits), which needs no list.
CODE_WORDS = frozenset(
    {
        w
        for w in keyword.kwlist
        if w
        not in {
            "and",
            "as",
            "for",
            "if",
            "in",
            "is",
            "not",
            "or",
            "with",
            "while",
            "from",
            "try",
            "pass",
            "break",
            "continue",
            "class",
            "return",
            "import",
            "global",
            "else",
            "raise",
            "yield",
            "del",
        }
    }
    | {
        "self",
        "cls",
        "args",
        "kwargs",
        "len",
        "enumerate",
        "isinstance",
        "dict",
        "str",
        "int",
        "bool",
        "tuple",
        "const",
        "var",
        "let",
        "func",
        "fn",
        "void",
        "null",
        "nullptr",
        "undefined",
        "println",
        "printf",
        "std",
        "struct",
        "typedef",
        "namespace",
        "elif",
        "endif",
        "ifdef",
        "bool",
        "usize",
        "u8",
        "i32",
        "def",
    }
)
_CODE_SHAPE = re.compile(
    r"^(?=\w*_)(?=\w*[A-Za-z])\w+$"  # an underscore among word characters: snake_case, _private, __dunder__
    r"|^[a-z]{2,}[A-Z][a-z]\w*$"  # camelCase
    r"|^[A-Za-z]+\d+\w*$"  # letters then digits: x1, int32, utf8
)
_WORD_INNER = "'\u2019-"  # apostrophes and hyphens inside words ("'ve", "don't", "well-")


def categorize(piece: str, text: str, special: bool) -> str:
    """Category of one token (a key of :data:`CATEGORIES`). Pure, so it is tested on hand-written strings.

    Args:
        piece: the tokenizer's piece for the token (``convert_ids_to_tokens``), whose word-start marker
            (``Ġ``, ``▁``) tells a word start from a continuation.
        text: the token's decoded text.
        special: whether the tokenizer marks the token special.

    Returns:
        ``special``, ``whitespace``, ``number``, ``punctuation``, ``code``, ``word_start``,
        ``word_continuation`` or ``other``.
    """
    if special:
        return "special"
    stripped = text.strip()
    if not stripped:
        return "whitespace" if text else "other"
    if "\ufffd" in stripped:  # part of a multi-byte character: the piece is a raw byte, not a symbol
        return "other"
    kinds = {unicodedata.category(char)[0] for char in stripped}
    if any(char.isdigit() for char in stripped) and kinds <= {"N", "P"}:
        return "number"
    if kinds <= {"P", "S"}:
        return "punctuation"
    if stripped in CODE_WORDS or _CODE_SHAPE.match(stripped):
        return "code"
    if any(char.isalpha() for char in stripped) and all(
        char.isalpha() or char in _WORD_INNER or unicodedata.category(char) == "Mn" for char in stripped
    ):
        starts_word = piece.startswith(WORD_START_MARKERS) or text[:1].isspace()
        return "word_start" if starts_word else "word_continuation"
    return "other"


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids the tokenizer itself treats as special, so that chat-template markers such as ``<|im_start|>``
    (added special tokens in most chat models) count as special.

    Args:
        tokenizer: a transformers tokenizer (read through ``all_special_ids`` and ``added_tokens_decoder``;
            either may be missing).

    Returns:
        Its special tokens' ids and those of its added tokens flagged special.
    """
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return frozenset(int(i) for i in ids)


class TokenCategories:
    """Category of every token id of one tokenizer, memoised (a run touches a few thousand ids)."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._special = special_token_ids(tokenizer)
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        category = self._cache.get(token_id)
        if category is None:
            piece = self._tokenizer.convert_ids_to_tokens(int(token_id)) or ""
            text = self._tokenizer.decode([int(token_id)])
            category = categorize(piece, text, int(token_id) in self._special)
            self._cache[token_id] = category
        return category
