"""Validating what users hand us at the boundary, before any work: model folders and typed values.

A bad input must be refused in one sentence naming the input, the place and the fix (exit 2), never
by a traceback from deep inside transformers or safetensors, and never silently "repaired" (a layer id
of ``2.7`` truncated to ``2`` drafts from the wrong layer without a word). This module holds the checks
that do not belong to one reader:

* :func:`check_model_folder`: ``config.json`` is a JSON object whose keys the loaders read have the
  right types and ranges (:data:`MODEL_CONFIG_KEYS`, at any depth: ``dflash_config``, speculators'
  nested configs), and every ``.safetensors`` file is whole (its header parses and its data is as long
  as the header says: a truncated download fails here, not in the middle of loading);
* :func:`type_error`: one rule for "is this value of the declared type", shared by the config file and
  the check parameters.
"""

from __future__ import annotations

import json
import math
import struct
import types
import typing
from pathlib import Path
from typing import Any, Callable

from dflash_doctor.errors import UsageError


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _non_negative_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _layer_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_non_negative_int(v) for v in value)


def _layer_ids_or_none(value: Any) -> bool:
    return value == [] or _layer_ids(value)


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _object(value: Any) -> bool:
    return isinstance(value, dict)


def _list_of_objects(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, dict) for item in value)


#: Numeric settings of a RoPE scaling (transformers' ``rope_parameters`` / the older ``rope_scaling``).
ROPE_NUMBERS = (
    "rope_theta",
    "factor",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
    "mscale",
    "mscale_all_dim",
    "partial_rotary_factor",
)


def _rope_settings(value: Any) -> bool:
    """A RoPE table: its type a string, its numeric settings finite numbers; transformers 5 nests one table per
    layer type (``{"full_attention": {...}, "sliding_attention": {...}}``), each checked the same way."""
    if not isinstance(value, dict):
        return False
    if all(isinstance(item, dict) for item in value.values()) and value:
        return all(_rope_settings(item) for item in value.values())
    kinds_ok = all(isinstance(value[key], str) for key in ("rope_type", "type") if value.get(key) is not None)
    return kinds_ok and all(_finite_number(value[key]) for key in ROPE_NUMBERS if value.get(key) is not None)


#: Keys of a model's config.json that the loaders read, with the rule and what the fix asks for. A key
#: that is absent or null is left to the loader (it has defaults, or names the missing key itself).
MODEL_CONFIG_KEYS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "target_layer_ids": (_layer_ids, "a non-empty list of integer layer indices >= 0"),
    "aux_hidden_state_layer_ids": (_layer_ids, "a non-empty list of integer layer indices >= 0"),
    "block_size": (_positive_int, "an integer >= 1"),
    "num_target_layers": (_positive_int, "an integer >= 1"),
    "mask_token_id": (_non_negative_int, "an integer token id >= 0"),
    "hidden_size": (_positive_int, "an integer >= 1"),
    "intermediate_size": (_positive_int, "an integer >= 1"),
    "num_hidden_layers": (_positive_int, "an integer >= 1"),
    "num_attention_heads": (_positive_int, "an integer >= 1"),
    "num_key_value_heads": (_positive_int, "an integer >= 1"),
    "head_dim": (_positive_int, "an integer >= 1"),
    "vocab_size": (_positive_int, "an integer >= 1"),
    "draft_vocab_size": (_positive_int, "an integer >= 1"),
    "max_position_embeddings": (_positive_int, "an integer >= 1"),
    "rms_norm_eps": (_positive_number, "a positive number"),
    "rope_theta": (_positive_number, "a positive number"),
    "rope_parameters": (_rope_settings, "an object with a string rope_type and finite numbers for its factors"),
    "rope_scaling": (_rope_settings, "an object with a string rope_type and finite numbers for its factors"),
    "target_hidden_size": (_positive_int, "an integer >= 1"),
    "eagle_aux_hidden_state_layer_ids": (
        _layer_ids_or_none,
        "a list of integer layer indices >= 0 (empty: vLLM's default)",
    ),
    "speculative_tokens": (_positive_int, "an integer >= 1"),
    "speculators_config": (_object, "an object (algorithm, proposal_methods, verifier)"),
    "proposal_methods": (_list_of_objects, "a list of objects"),
    "verifier": (_object, "an object (name_or_path, architectures)"),
    "transformer_layer_config": (_object, "an object holding the decoder layer's settings"),
    "dflash_config": (_object, "an object"),
    "eagle_config": (_object, "an object"),
}


def check_config_keys(value: Any, where: Path | str, path: str = "") -> None:
    """Apply :data:`MODEL_CONFIG_KEYS` to every object in ``value``, at any depth (``where`` names the file)."""
    if isinstance(value, dict):
        for key, item in value.items():
            rule = MODEL_CONFIG_KEYS.get(key)
            if rule is not None and item is not None and not rule[0](item):
                shown = json.dumps(item)
                shown = shown if len(shown) <= 80 else shown[:77] + "..."
                raise UsageError(f"{where}: `{path}{key}` is {shown}, but it must be {rule[1]}; fix the value.")
            check_config_keys(item, where, f"{path}{key}.")
    elif isinstance(value, list):
        for item in value:
            check_config_keys(item, where, path)


def read_config_json(model_dir: Path) -> dict[str, Any]:
    """A model folder's config.json, refused in one sentence unless it is a JSON object with well-typed keys."""
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not UTF-8 text; restore the model's config.json.") from None
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); fix the file or download it again."
        ) from None
    if not isinstance(config, dict):
        raise UsageError(
            f"{path} holds a JSON {type(config).__name__}, not an "
            "object of model settings; restore the model's config.json."
        )
    check_config_keys(config, path)
    return config


#: safetensors dtype name -> bytes per element: the dtypes the safetensors library reads into torch tensors.
SAFETENSORS_DTYPES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2": 1,
    "F8_E5M2FNUZ": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}


def _tensor_entry_lie(name: str, entry: Any) -> str | None:
    """What is wrong with one tensor's header entry on its own (None when its dtype, shape and offsets agree)."""
    if not isinstance(entry, dict):
        return f"tensor {name!r} has a header entry that is a JSON {type(entry).__name__}, not an object"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in SAFETENSORS_DTYPES:
        return f"tensor {name!r} has dtype {json.dumps(dtype)}, not one of {', '.join(SAFETENSORS_DTYPES)}"
    if not isinstance(shape, list) or not all(_non_negative_int(n) and n < 2**63 for n in shape):
        return f"tensor {name!r} has shape {json.dumps(shape)}, not a list of integers >= 0"
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_non_negative_int(n) for n in offsets)
        and offsets[0] <= offsets[1]
    ):
        return f"tensor {name!r} has data_offsets {json.dumps(offsets)}, not two integers 0 <= begin <= end"
    needed = math.prod(shape) * SAFETENSORS_DTYPES[dtype]
    if offsets[1] - offsets[0] != needed:
        return f"tensor {name!r} spans {offsets[1] - offsets[0]} bytes but its shape {shape} of {dtype} needs {needed}"
    return None


def safetensors_header(path: Path) -> dict[str, Any]:
    """The header of a safetensors file (8 bytes of header length, the JSON header, then the tensors' bytes),
    read without the weights and checked against the file as the safetensors library checks it, so that a
    lying header is refused here in one sentence instead of inside a loader: ``__metadata__`` maps strings
    to strings; each tensor has a known dtype, a shape of integers >= 0 and data offsets that span exactly
    its bytes; and the tensors, in offset order, cover the data without a gap or an overlap up to its last
    byte (a short file is an interrupted download)."""
    size = path.stat().st_size
    fix = "download or copy the file again"
    with path.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise UsageError(f"weights file {path} is {size} bytes, too short to be safetensors; {fix}.")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise UsageError(
                f"weights file {path} is truncated or not safetensors (its header claims {header_len} bytes of "
                f"a {size}-byte file); {fix}."
            )
        raw = handle.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UsageError(
            f"weights file {path} has a header that is not JSON, so it is not safetensors; {fix}."
        ) from None
    if not isinstance(header, dict) or raw[:1] != b"{":  # the safetensors library reads nothing before the brace
        raise UsageError(
            f"weights file {path} has a header that is not a JSON object, so it is not safetensors; {fix}."
        )
    metadata = header.get("__metadata__", {})
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise UsageError(f"weights file {path} has a __metadata__ that is not an object of strings; {fix}.")
    tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
    for name, entry in tensors.items():
        lie = _tensor_entry_lie(name, entry)
        if lie is not None:
            raise UsageError(f"weights file {path}: {lie}, so its header lies about its data; {fix}.")
    data_size = size - 8 - header_len
    covered = 0
    for name, entry in sorted(tensors.items(), key=lambda item: tuple(item[1]["data_offsets"])):
        begin, end = entry["data_offsets"]
        if begin != covered:
            what = "overlaps the tensor before it" if begin < covered else f"leaves bytes {covered}..{begin} unused"
            raise UsageError(
                f"weights file {path}: tensor {name!r} starts at byte {begin} of the data and {what}, so its "
                f"header lies about its data; {fix}."
            )
        covered = end
    if covered != data_size:
        state = (
            f"truncated ({data_size} bytes of data, its header needs {covered})"
            if covered > data_size
            else f"longer than its header says ({data_size} bytes of data, its tensors cover {covered})"
        )
        raise UsageError(f"weights file {path} is {state}; {fix}.")
    return header


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape of a safetensors file, from its checked header alone."""
    return {name: entry["shape"] for name, entry in safetensors_header(path).items() if name != "__metadata__"}


def check_model_folder(model_dir: Path) -> dict[str, Any]:
    """Refuse a model folder whose config.json or safetensors weights are broken (see the module doc);
    returns the config."""
    config = read_config_json(model_dir)
    check_tokenizer_json(model_dir / "tokenizer.json")
    for weights in sorted(model_dir.glob("*.safetensors")):
        safetensors_header(weights)
    return config


#: The JSON files of a tokenizer that the tokenizers library parses (it raises a bare Exception on bad JSON).
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def check_tokenizer_json(path: Path) -> None:
    """Refuse a tokenizer file that is not a JSON object (truncated download, an HTML error page saved
    under its name) in one sentence; a missing file is left to the loader."""
    if not path.is_file():
        return
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        detail = " ".join(str(exc).split())[:120]
        raise UsageError(
            f"{path} is not valid JSON ({detail}); download the tokenizer again (e.g. hf download ORG/NAME)."
        ) from None
    if not isinstance(document, dict):
        raise UsageError(
            f"{path} holds a JSON {type(document).__name__}, not a tokenizer object; download the tokenizer again."
        )


# ----------------------------------------------------------------------------------------------------
# Declared types


def _matches(value: Any, expected: Any) -> bool:
    """Whether ``value`` fits the type annotation ``expected`` (the forms our dataclasses use: plain
    classes, ``X | None``, ``tuple[X, ...]``, ``list[X]``, ``dict[K, V]``, ``Any``). An int is a float
    (TOML writes ``1`` for 1.0); a bool is not an int."""
    if expected is Any:
        return True
    origin = typing.get_origin(expected)
    args = typing.get_args(expected)
    if origin in (types.UnionType, typing.Union):
        return any(_matches(value, arg) for arg in args)
    if expected is type(None):
        return value is None
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (tuple, list):
        return (
            isinstance(value, (tuple, list)) and all(_matches(v, args[0]) for v in value)
            if args
            else isinstance(value, (tuple, list))
        )
    if origin is dict:
        return isinstance(value, dict) and all(_matches(k, args[0]) and _matches(v, args[1]) for k, v in value.items())
    return isinstance(value, expected)


def _describe(expected: Any) -> str:
    """A type annotation in words for the fix: ``a number``, ``a string or nothing``..."""
    names = {str: "a string", int: "an integer", float: "a number", bool: "true or false", type(None): "nothing"}
    if typing.get_origin(expected) in (types.UnionType, typing.Union):
        return " or ".join(_describe(arg) for arg in typing.get_args(expected) if arg is not type(None))
    if typing.get_origin(expected) in (tuple, list):
        return f"a list of {_describe(typing.get_args(expected)[0]).removeprefix('a ').removeprefix('an ')}s"
    if typing.get_origin(expected) is dict:
        return "a table"
    return names.get(expected, getattr(expected, "__name__", str(expected)))


def type_error(value: Any, expected: Any) -> str | None:
    """None when ``value`` fits ``expected``, else what it must be (``a number``...) for the refusal."""
    return None if _matches(value, expected) else _describe(expected)


def finite_number(
    value: Any,
    name: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
    integer: bool = False,
    fix: str = "fix the value",
) -> float:
    """A number a user handed over (flag, config file, environment), refused unless finite and in range.

    The one rule for thresholds, floors, durations and baselines: ``nan`` compares false with everything,
    so ``nan >= 0`` passes a plain range check and then every ``drop > threshold`` is false too (a gate
    that never fires); ``inf`` does the same from the other side. ``minimum``/``maximum`` are inclusive,
    ``above`` exclusive; ``integer`` also refuses 2.5 (never truncated). Strings of a number are read
    (flags and TOML strings); booleans are not numbers. The sentence names ``name`` and ends with ``fix``."""
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value) if not isinstance(value, int) else value
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    bounds = [
        b
        for b in (
            f">= {minimum:g}" if minimum is not None else "",
            f"> {above:g}" if above is not None else "",
            f"<= {maximum:g}" if maximum is not None else "",
        )
        if b
    ]
    wanted = ("a finite integer" if integer else "a finite number") + (" " + " and ".join(bounds) if bounds else "")
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    refused = UsageError(f"{name} {shown} is not {wanted}; {fix}.")
    if number is None:
        raise refused
    try:
        if not math.isfinite(number):
            raise refused
    except OverflowError:  # an int too large for a float
        raise refused from None
    if integer and (isinstance(number, float) and not number.is_integer()):
        raise refused
    if (
        (minimum is not None and number < minimum)
        or (above is not None and number <= above)
        or (maximum is not None and number > maximum)
    ):
        raise refused
    return int(number) if integer else float(number)
