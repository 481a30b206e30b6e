"""The loaded target + draft pair: loaded once per command, then read by replay, probes and checks.

:func:`load_pair` resolves the draft's kind through :mod:`dflash_doctor.models.draft_kinds` (nothing here
branches on a kind), loads and validates both models, builds the proposer, and records the facts
run.json keeps about each model. A pair that cannot work is refused here, before any replay.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_doctor.engine.attention import engine_attention
from dflash_doctor.engine.cache import rollback_method
from dflash_doctor.engine.proposers.base import Proposer
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.errors import UsageError
from dflash_doctor.inputs.config import DoctorConfig
from dflash_doctor.inputs.workloads import read_chat_template
from dflash_doctor.models.draft_kinds import DraftKind, LoadOptions, Sampling, get_draft_kind, resolve_draft_spec
from dflash_doctor.stages import stage
from dflash_doctor.models.loading import (
    DEMO_DRAFT_DIR,
    demo_target_path,
    fingerprint,
    hub_commit,
    load_causal_lm,
    resolve_model_dir,
)
from dflash_doctor.models.placement import target_devices
from dflash_doctor.rundir.run_record import ModelInfo
from dflash_doctor.stats.deviations import TokenCategories
from dflash_doctor.stats.step_costs import DEFAULT_TIMING_BUDGET_S, CostSamples, measure_step_samples


def stop_ids_of(model, tokenizer) -> frozenset[int]:
    """Every id that ends a generation: the model's (and generation config's) eos ids and the tokenizer's."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)


@dataclass
class Pair:
    """A loaded target + draft and everything needed to replay requests through them.

    ``target_info`` / ``draft_info`` are the facts run.json records; ``draft_config`` is the draft
    checkpoint's config.json (the checks read it as written). A speculator without weights (``--draft
    ngram``) has no ``draft_dir`` and an empty ``draft_config``.
    """

    target: TargetModel
    draft_model: torch.nn.Module
    kind: DraftKind
    proposer: Proposer
    tokenizer: Any
    stop_ids: frozenset[int]
    target_dir: Path
    draft_dir: Path | None
    draft_config: dict[str, Any]
    target_info: ModelInfo
    draft_info: ModelInfo
    chat_template: str | None = None
    sampling: Sampling = Sampling()
    server_settings: dict[str, Any] | None = None  # the resolved --engine-config, read once per command
    _token_text: dict[int, str] = field(default_factory=dict, repr=False)

    @functools.cached_property
    def token_category(self) -> TokenCategories:
        """Category of a token id from the tokenizer's own pieces (recorded, so views need no tokenizer)."""
        return TokenCategories(self.tokenizer)

    def decode_token(self, token_id: int) -> str:
        """One token's text, memoised (views show tokens without loading a tokenizer)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text

    @property
    def default_k(self) -> int:
        """K when none was asked for: a block drafter's full block (vLLM's B - 1), else 8."""
        return self.proposer.max_k or 8

    def check_k_fits(self, ks: tuple[int, ...]) -> None:
        """K above a block drafter's block is impossible: refuse it before any work."""
        max_k = self.proposer.max_k
        if ks and max_k is not None and max(ks) > max_k:
            raise UsageError(
                f"--k {max(ks)} exceeds what this draft can propose per step ({max_k} = block_size - 1); "
                f"use --k 1-{max_k}."
            )

    @engine_attention
    @torch.inference_mode()
    def measure_step_costs(
        self,
        ks: tuple[int, ...],
        *,
        budget_s: float = DEFAULT_TIMING_BUDGET_S,
        context_tokens: int = 128,
        seed: int = 0,
    ) -> CostSamples:
        """Time plain decode, verify of 1 + K tokens and drafting K tokens on this device, at a realistic
        context, in interleaved rounds until each median is tight or ``budget_s`` is spent
        (:func:`dflash_doctor.stats.step_costs.measure_step_samples`). A block drafter's draft is one pass
        whatever K, which the cost model fits as one constant."""
        target, proposer = self.target, self.proposer
        taps = proposer.needs.hidden_state_indices
        device = target.device
        context = torch.randint(10, self.tokenizer.vocab_size - 10, (context_tokens,), device=device)
        target.reset()
        prefill = target.forward(context, taps=taps, logits_from=context_tokens - 1)
        proposer.start(context, prefill.features)
        base = target.cache_length
        token = torch.tensor([int(context[-1])], device=device)

        def decode_step() -> None:
            target.forward(token, taps=())
            target.crop(base)

        def verify_step(k: int) -> None:
            target.forward(token.repeat(k + 1), taps=taps)
            target.crop(base)

        def draft_step(k: int) -> None:
            proposer.propose(int(token), k, k)

        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
        probe = sorted({k for k in (1, 2, 4, 8, 16) if k < max(ks)} | {max(ks), min(ks)})
        samples = measure_step_samples(
            decode_step,
            verify_step,
            draft_step,
            probe,
            flat_draft=self.proposer.max_k is not None,
            budget_s=budget_s,
            sync=sync,
            device=str(device),
            seed=seed,
        )
        target.reset()
        return samples

    def with_sampling(self, sampling: Sampling) -> "Pair":
        """The same pair whose proposer drafts with ``sampling`` (the replay's temperature and generator)."""
        return dataclasses.replace(
            self, proposer=self.kind.build(self.draft_model, self.target, sampling), sampling=sampling
        )

    def with_draft(self, draft_model: torch.nn.Module, **draft_facts: Any) -> "Pair":
        """The same pair with another draft module of the same kind (a layer-offset scenario or probe)."""
        info = dataclasses.replace(
            self.draft_info, facts={**self.draft_info.facts, **self.kind.facts(draft_model), **draft_facts}
        )
        return dataclasses.replace(
            self,
            draft_model=draft_model,
            proposer=self.kind.build(draft_model, self.target, self.sampling),
            draft_info=info,
        )


def load_pair(config: DoctorConfig, server_settings: dict[str, Any] | None = None) -> Pair:
    """Load the configured pair (the built-in demo pair when no model flags are given). ``server_settings``:
    the resolved ``--engine-config`` (:func:`dflash_doctor.serving.server_settings.server_settings`), whose
    draft sampling method the proposer models; without one, vLLM's default ``greedy``."""
    from transformers import AutoTokenizer

    if config.draft_kind != "auto":
        get_draft_kind(config.draft_kind)  # an unknown kind fails before any loading
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {config.device} was asked for but no CUDA device is available; use --device cpu.")
    target_spec = config.target or str(demo_target_path())
    draft_spec = config.draft or str(DEMO_DRAFT_DIR)
    if config.draft is None and not (DEMO_DRAFT_DIR / "config.json").is_file():
        raise UsageError(
            f"the built-in demo draft is missing from {DEMO_DRAFT_DIR}; reinstall dflash-doctor or pass --draft."
        )
    target_dir = resolve_model_dir(target_spec)
    resolved = resolve_draft_spec(draft_spec, config.draft_kind)  # a weightless speculator (ngram) or a checkpoint
    kind, draft_dir, draft_config = resolved.kind, resolved.draft_dir, resolved.config
    named = (kind, resolved.settings) if resolved.settings is not None else None
    with stage(f"loading the target {Path(target_spec).name} ({config.dtype}, {config.device})"):
        target_model = load_causal_lm(
            target_dir, dtype=config.dtype, device=config.device, trust_remote_code=config.trust_remote_code
        )
        tokenizer = AutoTokenizer.from_pretrained(target_dir, trust_remote_code=config.trust_remote_code)
    draft_device = target_devices(config.device)[0]  # next to a placed target's embeddings and head
    options = LoadOptions(dtype=config.dtype, device=draft_device, trust_remote_code=config.trust_remote_code)
    with stage(f"loading the {kind.name} draft {Path(draft_spec).name}"):
        if named is not None:
            assert kind.from_spec is not None
            draft_model = kind.from_spec(named[1], target_dir, target_model.config, options)
        else:
            assert draft_dir is not None
            draft_model = kind.load(draft_dir, target_dir, target_model.config, options)
    target = TargetModel(target_model)
    sampling = Sampling(
        temperature=config.temperature,
        draft_sample_method=server_settings["draft_sample_method"] if server_settings else "greedy",
    )
    target_info = ModelInfo(
        id=target_spec,
        revision_or_hash=fingerprint(target_dir),
        hub_commit=hub_commit(target_dir),
        dtype=config.dtype,
        device=config.device,
        kind="target",
        facts={
            "num_layers": target_model.config.num_hidden_layers,
            "hidden_size": target_model.config.hidden_size,
            "vocab_size": target_model.config.vocab_size,
            "attn_implementation": getattr(target_model.config, "_attn_implementation", None),
            "cache_rollback": rollback_method(target_model.config),
        },
    )
    draft_info = ModelInfo(
        id=draft_spec,
        revision_or_hash=fingerprint(draft_dir) if draft_dir is not None else draft_spec,
        hub_commit=hub_commit(draft_dir) if draft_dir is not None else None,
        dtype=config.dtype,
        device=draft_device,
        kind=kind.name,
        facts={**kind.facts(draft_model), "draft_sample_method": sampling.draft_sample_method},
    )
    return Pair(
        target=target,
        draft_model=draft_model,
        kind=kind,
        proposer=kind.build(draft_model, target, sampling),
        tokenizer=tokenizer,
        stop_ids=stop_ids_of(target_model, tokenizer),
        target_dir=target_dir,
        draft_dir=draft_dir,
        draft_config=draft_config,
        target_info=target_info,
        draft_info=draft_info,
        chat_template=read_chat_template(config.chat_template) if config.chat_template else None,
        sampling=sampling,
        server_settings=server_settings,
    )
