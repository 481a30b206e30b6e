"""One engine-response model: an engine's own per-request speculative-decoding figures, read out of one
response body. ``serving/`` (``check --engine``) and ``telemetry/`` (``watch`` over captured responses)
both read bodies through :func:`parse_response`, so one body gives one answer.

Each engine reports acceptance in its own fields and with its own definitions (docs/definitions.md).
Everything here converts to vLLM's, the project's: a *draft* is one verify step that carried
draft tokens, ``num_accepted_tokens`` excludes the bonus token, and ``tau = 1 + accepted / drafts``.

* vLLM (``--per-request-spec-decode-metrics summary|detailed``, docs/engines.md): top-level
  ``metrics.speculative_decoding`` with the acceptance histogram (index j = verify steps that accepted
  exactly j drafts) and, when ``detailed``, ``per_step_accepted`` / ``per_step_drafted`` in step order.
  The histogram determines the step and accepted counts exactly, so a body without
  ``num_spec_steps`` / ``num_accepted_draft_tokens`` (the object is marked experimental) is read from it;
  a body with neither is malformed, never zero.
* SGLang (section 2c): ``sglext.spec_tokens_details`` (request ``return_spec_tokens_details``),
  ``choices[0].meta_info`` (``return_meta_info``) or the native ``meta_info``. ``spec_verify_ct`` counts
  verify steps and ``spec_num_correct_drafts`` accepted drafts (bonus excluded), so tau = 1 + correct /
  verify_ct. SGLang's own per-request ``spec_accept_length`` is ``completion_tokens / spec_verify_ct``: it
  counts the prefill's token too and reads high on short outputs; it is kept beside ours, never used as tau.
* llama.cpp (section 3): ``timings.draft_n`` / ``timings.draft_n_accepted`` only. There is no verify-step
  count, so no tau from the response: ``check --engine`` takes the steps from llama-server's ``/metrics``
  counters around each request (serving/server_run.py).

Per-request figures describe one completion: vLLM returns none when n > 1 (section 1c, "only for n == 1"),
so a body with several completions (SGLang's details list, several choices) has none here either.
Engine names are the identifiers of the engines' own metric namespaces and of ``watch --engine``:
``vllm``, ``sglang``, ``llamacpp`` (section B).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from dflash_doctor.engine.step_records import StepRecord
from dflash_doctor.inputs.validation import type_error
from dflash_doctor.serving.client import ServerError

# Which engine a response came from, as detected from its fields.
VLLM, SGLANG, LLAMA_CPP = "vllm", "sglang", "llamacpp"


@dataclass(frozen=True)
class SpecMeasurement:
    """One request's speculative-decoding figures as its engine reported them, in vLLM's definitions.

    ``num_drafts`` is None when the engine gives no verify-step count (llama.cpp); ``num_draft_tokens``
    is None when it gives no drafted-token count (SGLang without ``spec_num_proposed_drafts`` or a
    histogram). ``per_step_accepted`` and ``per_step_drafted`` are in step order (vLLM ``detailed``
    only); ``acceptance_histogram[j]`` counts steps that accepted exactly j drafts. ``engine_tau`` is the
    engine's own printed figure where its definition differs from ours (SGLang), for the report to show
    side by side. ``num_generated_tokens`` is the completion's length as the engine counted it.
    """

    server_kind: str
    num_spec_tokens: int | None  # K the server drafts per step
    num_drafts: int | None
    num_draft_tokens: int | None
    num_accepted_tokens: int
    acceptance_histogram: tuple[int, ...] | None = None
    per_step_accepted: tuple[int, ...] | None = None
    per_step_drafted: tuple[int, ...] | None = None
    engine_tau: float | None = None
    num_generated_tokens: int | None = None

    @property
    def tau(self) -> float | None:
        """Mean acceptance length with the bonus token (vLLM's definition); None without a step count."""
        if not self.num_drafts:
            return None
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    @property
    def steps_in_order(self) -> bool:
        return self.per_step_accepted is not None


class MissingMetrics(ValueError):
    """A response carries no speculative-decoding figures; the message names the server flag to set.

    ``per_request_off`` is True when the server may well speculate but does not report per request
    (then its ``/metrics`` counters can stand in, one request at a time).
    """

    def __init__(self, message: str, per_request_off: bool = False):
        super().__init__(message)
        self.per_request_off = per_request_off


def per_pos_from_histogram(histogram: Sequence[float]) -> tuple[float, ...]:
    """``histogram[j]`` = drafts accepting exactly j tokens (j = 0..K) -> ``per_pos[i]`` = drafts accepting
    at least i + 1 (i = 0..K-1): vLLM's unconditional per-position counter. Their sum is the accepted count."""
    return tuple(float(sum(histogram[i + 1 :])) for i in range(len(histogram) - 1))


def histogram_from_per_pos(num_drafts: int, per_pos: Sequence[int]) -> tuple[int, ...]:
    """The inverse of :func:`per_pos_from_histogram`: drafts accepting exactly j are ``per_pos[j - 1] - per_pos[j]``
    (``per_pos[-1]`` = all drafts, and none accept more than K)."""
    reach = [num_drafts, *per_pos, 0]
    return tuple(reach[j] - reach[j + 1] for j in range(len(per_pos) + 1))


def _ints(values: Any) -> tuple[int, ...] | None:
    return None if values is None else tuple(int(v) for v in values)


def _count(value: Any) -> int | None:
    return None if value is None else int(value)


def parse_vllm(spec: Mapping[str, Any], *, completion_tokens: int | None = None) -> SpecMeasurement:
    """vLLM's ``metrics.speculative_decoding`` object (vllm/v1/metrics/stats.py RequestSpecDecodeMetrics)."""
    histogram = _ints(spec.get("acceptance_histogram"))
    accepted, drafts = _count(spec.get("num_accepted_draft_tokens")), _count(spec.get("num_spec_steps"))
    if histogram is not None:
        accepted = int(sum(per_pos_from_histogram(histogram))) if accepted is None else accepted
        drafts = sum(histogram) if drafts is None else drafts
    if accepted is None or drafts is None or spec.get("num_draft_tokens") is None:
        raise MalformedResponse(
            "the response's `metrics.speculative_decoding` lacks the step, drafted or accepted count "
            "(num_spec_steps, num_draft_tokens, num_accepted_draft_tokens) "
            "and has no acceptance_histogram to derive them from"
        )
    return SpecMeasurement(
        server_kind=VLLM,
        num_spec_tokens=spec.get("num_spec_tokens"),
        num_drafts=drafts,
        num_draft_tokens=int(spec["num_draft_tokens"]),
        num_accepted_tokens=accepted,
        acceptance_histogram=histogram,
        per_step_accepted=_ints(spec.get("per_step_accepted")),
        per_step_drafted=_ints(spec.get("per_step_drafted")),
        num_generated_tokens=completion_tokens,
    )


def parse_sglang(details: Mapping[str, Any], *, completion_tokens: int | None = None) -> SpecMeasurement:
    """SGLang's spec fields (``meta_info`` or ``sglext.spec_tokens_details``), converted to vLLM's tau.

    ``spec_correct_drafts_histogram`` has vLLM's layout (index = accepted drafts, bonus excluded). When
    ``spec_num_correct_drafts`` is absent, the accepted count is ``completion_tokens - 1 - verify_ct``
    (the prefill's token plus one bonus per step are the rest).
    """
    verify = int(details.get("spec_verify_ct") or 0)
    histogram = _ints(details.get("spec_correct_drafts_histogram") or None)
    correct = details.get("spec_num_correct_drafts")
    if correct is None and histogram is not None:
        correct = sum(per_pos_from_histogram(histogram))
    if correct is None and completion_tokens is not None and verify:
        correct = max(completion_tokens - 1 - verify, 0)
    proposed = details.get("spec_num_proposed_drafts")
    k = len(histogram) - 1 if histogram else None
    if proposed is None and k is not None:
        proposed = verify * k
    return SpecMeasurement(
        server_kind=SGLANG,
        num_spec_tokens=k,
        num_drafts=verify,
        num_draft_tokens=_count(proposed),
        num_accepted_tokens=int(correct or 0),
        acceptance_histogram=histogram,
        engine_tau=details.get("spec_accept_length"),
        num_generated_tokens=completion_tokens,
    )


def parse_llama_cpp(timings: Mapping[str, Any]) -> SpecMeasurement:
    """llama.cpp's ``timings.draft_n`` / ``draft_n_accepted``: drafted and accepted tokens, no step count."""
    return SpecMeasurement(
        server_kind=LLAMA_CPP,
        num_spec_tokens=None,
        num_drafts=None,
        num_draft_tokens=int(timings.get("draft_n") or 0),
        num_accepted_tokens=int(timings.get("draft_n_accepted") or 0),
        num_generated_tokens=_count(timings.get("predicted_n")),
    )


_SGLANG_KEYS = ("spec_verify_ct", "spec_num_correct_drafts", "spec_correct_drafts_histogram")


def _sglang_details(body: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """SGLang's fields of the body's one completion; None for several (a details list or choices of n > 1)."""
    choices = [choice for choice in body.get("choices") or [] if isinstance(choice, Mapping)]
    candidates = [body.get("meta_info"), (body.get("sglext") or {}).get("spec_tokens_details")]
    candidates += [choices[0].get("meta_info")] if len(choices) == 1 else []
    for candidate in candidates:
        if isinstance(candidate, list):  # sglext details are a list when n > 1
            candidate = candidate[0] if len(candidate) == 1 else None
        if isinstance(candidate, Mapping) and any(key in candidate for key in _SGLANG_KEYS):
            return candidate
    return None


def parse_response(body: Mapping[str, Any]) -> SpecMeasurement:
    """The speculative figures of one (non-streamed, n = 1) completion body, whichever engine sent it.

    Raises :class:`MissingMetrics` naming the flag that turns them on when the body has none, and
    :class:`MalformedResponse` when it has some but not enough to count steps and tokens.
    """
    usage_tokens = _count((body.get("usage") or {}).get("completion_tokens"))
    spec = (body.get("metrics") or {}).get("speculative_decoding")
    if isinstance(spec, Mapping):
        return parse_vllm(spec, completion_tokens=usage_tokens)
    details = _sglang_details(body)
    if details is not None:
        return parse_sglang(details, completion_tokens=usage_tokens or _count(details.get("completion_tokens")))
    timings = body.get("timings")
    if isinstance(timings, Mapping) and "draft_n" in timings:
        return parse_llama_cpp(timings)
    if isinstance(body.get("metrics"), Mapping) or isinstance(timings, Mapping):
        raise MissingMetrics(
            "the response has engine metrics but no speculative-decoding figures: the server is not "
            "speculating (start it with a draft: vLLM --speculative-config, SGLang --speculative-algorithm, "
            "llama.cpp -md DRAFT --spec-type)"
        )
    raise MissingMetrics(
        "the response carries no per-request speculative-decoding metrics; start vLLM with "
        "--per-request-spec-decode-metrics detailed (SGLang answers return_spec_tokens_details itself; "
        "llama.cpp reports timings.draft_n only while it drafts)",
        per_request_off=True,
    )


def step_rows(measurement: SpecMeasurement, output_ids: list[int] | None) -> list[StepRecord]:
    """The step records of ``steps.parquet`` from an engine's per-request figures (no timings: the engine keeps those).

    With vLLM's ``detailed`` arrays the rows are the real steps in order: the prefill commits the first
    output token, and each step commits its accepted drafts plus one token, so step s starts at
    ``position = 1 + sum(accepted + 1 for earlier steps)``; ``bonus_token`` is read from the output ids
    when the engine returned them. vLLM lists only the steps that drafted: a speculator that drafts when it
    finds something (n-gram lookup, suffix trees) also takes undrafted steps of one token each, and then
    the listed steps commit fewer tokens than the output holds; their order is known but not where they
    started, so they get ``position = -1`` (:func:`dflash_doctor.serving.agreement.place_steps` places
    them with the embedded proposer). With only a histogram the steps are real but their order is not
    known: they are listed by accepted count with ``position = -1``. llama.cpp gives no steps.
    """
    k = measurement.num_spec_tokens or 0
    rows: list[StepRecord] = []
    if measurement.per_step_accepted is not None:
        drafted = measurement.per_step_drafted or (k,) * len(measurement.per_step_accepted)
        committed = 1 + sum(n_accepted + 1 for n_accepted in measurement.per_step_accepted)
        if output_ids is not None and committed < len(output_ids):  # undrafted steps between the listed ones
            return [
                StepRecord(step=step, position=-1, k=k, num_drafted=n_drafted, num_accepted=n_accepted, bonus_token=-1)
                for step, (n_drafted, n_accepted) in enumerate(zip(drafted, measurement.per_step_accepted))
            ]
        position = 1
        for step, (n_drafted, n_accepted) in enumerate(zip(drafted, measurement.per_step_accepted)):
            bonus_at = position + n_accepted
            bonus = output_ids[bonus_at] if output_ids is not None and bonus_at < len(output_ids) else -1
            rows.append(
                StepRecord(
                    step=step, position=position, k=k, num_drafted=n_drafted, num_accepted=n_accepted, bonus_token=bonus
                )
            )
            position += n_accepted + 1
        return rows
    if measurement.acceptance_histogram is not None and measurement.num_drafts:
        # Drafts of varying length (llama.cpp's draft-simple stops early; every engine shortens the last ones)
        # are known only on average here; a step that accepted j tokens drafted at least j.
        per_step_drafted = (
            round(measurement.num_draft_tokens / measurement.num_drafts) if measurement.num_draft_tokens else k
        )
        for n_accepted, count in enumerate(measurement.acceptance_histogram):
            for _ in range(count):
                rows.append(
                    StepRecord(
                        step=len(rows),
                        position=-1,
                        k=k,
                        num_drafted=max(per_step_drafted, n_accepted),
                        num_accepted=n_accepted,
                        bonus_token=-1,
                    )
                )
    return rows


# ----------------------------------------------------------------------------------------------------
# The shape of every field the readers take from a completion body


class MalformedResponse(ServerError):
    """A completion body whose fields do not have the shape the engines document (a proxy, a fork, a
    corrupted answer): refused in one sentence instead of a traceback, or numbers no engine can have."""


_IDS = list[int] | None
_COUNT = int | None
# field -> declared type, per object of the body that the readers of this module and of
# serving/server_run.read_completion look into
_CHOICE_FIELDS = {
    "message": dict[str, Any] | None,
    "text": str | None,
    "token_ids": _IDS,
    "prompt_token_ids": _IDS,
    "finish_reason": str | None,
    "meta_info": dict[str, Any] | None,
}
_BODY_FIELDS = {
    "choices": list[dict[str, Any]] | None,
    "prompt_token_ids": _IDS,
    "usage": dict[str, Any] | None,
    "metrics": dict[str, Any] | None,
    "timings": dict[str, Any] | None,
    "meta_info": dict[str, Any] | None,
    "sglext": dict[str, Any] | None,
}
_NESTED_FIELDS = {
    "message": {"content": str | None},
    "usage": {"prompt_tokens": _COUNT, "completion_tokens": _COUNT},
    "speculative_decoding": {
        "num_accepted_draft_tokens": _COUNT,
        "num_spec_steps": _COUNT,
        "num_draft_tokens": _COUNT,
        "num_spec_tokens": _COUNT,
        "acceptance_histogram": _IDS,
        "per_step_accepted": _IDS,
        "per_step_drafted": _IDS,
    },
    "meta_info": {
        "output_token_ids": _IDS,
        "completion_tokens": _COUNT,
        "spec_verify_ct": _COUNT,
        "spec_num_correct_drafts": _COUNT,
        "spec_num_proposed_drafts": _COUNT,
        "spec_correct_drafts_histogram": _IDS,
        "spec_accept_length": float | None,
    },
    "timings": {"draft_n": _COUNT, "draft_n_accepted": _COUNT},
}


#: The largest count or token id a response may hold: no request generates, drafts or accepts 2**31 tokens
#: (context windows are a few million at most), and no vocabulary is that large; a larger one is a corrupted or
#: forged answer that would overflow the tables' integer columns.
MAX_COUNT = 2**31 - 1


def _out_of_range(value: Any) -> bool:
    """A count or id outside 0..MAX_COUNT, or a float that is not finite (JSON's 1e999 and NaN read as floats)."""
    if isinstance(value, (list, tuple)):
        return any(_out_of_range(item) for item in value)
    if isinstance(value, float):
        return not math.isfinite(value)
    return isinstance(value, int) and not 0 <= value <= MAX_COUNT


def _fields(where: str, obj: Mapping[str, Any], declared: Mapping[str, Any]) -> None:
    """Every declared field of ``obj`` has its type, and every number in it its range (see :data:`MAX_COUNT`)."""
    for key, expected in declared.items():
        wanted = type_error(obj.get(key), expected)
        if wanted is None and _out_of_range(obj.get(key)):
            wanted = "a finite number" if expected == float | None else f"a whole number from 0 to {MAX_COUNT}"
        if wanted is not None:
            raise MalformedResponse(
                f"the response's `{where}{key}` is {str(obj.get(key))[:60]!r}, but it must be {wanted}"
            )


def check_response_shape(body: Any) -> None:
    """Refuse a completion body with a field of the wrong shape, before any reader takes it (see
    :class:`MalformedResponse`); the caller turns it into one sentence naming the server."""
    if not isinstance(body, Mapping):
        raise MalformedResponse(f"the response is a JSON {type(body).__name__}, not a completion object")
    _fields("", body, _BODY_FIELDS)
    for index, choice in enumerate(body.get("choices") or []):
        _fields(f"choices[{index}].", choice, _CHOICE_FIELDS)
        for name in ("message", "meta_info"):
            _fields(f"choices[{index}].{name}.", choice.get(name) or {}, _NESTED_FIELDS[name])
    _fields("usage.", body.get("usage") or {}, _NESTED_FIELDS["usage"])
    _fields("meta_info.", body.get("meta_info") or {}, _NESTED_FIELDS["meta_info"])
    _fields("timings.", body.get("timings") or {}, _NESTED_FIELDS["timings"])
    spec = (body.get("metrics") or {}).get("speculative_decoding")
    if spec is not None:
        _fields("metrics.", body["metrics"], {"speculative_decoding": dict[str, Any]})
        _fields("metrics.speculative_decoding.", spec, _NESTED_FIELDS["speculative_decoding"])
    details = (body.get("sglext") or {}).get("spec_tokens_details")
    for index, item in enumerate(details if isinstance(details, list) else [details] if details is not None else []):
        if not isinstance(item, Mapping):
            raise MalformedResponse(
                f"the response's `sglext.spec_tokens_details` holds {str(item)[:60]!r}, not an object"
            )
        _fields(f"sglext.spec_tokens_details[{index}].", item, _NESTED_FIELDS["meta_info"])


def _impossible(m: SpecMeasurement) -> str | None:
    """What in ``m`` no engine can report, or None (see :func:`check_measurement`)."""
    counts = {
        "num_spec_tokens": m.num_spec_tokens,
        "steps": m.num_drafts,
        "drafted tokens": m.num_draft_tokens,
        "accepted tokens": m.num_accepted_tokens,
        "generated tokens": m.num_generated_tokens,
        "acceptance_histogram": m.acceptance_histogram,
        "per_step_accepted": m.per_step_accepted,
        "per_step_drafted": m.per_step_drafted,
    }
    for name, value in counts.items():
        items = value if isinstance(value, tuple) else (value,)
        if any(
            not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_COUNT for v in items if v is not None
        ):
            return f"{name} {str(value)[:60]}, outside the whole numbers 0..{MAX_COUNT}"
    k, accepted = m.num_spec_tokens, m.num_accepted_tokens
    if m.num_draft_tokens is not None and accepted > m.num_draft_tokens:
        return f"{accepted} accepted of {m.num_draft_tokens} drafted tokens"
    if m.num_drafts is not None and accepted > m.num_drafts * (k or MAX_COUNT):
        return f"{accepted} accepted tokens in {m.num_drafts} steps" + (f" of at most {k} drafts" if k else "")
    if m.per_step_accepted is not None and m.per_step_drafted is not None:
        if len(m.per_step_accepted) != len(m.per_step_drafted):
            return (
                f"{len(m.per_step_accepted)} per_step_accepted but {len(m.per_step_drafted)} per_step_drafted entries"
            )
        over = next(((a, d) for a, d in zip(m.per_step_accepted, m.per_step_drafted) if a > d), None)
        if over is not None:
            return f"a step that accepted {over[0]} of {over[1]} drafted tokens"
    steps = (*(m.per_step_accepted or ()), *(m.per_step_drafted or ()))
    if k and steps and max(steps) > k:
        return f"a step with {max(steps)} drafted or accepted tokens at num_spec_tokens {k}"
    return None


def check_measurement(measurement: SpecMeasurement) -> SpecMeasurement:
    """Refuse figures no engine can report, whichever way they were read (a response, /metrics deltas): every
    count a whole number in 0..:data:`MAX_COUNT`, no more tokens accepted than drafted (also of 0 drafted),
    none accepted beyond K per step (nor without a step), per-step arrays of equal length with no step
    accepting more than it drafted or than K. Nothing is repaired: an impossible figure is a
    :class:`MalformedResponse`, and ``tau = 1 + accepted / steps`` is then always in 1..K + 1."""
    problem = _impossible(measurement)
    if problem is not None:
        raise MalformedResponse(f"the response claims {problem}, which no engine can report")
    return measurement


def read_measurement(body: Any) -> SpecMeasurement:
    """The one reader of a server's speculative figures in a response body (``check --engine``'s answers,
    ``tune``'s final streamed chunk): its fields' types and ranges (:func:`check_response_shape`), then the
    figures (:func:`parse_response`), then what no engine can report (:func:`check_measurement`).
    :class:`MissingMetrics` when it carries none, :class:`MalformedResponse` for anything else wrong."""
    check_response_shape(body)
    return check_measurement(parse_response(body))
