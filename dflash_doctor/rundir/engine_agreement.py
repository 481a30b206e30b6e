"""The engine-agreement probe as run.json stores it (``probes.engine_agreement``), typed.

:func:`dflash_doctor.serving.agreement.summarize_agreement` builds one :class:`EngineAgreement` once; the
engine-agreement check and the terminal view read its attributes. The classes are frozen because the
record is a measurement: nothing after the probe may change what it found. The field order is run.json's
key order, and :func:`dflash_doctor.rundir.run_record._from_json` checks every field on the way in.

Floats that may be undefined (a pooled tau over no drafts, a median of no margins) are ``float | None``:
NaN in memory, null in run.json.
"""

from __future__ import annotations

from dataclasses import dataclass, field

JSON_NAME = "json_name"  # field metadata: the run.json key where it cannot be the field's name ("class")


@dataclass(frozen=True)
class PromptAgreement:
    """Whether the server's prompt ids are the target's own chat-template rendering (turns with both sides)."""

    num_compared: int
    num_identical: int
    differing: list[str]  # the first differing request ids


@dataclass(frozen=True)
class OutputDifference:
    """The first output token where the server's text leaves the target's greedy choice, with the target's
    top-2 margin there (a near-tie broken by other kernels is told from a real difference)."""

    request_id: str
    position: int
    engine_token: int
    embedded_token: int
    target_top2_margin: float


@dataclass(frozen=True)
class OutputAgreement:
    """Whether the server's outputs are the target's greedy text at T = 0 (the first differences listed)."""

    num_compared: int
    num_identical: int
    differences: list[OutputDifference]


@dataclass(frozen=True)
class TauComparison:
    """One scope's pooled tau, server and embedded on the same outputs, with bootstrap intervals over turns
    and for the paired difference (embedded - engine)."""

    num_turns: int
    engine_tau: float | None
    engine_tau_ci: list[float | None]
    embedded_tau: float | None
    embedded_tau_ci: list[float | None]
    difference: float | None
    difference_ci: list[float | None]


@dataclass(frozen=True)
class TauByScope:
    """tau over every compared turn (None when no turn drafted) and per request class."""

    overall: TauComparison | None
    by_class: dict[str, TauComparison]


@dataclass(frozen=True)
class SetupSteps:
    """How one serving setup reproduces the engine's steps: agreeing steps and their share, and the
    ``telling`` steps (where it and the configured draft predict differently) the server sided with it on."""

    num_steps: int
    num_agreeing: int
    share: float | None
    num_telling: int
    num_siding: int
    embedded_accepted: int
    engine_accepted: int


@dataclass(frozen=True)
class TurnAgreement:
    """One compared turn: drafts and accepted tokens on both sides, and its per-step agreement."""

    request_id: str
    request_class: str = field(metadata={JSON_NAME: "class"})
    engine_drafts: int
    engine_accepted: int
    embedded_drafts: int
    embedded_accepted: int
    outputs_match: bool | None  # None: sampled, or no output ids
    steps_compared: int
    steps_agreeing: int


@dataclass(frozen=True)
class DecidingMargins:
    """The embedded draft's margins at the slot deciding each step, for the setup the server is closest to:
    disagreements decided by thousandths of a logit against whole logits elsewhere are rounding."""

    setup: str
    num_agreeing: int
    median_agreeing: float | None
    num_disagreeing: int
    median_disagreeing: float | None
    disagreeing: list[float]  # the smallest ones


@dataclass(frozen=True)
class SetupRecord:
    """A simulated serving setup as stored (:class:`dflash_doctor.models.serving_setups.ServingSetup`'s fields;
    the flags default to off, as runs written before a flag existed simulated nothing of it)."""

    name: str
    layer_offset: int = 0
    flip_causal: bool = False
    first_layer_context_k_norm: bool = False
    layer_ids: list[int] | None = None
    flip_norm_before_residual: bool = False
    engine_defect: bool = False
    cause: str = ""
    fix: str = ""


@dataclass(frozen=True)
class EngineAgreement:
    """The server against the embedded replay of the same turns: what the engine-agreement check judges.

    ``serving_checklist``: where to look in the serving setup for this draft kind ("" in runs written
    before the kinds carried one; the check then names a general list).
    """

    num_turns: int
    num_compared: int
    engine_k: int | None
    draft_block_size: int | None
    prompts: PromptAgreement
    outputs: OutputAgreement
    tau: TauByScope
    per_step: dict[str, SetupSteps]  # setup name -> its step agreement
    turns: list[TurnAgreement]
    deciding_margins: DecidingMargins
    setups: list[SetupRecord] = field(default_factory=list)
    serving_checklist: str = ""
