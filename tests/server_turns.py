"""A server's answered turn made from the embedded live loop: the stand-in servers of the agreement tests.

The embedded loop, run with a known (configured or deliberately mis-set) draft, gives the steps a server
would list; :func:`engine_turn` wraps them as a :class:`ServerTurn` the way a vLLM response with per-request
step metrics is parsed, so the comparison machinery meets them exactly as it meets a real server's.
"""

from __future__ import annotations

from dflash_doctor.inputs.workloads import Request
from dflash_doctor.serving.responses import SpecMeasurement, step_rows
from dflash_doctor.serving.server_run import ServerTurn


class LocalStops:
    """The one part of a loaded pair that ``compare_turn`` reads: its stop ids."""

    def __init__(self, stop_ids):
        self.stop_ids = stop_ids


def engine_turn(request_id, prompt, result, k) -> ServerTurn:
    """The live loop's ``result`` for ``prompt`` as a server at ``k`` reports it (vLLM's per-step arrays)."""
    accepted = [s.num_accepted for s in result.steps]
    measurement = SpecMeasurement(
        "vllm",
        k,
        len(accepted),
        sum(s.num_drafted for s in result.steps),
        sum(accepted),
        per_step_accepted=tuple(accepted),
        per_step_drafted=tuple(s.num_drafted for s in result.steps),
    )
    return ServerTurn(
        request=Request(id=request_id, prompt="x"),
        turn=0,
        output_text="",
        output_token_ids=result.output_ids,
        prompt_token_ids=prompt,
        prompt_num_tokens=len(prompt),
        num_output_tokens=len(result.output_ids),
        stop_reason=result.stop_reason,
        measurement=measurement,
        wall_time_s=0.0,
        steps=step_rows(measurement, result.output_ids),
    )
