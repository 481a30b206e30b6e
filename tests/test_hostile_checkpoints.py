"""Hostile checkpoints: every lying safetensors header, EAGLE-3 config, GGUF draft and config that no longer matches
its weights is refused in one sentence naming the file (UsageError, exit 2), never crashes a loader, never
allocates what the config claims before the weights confirm it, and is never repaired silently.

Each row changes one thing of the shipped demo EAGLE-3 head or of the tiny in-process models; a seeded fuzz loop
mutates safetensors headers and asserts each mutation is either refused or loads."""

from __future__ import annotations

import copy
import json
import random
import shutil
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from cli_helpers import assert_usage_error, invoke
from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.validation import SAFETENSORS_DTYPES, check_model_folder, safetensors_header
from dflash_doctor.models.eagle3_format import load_eagle3_head
from dflash_doctor.models.gguf_draft import read_gguf_draft
from dflash_doctor.models.loading import DEMO_EAGLE3_DIR, load_causal_lm, load_dflash_draft
from tiny_models import tiny_target

#: The demo head's target (SmolLM2-135M) as far as the head's loader reads it.
TARGET = LlamaConfig(
    hidden_size=576,
    num_hidden_layers=30,
    vocab_size=49152,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
)


def split(raw: bytes) -> tuple[dict, bytes]:
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def join(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def head_copy(tmp_path: Path, *, config=None, header=None, tensors=None) -> Path:
    """The demo head in ``tmp_path/head`` with ``config(cfg)``, ``header(h)`` (its data unchanged) or
    ``tensors(state)`` applied in place."""
    out = tmp_path / "head"
    shutil.copytree(DEMO_EAGLE3_DIR, out)
    weights = out / "model.safetensors"
    if config is not None:
        cfg = json.loads((out / "config.json").read_text())
        config(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    if header is not None:
        head, data = split(weights.read_bytes())
        header(head)
        weights.write_bytes(join(head, data))
    if tensors is not None:
        state = load_file(weights)
        tensors(state)
        save_file(state, weights)
    return out


def _ordered(header: dict) -> list[str]:
    return sorted((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][0])


def _overlap_previous(header: dict) -> None:
    """The tensor after d2t starts 8 bytes into d2t (its length kept)."""
    names = _ordered(header)
    after = names[names.index("d2t") + 1] if names.index("d2t") + 1 < len(names) else names[names.index("d2t") - 1]
    begin, end = header[after]["data_offsets"]
    header[after]["data_offsets"] = [begin - 8, end - 8]


def _set(mapping: dict, path: str, value) -> None:
    keys = path.split(".")
    for key in keys[:-1]:
        mapping = mapping[key]
    mapping[keys[-1]] = value


HEADER_LIES = [  # B1-B8
    ("B1 norm shape 100x", lambda h: h["norm.weight"].update(shape=[57600]), "tensor 'norm.weight' spans"),
    (
        "B2 offsets reversed",
        lambda h: h["norm.weight"].update(data_offsets=h["norm.weight"]["data_offsets"][::-1]),
        "tensor 'norm.weight' has data_offsets",
    ),
    ("B3 dtype Q99", lambda h: h["norm.weight"].update(dtype="Q99"), "tensor 'norm.weight' has dtype \"Q99\""),
    ("B4 offsets overlap d2t", _overlap_previous, "overlaps the tensor before it"),
    ("B5 shape -1", lambda h: h["fc.weight"].update(shape=[-1, 576]), "tensor 'fc.weight' has shape [-1, 576]"),
    ("B6 shape string", lambda h: h["norm.weight"].update(shape=["576"]), "tensor 'norm.weight' has shape [\"576\"]"),
    (
        "B7 offset -8",
        lambda h: h["d2t"].update(data_offsets=[-8, h["d2t"]["data_offsets"][1]]),
        "tensor 'd2t' has data_offsets [-8",
    ),
    (
        "B8 metadata list",
        lambda h: h.update(__metadata__=["format", "pt"]),
        "__metadata__ that is not an object of strings",
    ),
    ("gap: a tensor dropped", lambda h: h.pop("norm.weight"), "unused"),
]


@pytest.mark.parametrize("name, lie, fragment", HEADER_LIES, ids=[row[0] for row in HEADER_LIES])
def test_a_lying_safetensors_header_is_refused_before_any_loader(tmp_path, name, lie, fragment):
    head = head_copy(tmp_path, header=lie)
    with pytest.raises(UsageError) as refused:
        check_model_folder(head)
    message = refused.value.message
    assert str(head / "model.safetensors") in message and fragment in message, message
    assert message.endswith("download or copy the file again."), message


CONFIG_LIES = [  # B9-B18
    ("B9 target_hidden_size 576x", lambda c: _set(c, "target_hidden_size", "576x"), '`target_hidden_size` is "576x"'),
    (
        "B10 layer ids strings",
        lambda c: _set(c, "eagle_aux_hidden_state_layer_ids", ["8", "x", "24"]),
        '`eagle_aux_hidden_state_layer_ids` is ["8", "x", "24"]',
    ),
    (
        "B11 layer ids a dict",
        lambda c: _set(c, "eagle_aux_hidden_state_layer_ids", {"a": 1}),
        "`eagle_aux_hidden_state_layer_ids` is {",
    ),
    (
        "B12 speculative_tokens seven",
        lambda c: _set(c["speculators_config"]["proposal_methods"][0], "speculative_tokens", "seven"),
        '`speculators_config.proposal_methods.speculative_tokens` is "seven"',
    ),
    ("B13 speculators_config a list", lambda c: _set(c, "speculators_config", [1]), "`speculators_config` is [1]"),
    (
        "B15 rope factor abc",
        lambda c: _set(c, "transformer_layer_config.rope_parameters", {"rope_type": "yarn", "factor": "abc"}),
        "`transformer_layer_config.rope_parameters` is",
    ),
    (
        "B18 layer id 8.5",
        lambda c: _set(c, "eagle_aux_hidden_state_layer_ids", [8.5, 16, 24]),
        "`eagle_aux_hidden_state_layer_ids` is [8.5, 16, 24]",
    ),
]


@pytest.mark.parametrize("name, lie, fragment", CONFIG_LIES, ids=[row[0] for row in CONFIG_LIES])
def test_an_eagle3_config_value_of_the_wrong_type_is_refused_naming_the_key(tmp_path, name, lie, fragment):
    head = head_copy(tmp_path, config=lie)
    for read in (check_model_folder, lambda folder: load_eagle3_head(folder, TARGET)):
        with pytest.raises(UsageError) as refused:
            read(head)
        assert str(head / "config.json") in refused.value.message and fragment in refused.value.message, (
            refused.value.message
        )


HEAD_LIES = [  # the loader's own checks: B14, B16-B17 (sizes confirmed by the weights before any allocation), B19-B20
    (
        "B14 heads do not divide",
        {"config": lambda c: _set(c, "transformer_layer_config.num_attention_heads", 7)},
        "not a multiple of the number of attention heads (7)",
    ),
    (
        "B16 intermediate_size 1e8",
        {"config": lambda c: _set(c, "transformer_layer_config.intermediate_size", 10**8)},
        "has shape [1536, 576] where the config implies [100000000, 576]",
    ),
    (
        "B17 draft_vocab_size 1e11",
        {"config": lambda c: _set(c, "draft_vocab_size", 10**11)},
        "lm_head.weight has shape [8192, 576] where the config implies [100000000000, 576]",
    ),
    (
        "B19 d2t 2-D",
        {"tensors": lambda s: s.update(d2t=s["d2t"].reshape(64, 128))},
        "d2t is a 2-D int64 tensor of shape [64, 128]",
    ),
    ("B20 d2t float", {"tensors": lambda s: s.update(d2t=s["d2t"].double() + 0.5)}, "d2t is a 1-D float64 tensor"),
    (
        "weights of an integer dtype",
        {"tensors": lambda s: s.update({"norm.weight": s["norm.weight"].int()})},
        "norm.weight holds int32 values",
    ),
]


@pytest.mark.parametrize("name, change, fragment", HEAD_LIES, ids=[row[0] for row in HEAD_LIES])
def test_an_eagle3_head_whose_config_lies_is_refused_before_allocating(tmp_path, name, change, fragment):
    head = head_copy(tmp_path, **change)
    with pytest.raises(UsageError) as refused:
        load_eagle3_head(head, TARGET)
    assert str(head / "config.json") in refused.value.message and fragment in refused.value.message, (
        refused.value.message
    )


def test_the_unchanged_demo_head_loads_with_real_weights(tmp_path):
    head = load_eagle3_head(head_copy(tmp_path), TARGET)
    assert not any(t.is_meta for t in [*head.parameters(), *head.buffers(), head.inv_freq])
    assert torch.equal(head.d2t, load_file(DEMO_EAGLE3_DIR / "model.safetensors")["d2t"].long())
    assert torch.equal(head.fc.weight, load_file(DEMO_EAGLE3_DIR / "model.safetensors")["fc.weight"].float())


@pytest.mark.parametrize(
    "name, change, fragment",
    [
        ("B1", {"header": HEADER_LIES[0][1]}, "tensor 'norm.weight' spans"),
        ("B9", {"config": CONFIG_LIES[0][1]}, '`target_hidden_size` is "576x"'),
        ("B18", {"config": CONFIG_LIES[-1][1]}, "[8.5, 16, 24]"),
    ],
)
def test_the_cli_refuses_a_hostile_head_with_exit_2(tiny_dir, tmp_path, name, change, fragment):
    head = head_copy(tmp_path, **change)
    result = invoke(
        "replay",
        "--target",
        tiny_dir / "target",
        "--draft",
        head,
        "--workload",
        tiny_dir / "workload.jsonl",
        "--max-new-tokens",
        "4",
        "--out",
        tmp_path / "run",
    )
    assert_usage_error(result, str(head), fragment)


# ----------------------------------------------------------------------------------------------------
# Crafted DFlash GGUF drafts (10c)


def write_dflash_gguf(path: Path, *, keys=None) -> Path:
    writer = gguf.GGUFWriter(str(path), "dflash")
    for add in (
        keys
        if keys is not None
        else [
            lambda w: w.add_uint32("dflash.block_count", 1),
            lambda w: w.add_array("dflash.target_layers", [1, 2]),
            lambda w: w.add_uint32("tokenizer.ggml.mask_token_id", 3),
        ]
    ):
        add(writer)
    writer.add_tensor("output_norm.weight", np.ones(8, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _count_lie(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[8:16] = struct.pack("<Q", 2**40)
    path.write_bytes(bytes(raw))


GGUF_LIES = [
    ("tensor count 2^40", None, _count_lie, "could not be read as a GGUF file"),
    (
        "target_layers a string",
        [
            lambda w: w.add_uint32("dflash.block_count", 1),
            lambda w: w.add_string("dflash.target_layers", "abc"),
            lambda w: w.add_uint32("tokenizer.ggml.mask_token_id", 3),
        ],
        None,
        "dflash.target_layers is 'abc'",
    ),
    (
        "mask id a string",
        [
            lambda w: w.add_uint32("dflash.block_count", 1),
            lambda w: w.add_array("dflash.target_layers", [1, 2]),
            lambda w: w.add_string("tokenizer.ggml.mask_token_id", "3"),
        ],
        None,
        "tokenizer.ggml.mask_token_id is '3'",
    ),
    (
        "window without block_count",
        [
            lambda w: w.add_array("dflash.target_layers", [1, 2]),
            lambda w: w.add_uint32("tokenizer.ggml.mask_token_id", 3),
            lambda w: w.add_uint32("dflash.attention.sliding_window", 64),
        ],
        None,
        "dflash.attention.sliding_window is set but neither dflash.block_count",
    ),
    (
        "block_count a string",
        [
            lambda w: w.add_string("dflash.block_count", "two"),
            lambda w: w.add_array("dflash.target_layers", [1, 2]),
            lambda w: w.add_uint32("tokenizer.ggml.mask_token_id", 3),
        ],
        None,
        '`num_hidden_layers` is "two"',
    ),
]


@pytest.mark.parametrize("name, keys, damage, fragment", GGUF_LIES, ids=[row[0] for row in GGUF_LIES])
def test_a_crafted_dflash_gguf_is_refused_in_one_sentence(tmp_path, name, keys, damage, fragment):
    path = write_dflash_gguf(tmp_path / "draft.gguf", keys=keys)
    if damage is not None:
        damage(path)
    with pytest.raises(UsageError) as refused:
        read_gguf_draft(path)
    assert str(path) in refused.value.message and fragment in refused.value.message, refused.value.message


def test_the_well_formed_minimal_gguf_is_read(tmp_path):
    config, state = read_gguf_draft(write_dflash_gguf(tmp_path / "draft.gguf"))
    assert config["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [0, 1]} and list(state) == [
        "norm.weight"
    ]


# ----------------------------------------------------------------------------------------------------
# Targets and DFlash drafts whose config no longer matches (10d, 10e)


def _edited_target(tmp_path: Path, edit) -> Path:
    folder = tmp_path / "target"
    tiny_target().save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_target_with_an_unknown_rope_type_is_refused(tmp_path):
    folder = _edited_target(
        tmp_path,
        lambda c: c.update(rope_parameters={"rope_type": "weird_new_type", "factor": 2.0, "rope_theta": 10000.0}),
    )
    with pytest.raises(UsageError) as refused:
        load_causal_lm(folder)
    assert (
        "rope type 'weird_new_type'" in refused.value.message and str(folder / "config.json") in refused.value.message
    )


def test_a_target_whose_config_no_longer_matches_its_weights_is_refused(tmp_path):
    folder = _edited_target(tmp_path, lambda c: c.update(intermediate_size=c["intermediate_size"] * 2))
    with pytest.raises(UsageError) as refused:
        load_causal_lm(folder)
    message = refused.value.message
    assert str(folder / "model.safetensors") in message and "model.layers.0.mlp.gate_proj.weight" in message, message
    assert "(config key intermediate_size)" in message, message


def test_a_dflash_draft_whose_config_no_longer_matches_its_weights_is_refused(tiny_dir, tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(tiny_dir / "dflash", draft)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "intermediate_size": 2048}))
    with pytest.raises(UsageError) as refused:
        load_dflash_draft(draft)
    message = refused.value.message
    assert (
        "mlp.gate_proj.weight" in message and "(config key intermediate_size)" in message and str(draft) in message
    ), message


# ----------------------------------------------------------------------------------------------------
# Fuzz: random header mutations are refused or load

FUZZ_CASES = 300
HOSTILE = [None, -1, 0, 1, 2**64, 2**70, 3.5, "4", True, [], [1], [0, 0], [4, 2], {"a": 1}, "F32", "Q99"]


def _small_file(path: Path) -> bytes:
    save_file(
        {
            "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "b": torch.ones(4, dtype=torch.bfloat16),
            "c": torch.arange(5, dtype=torch.int64),
            "z": torch.zeros(0, 3, dtype=torch.int8),
        },
        path,
        metadata={"format": "pt"},
    )
    return path.read_bytes()


def _mutate(rng: random.Random, header: dict, data: bytes) -> tuple[dict, bytes]:
    names = [n for n in header if n != "__metadata__"]
    name = rng.choice(names)
    entry = header[name]
    kind = rng.randrange(9)
    if kind == 0:
        entry[rng.choice(["dtype", "shape", "data_offsets"])] = rng.choice(HOSTILE)
    elif kind == 1:
        entry["dtype"] = rng.choice(list(SAFETENSORS_DTYPES))
    elif kind == 2 and entry["shape"]:
        entry["shape"][rng.randrange(len(entry["shape"]))] += rng.choice([-1, 1, 2**63])
    elif kind == 3:
        entry["data_offsets"][rng.randrange(2)] += rng.choice([-8, -1, 1, 4, 2**40])
    elif kind == 4:
        shift = rng.choice([-4, 4])
        entry["data_offsets"] = [o + shift for o in entry["data_offsets"]]
    elif kind == 5:
        header["__metadata__"] = rng.choice([None, [], {"a": 1}, "pt", {"a": "b"}])
    elif kind == 6:
        target, key = (header, name) if rng.random() < 0.5 else (entry, rng.choice(list(entry)))
        del target[key]
    elif kind == 7:
        entry["shape"] = list(reversed(entry["shape"])) + rng.choice([[], [1]])
    else:
        data = data + b"\0" * rng.choice([1, 8]) if rng.random() < 0.5 else data[: -rng.choice([1, 8])]
    return header, data


def test_fuzzed_safetensors_headers_are_refused_or_load(tmp_path):
    rng = random.Random(49)
    original = split(_small_file(tmp_path / "base.safetensors"))
    path = tmp_path / "fuzz.safetensors"
    outcomes = {"refused": 0, "loaded": 0}
    for _ in range(FUZZ_CASES):
        header, data = copy.deepcopy(original[0]), original[1]
        for _ in range(rng.randint(1, 3)):
            header, data = _mutate(rng, header, data)
        path.write_bytes(join(header, data))
        try:
            checked = safetensors_header(path)
        except UsageError as refused:
            assert str(path) in refused.message and refused.message.endswith("."), refused.message
            outcomes["refused"] += 1
            continue
        tensors = load_file(path)
        assert {n: list(t.shape) for n, t in tensors.items()} == {
            n: e["shape"] for n, e in checked.items() if n != "__metadata__"
        }
        outcomes["loaded"] += 1
    assert outcomes["refused"] > FUZZ_CASES // 2 and outcomes["loaded"] > 0, outcomes
