"""Turn the single-check commands' arguments into tokenizers, chat templates and configs, without weights.

An argument is a model or tokenizer directory, a ``tokenizer.json``, a ``.gguf`` file (its embedded
tokenizer and template) or, for templates, a ``.jinja`` file. Nothing is downloaded and no repository
code runs (``trust_remote_code`` stays off: a config is data, never code).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.validation import TOKENIZER_JSON_FILES, check_tokenizer_json

TEMPLATE_SUFFIXES = (".jinja", ".j2")
#: what a folder name made from an input may hold: anything else (a separator, a control character) becomes ``-``
_UNSAFE_IN_NAME = re.compile(r"[^A-Za-z0-9._@+-]")


def safe_folder_name(text: str, fallback: str = "draft") -> str:
    """``text`` as one folder name that stays inside its parent: characters other than letters, digits and
    ``._@+-`` become ``-``, and a name of dots only (``.``, ``..``) or nothing is ``fallback``. A head-to-head
    names each contender's sub-run from its ``--draft``, so ``--draft x/..`` must never name ``..``."""
    name = _UNSAFE_IN_NAME.sub("-", text)
    return fallback if not name.strip(".") else name


def _existing(spec: str, role: str) -> Path:
    path = Path(spec).expanduser()
    if not path.exists():
        raise UsageError(
            f"{role} {spec} does not exist; pass a model dir, a "
            "tokenizer dir, a tokenizer.json, a .gguf or a .jinja file."
        )
    return path


def load_tokenizer_spec(spec: str, role: str = "tokenizer") -> Any:
    """A transformers tokenizer from a dir, a tokenizer.json (with its sibling files) or a .gguf file."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = _existing(spec, role)
    if path.suffix in TEMPLATE_SUFFIXES:
        raise UsageError(
            f"{role} {spec} is a chat template, not a tokenizer; pass a model dir, a tokenizer dir or a tokenizer.json."
        )
    folder = path if path.is_dir() else path.parent
    for name in TOKENIZER_JSON_FILES:  # the tokenizers library answers bad JSON with a bare Exception
        check_tokenizer_json(path if path.is_file() and path.name == name else folder / name)
    if path.is_file() and path.suffix == ".json":
        check_tokenizer_json(path)
    try:
        if path.suffix == ".gguf":
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        if path.is_file() and (path.parent / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(str(path.parent), local_files_only=True)
        if path.is_file():
            return PreTrainedTokenizerFast(tokenizer_file=str(path))
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
        raise UsageError(
            f"{role} {spec} could not be loaded as a tokenizer "
            f"({str(exc).splitlines()[0]}); pass a folder with tokenizer.json."
        ) from None


def load_template_spec(spec: str, role: str = "template") -> tuple[str, Any]:
    """(chat template text, its tokenizer or None) from a .jinja file or anything :func:`load_tokenizer_spec` reads."""
    path = _existing(spec, role)
    if path.suffix in TEMPLATE_SUFFIXES:
        return path.read_text(encoding="utf-8"), None
    tokenizer = load_tokenizer_spec(spec, role)
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"{role} {spec} has no chat template; pass a .jinja file or a tokenizer folder with one.")
    return tokenizer.chat_template, tokenizer


def load_config_json(spec: str | None) -> dict[str, Any] | None:
    """The ``config.json`` next to a model argument, when there is one (None for bare tokenizers)."""
    if spec is None:
        return None
    path = Path(spec).expanduser()
    folder = path if path.is_dir() else path.parent
    config_path = folder / "config.json"
    if not config_path.is_file():
        return None
    try:
        return json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UsageError(f"{config_path} is not valid JSON ({exc}); fix the file.") from None
