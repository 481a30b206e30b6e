"""Unbounded sizes and head-to-head inputs: every size is bounded when it is read, before any
model loads (speculator option strings, ``--k``, a chat template's operators), and every ``--draft`` of a
head-to-head is resolved before the first contender runs, each under a folder name that stays inside ``--out``.

Rows of the 2026-12-04 probe: A1-A5 (option strings and K), the quirks beside them (a repeated key, Unicode
digits, a value rounded to 0), J1 (a template's ``'x' * 10**12``), G1 (a bad later ``--draft``), G2 (``x/..``).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import assert_usage_error, invoke, pair_args
from dflash_doctor import pipeline
from dflash_doctor.engine.proposers.ngram import MAX_LOOKUP_TOKENS, NgramSettings, ngram_lookup
from dflash_doctor.engine.proposers.suffix import SuffixSettings
from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.check_inputs import safe_folder_name
from dflash_doctor.inputs.config import MAX_K, parse_k
from dflash_doctor.inputs.workloads.conversation import MAX_TEMPLATE_SIZE, BoundedSandbox, encode_turn
from dflash_doctor.models.draft_kinds import weightless_kind
from tiny_models import CHATML, tiny_tokenizer

# ----------------------------------------------------------------------------- A1-A3 and the quirks: option strings

BAD_OPTION_STRINGS = [
    ("ngram:prompt_lookup_min=1,prompt_lookup_max=99999999999999999999", "must be in [1, 1048576]"),  # A1
    ("ngram:prompt_lookup_min=1,prompt_lookup_max=1000000000000", "must be in [1, 1048576]"),  # A2
    ("ngram:prompt_lookup_max=" + "9" * 5000, "is not a whole number"),  # past int()'s own digit limit
    ("suffix:suffix_decoding_max_spec_factor=1e39", "does not fit a float32"),  # A3: finite in float64 only
    ("suffix:suffix_decoding_max_spec_factor=3e38", "must be in [0, 1048576]"),  # finite in float32, still no size
    ("suffix:suffix_decoding_max_tree_depth=100000000", "must be in [1, 1048576]"),
    ("suffix:suffix_decoding_max_cached_requests=99999999999999", "must be in [0, 2147483648]"),
    ("ngram:prompt_lookup_min=2,prompt_lookup_min=3", "prompt_lookup_min is set twice"),  # quirk: a repeated key
    ("suffix:max_tree_depth=4,suffix_decoding_max_tree_depth=8", "set twice"),  # the same key, with and without prefix
    ("mtp:hidden_state=pre-norm,hidden_state=post-norm", "hidden_state is set twice"),
    ("ngram:prompt_lookup_min=\u0663", "is not a whole number in the digits 0-9"),  # quirk: Arabic-Indic 3
    ("suffix:suffix_decoding_max_tree_depth=\uff18", "is not a whole number in the digits 0-9"),  # fullwidth 8
    ("ngram:prompt_lookup_max=1_000", "is not a whole number"),
    ("suffix:suffix_decoding_min_token_prob=1e-400", "rounds to 0 in float32"),  # quirk: underflow to 0.0
    ("suffix:suffix_decoding_min_token_prob=1e-50", "rounds to 0 in float32"),  # 0 in float32 only
    ("suffix:suffix_decoding_min_token_prob=\u0660.5", "is not a decimal number"),
    ("suffix:suffix_decoding_min_token_prob=infinity", "is not a decimal number"),
    ("suffix:suffix_decoding_max_spec_factor=1_0", "is not a decimal number"),
]


@pytest.mark.parametrize("spec,fragment", BAD_OPTION_STRINGS)
def test_a_bad_option_string_is_refused_where_it_is_read(spec, fragment):
    with pytest.raises(UsageError) as error:
        weightless_kind(spec)
    assert fragment in str(error.value)


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("ngram:prompt_lookup_min=+2,prompt_lookup_max=0005", NgramSettings(2, 5)),
        (f"ngram:prompt_lookup_max={MAX_LOOKUP_TOKENS}", NgramSettings(MAX_LOOKUP_TOKENS, MAX_LOOKUP_TOKENS)),
        (
            "suffix:suffix_decoding_min_token_prob=0.0,max_spec_factor=1E3",
            SuffixSettings(min_token_prob=0.0, max_spec_factor=1000.0),
        ),
        ("suffix:suffix_decoding_min_token_prob=1e-30", SuffixSettings(min_token_prob=1e-30)),
    ],
)
def test_values_in_range_are_read_as_written(spec, expected):
    kind, settings = weightless_kind(spec)
    assert kind.check_settings(settings) == expected


def test_the_largest_lookup_allocates_for_the_context_only():
    """A1/A2's allocation was ``[0] * prompt_lookup_max`` per step; the scan now sizes it by the context and
    proposes exactly what a bound of the context's length proposes."""
    context = [5, 6, 7, 1, 2, 5, 6, 7]
    widest = ngram_lookup(context, 4, NgramSettings(1, MAX_LOOKUP_TOKENS))
    assert widest == ngram_lookup(context, 4, NgramSettings(1, len(context))) == [1, 2, 5, 6]


def test_the_cli_refuses_a_huge_lookup_with_exit_2(tiny_dir, tmp_path):
    result = invoke(
        "replay",
        *pair_args(
            tiny_dir,
            "ngram:prompt_lookup_min=1,prompt_lookup_max=99999999999999999999",
            "--k",
            "4",
            "--max-requests",
            "1",
            "--out",
            tmp_path / "run",
        ),
    )
    assert_usage_error(result, "prompt_lookup_max")


# ----------------------------------------------------------------------------- A4-A5: K


@pytest.mark.parametrize(
    "value",
    [
        "100000",
        "32767",
        f"{MAX_K + 1}",
        f"1-{MAX_K + 1}",
        "1-10000000000000",
        "4,129",
        [4, 100000],
        32767,
        "\u0663",
        "1_0",
    ],
)
def test_k_above_the_cap_or_not_ascii_is_refused(value):
    with pytest.raises(UsageError, match="--k"):
        parse_k(value)


def test_k_up_to_the_cap_is_kept():
    assert parse_k(f"1-3,{MAX_K}") == (1, 2, 3, MAX_K)
    assert parse_k([MAX_K]) == (MAX_K,)


@pytest.mark.parametrize("command", ["replay", "sweep"])
def test_the_cli_refuses_a_huge_k_before_any_work(command, tiny_dir, tmp_path):
    """A4 (an int16 overflow after the replay) and A5 (45 GB of logits): exit 2 and no run folder."""
    args = pair_args(tiny_dir, "ngram", "--k", "100000", "--max-requests", "1", "--out", tmp_path / "run")
    result = invoke(command, *args)
    assert_usage_error(result, "--k", str(MAX_K))
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- J1: a chat template's sizes

HOSTILE_TEMPLATES = [
    ("{{ 'x' * 1000000000000 }}{{ messages[0]['content'] }}", "a repetition (*)"),  # J1 as probed
    ("{{ 1000000000000 * ['x'] }}", "a repetition (*)"),
    ("{{ 'x' * 20000000 }}", "a repetition (*)"),  # just above the limit
    ("{% set s = 'x' * 10000000 %}{{ s + s }}", "a concatenation (+)"),
    (
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
        "a concatenation (~)",
    ),
    ("{{ 7 ** 100000000 }}", "a power (**)"),
    ("{{ '%1000000000000d' % 1 }}", "a % format"),
    ("{{ '{:>1000000000000}'.format(1) }}", "a format string"),
    ("{{ '%1000000000000d'|format(1) }}", "the filter format"),
    ("{{ 'x'.center(1000000000000) }}", "a call of center"),
    ("{{ 'x'|center(1000000000000) }}", "the filter center"),
    ("{{ [[1]]|tojson(indent=1000000000000) }}", "the filter tojson"),
    ("{{ ['x' * 10000000, 'y' * 10000000]|join }}", "the filter join"),
    ("{{ ('a\n' * 1000)|indent(100000) }}", "the filter indent"),
    ("{{ 'ab'.replace('', 'x' * 16000000) }}", "a replace"),
    ("{% for i in range(10**12) %}{% endfor %}", "a call of safe_range"),  # jinja2's MAX_RANGE raised OverflowError
    ("{{ lipsum(n=5) }}", "lipsum"),  # paragraphs of placeholder text are no chat template's business
    ("{{ 1 // 0 }}", "ZeroDivisionError"),
    ("{{ 2.0 ** 100000 }}", "OverflowError"),
]


@pytest.mark.parametrize("template,fragment", HOSTILE_TEMPLATES)
def test_a_template_that_would_build_a_huge_value_is_refused_before_it_does(template, fragment):
    with pytest.raises(UsageError) as error:
        encode_turn(tiny_tokenizer(), [{"role": "user", "content": "w1 w2"}], chat_template=template)
    assert fragment in str(error.value) and "chat template" in str(error.value)


def test_a_rendered_prompt_above_the_limit_is_refused_in_one_sentence():
    """Each piece under the limit, the render above it: the rendered-size bound."""
    template = "{% for i in range(3) %}{{ 'w1 ' * 3000000 }}{% endfor %}"
    with pytest.raises(UsageError, match=f"above the limit of {MAX_TEMPLATE_SIZE:,}"):
        encode_turn(tiny_tokenizer(), [{"role": "user", "content": "w1"}], chat_template=template)


def test_templates_within_the_limits_render_as_before():
    tokenizer = tiny_tokenizer()
    messages = [{"role": "user", "content": "w1 w2"}]
    padded = "{{ 'w3 ' * 2 }}{{ messages[0]['content'] ~ ' w4' }}{{ '%s'|format('w5') }}{{ ['w6', 'w7']|join(' ') }}"
    assert encode_turn(tokenizer, messages, chat_template=padded) == tokenizer("w3 w3 w1 w2 w4w5w6 w7")["input_ids"]
    assert encode_turn(tokenizer, messages, chat_template=CHATML) == encode_turn(tokenizer, messages)


def test_transformers_compiles_chat_templates_in_the_bounded_sandbox():
    """The bound holds only while transformers builds its sandbox from the class name we replace."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    encode_turn(tiny_tokenizer(), [{"role": "user", "content": "w1"}], chat_template=CHATML)
    assert isinstance(_compile_jinja_template(CHATML).environment, BoundedSandbox)


# ----------------------------------------------------------------------------- G1, G2: the head-to-head's inputs


def test_a_bad_later_draft_is_refused_before_any_model_loads(tiny_dir, tmp_path, monkeypatch):
    """G1: the ngram contender's check ran to its end before ``/nonexistent/x`` was refused."""

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before every --draft was checked")

    monkeypatch.setattr(pipeline, "load_pair", no_load)
    for drafts in (
        ["ngram", "/nonexistent/x"],
        ["ngram", "suffix:max_spec_factor=1e39"],
        [tiny_dir / "dflash", tiny_dir / "nothing.gguf"],
        ["ngram", "org/not-in-the-cache"],
    ):
        args = [arg for draft in drafts for arg in ("--draft", draft)]
        result = invoke(
            "check",
            "--target",
            tiny_dir / "target",
            *args,
            "--workload",
            tiny_dir / "workload.jsonl",
            "--out",
            tmp_path / "h2h",
        )
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert not (tmp_path / "h2h").exists()


@pytest.mark.parametrize(
    "text,expected",
    [
        ("..", "draft"),
        (".", "draft"),
        ("", "draft"),
        ("...", "draft"),
        ("a/b", "a-b"),
        ("a\\b", "a-b"),
        ("model", "model"),
        ("Qwen3-8B@main", "Qwen3-8B@main"),
        ("na\nme", "na-me"),
        ("mod\u00e8le", "mod-le"),
    ],
)
def test_a_folder_name_from_an_input_is_one_safe_name(text, expected):
    assert safe_folder_name(text) == expected


def test_a_traversal_draft_never_names_a_folder_outside_out(tiny_dir, tmp_path, monkeypatch):
    """G2: ``--draft ./trav/model/x/..`` was named ``..`` and written beside ``--out``. Each contender's
    check is asked for a folder inside ``--out`` (recorded, then stopped: no model needs to run)."""
    model = tmp_path / "trav" / "model"
    model.mkdir(parents=True)
    for item in (tiny_dir / "dflash").iterdir():
        (model / item.name).symlink_to(item)
    (model / "x").mkdir()
    drafts = ["ngram", str(model / "x" / ".."), f"{model}/x/../x/.."]
    asked: list[Path] = []

    class Enough(Exception):
        pass

    def record(config, **kwargs):
        asked.append(Path(config.out))
        if len(asked) == len(drafts):
            raise Enough

    monkeypatch.setattr(pipeline, "run_check", record)
    root = tmp_path / "trav" / "h2h"
    config = pipeline.DoctorConfig(target=str(tiny_dir / "target"), out=str(root))
    with pytest.raises(Enough):
        pipeline.run_head_to_head(config, drafts)
    assert [path.name for path in asked] == ["ngram", "model", "model-2"]
    assert all(path.resolve().parent == root.resolve() for path in asked)


# ----------------------------------------------------------------------------- fuzz: option strings and K

FUZZ_CASES = 400
_KEYS = {
    "ngram": ["prompt_lookup_min", "prompt_lookup_max"],
    "suffix": [
        "suffix_decoding_max_tree_depth",
        "max_tree_depth",
        "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_spec_factor",
        "max_spec_factor",
        "suffix_decoding_min_token_prob",
        "min_token_prob",
    ],
    "mtp": ["hidden_state", "carried_state", "num_speculative_tokens"],
}
_PIECES = [
    "0",
    "1",
    "2",
    "5",
    "-1",
    "+3",
    "24",
    "1048576",
    "1048577",
    "2147483648",
    "99999999999999999999",
    "1e3",
    "1E-7",
    "1e-400",
    "1e39",
    "3.4e38",
    "0.5",
    ".5",
    "5.",
    "nan",
    "inf",
    "-inf",
    "\u0663",
    "\uff15",
    "1_0",
    "0x10",
    " ",
    "",
    "pre-norm",
    "post-norm",
    "=",
    ",",
    "\u00e9",
    "9" * 40,
    "1e",
    "--",
]


def _fuzz_value(rng: random.Random) -> str:
    return "".join(rng.choice(_PIECES) for _ in range(rng.choice((1, 1, 1, 2, 3))))


def _check_in_range(kind: str, parsed: object) -> None:
    """An accepted option string holds only values that are in range, finite and sized."""
    if isinstance(parsed, NgramSettings):
        assert 1 <= parsed.prompt_lookup_min <= parsed.prompt_lookup_max <= MAX_LOOKUP_TOKENS
    elif isinstance(parsed, SuffixSettings):
        assert 1 <= parsed.max_tree_depth <= MAX_LOOKUP_TOKENS and 0 <= parsed.max_cached_requests <= 1 << 31
        for value in (parsed.max_spec_factor, parsed.min_token_prob):
            assert np.isfinite(np.float32(value)) and (value == 0) == (np.float32(value) == 0)
        assert 0 <= parsed.max_spec_factor <= MAX_LOOKUP_TOKENS and 0 <= parsed.min_token_prob <= 1
    else:
        assert kind == "mtp" and all(value in ("pre-norm", "post-norm") for value in dict(parsed).values())


def test_fuzzed_option_strings_are_accepted_in_range_or_refused_in_one_sentence():
    rng = random.Random(49)
    outcomes = {"accepted": 0, "refused": 0}
    for _ in range(FUZZ_CASES):
        kind = rng.choice(list(_KEYS))
        keys = _KEYS[kind] + ["depth", "prompt_lookup", "\u0661"]
        items = [f"{rng.choice(keys)}={_fuzz_value(rng)}" for _ in range(rng.randint(0, 3))]
        spec = kind + (":" + ",".join(items) if items or rng.random() < 0.5 else "")
        try:
            named = weightless_kind(spec)
        except UsageError as error:
            assert str(error).endswith(".") and "\n" not in str(error), spec
            outcomes["refused"] += 1
            continue
        assert named is not None, spec
        _check_in_range(kind, named[0].check_settings(named[1]))
        outcomes["accepted"] += 1
    assert min(outcomes.values()) > FUZZ_CASES // 10, outcomes  # the generator reaches both sides


def test_fuzzed_k_grids_are_in_range_or_refused():
    rng = random.Random(4949)
    for _ in range(FUZZ_CASES // 2):
        text = ",".join(_fuzz_value(rng) + rng.choice(("", "-" + _fuzz_value(rng))) for _ in range(rng.randint(1, 3)))
        try:
            ks = parse_k(text)
        except UsageError:
            continue
        assert ks and all(1 <= k <= MAX_K for k in ks), text
