"""Probes: measurements beyond the replay that the checks judge, run on the replay's in-memory turns.

* :func:`lossless_probe`: the live speculative loop must reproduce the target's own unbatched greedy
  decoding token for token; the first divergence is reported with the target's top-2 logit margin.
* :func:`layer_offset_probe`: acceptance length with the draft's target layer ids shifted by -1, 0, +1
  (docs/draft-formats.md); only for draft kinds that read target layers (declared in the draft-kind registry).

Both reuse the prompts and the target's answers of the replay's first turns: nothing is re-encoded or
read back from the run directory.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch

from dflash_doctor.engine.kernels import kernel_paths
from dflash_doctor.engine.live import plain_generate, speculative_generate
from dflash_doctor.engine.step_records import StepRecord
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.engine.teacher import TeacherSequence, matched_runs, slot_table
from dflash_doctor.models.pair import Pair
from dflash_doctor.rundir.run_record import Divergence, LosslessProbe
from dflash_doctor.replay.turns import Turn

NUM_PROBE_REQUESTS = 3  # first turns replayed again for the lossless check and the layer-offset probe


def probe_turns(turns: Sequence[Turn], limit: int = NUM_PROBE_REQUESTS) -> list[Turn]:
    """The first ``limit`` first turns of the replay."""
    return [t for t in turns if t.index == 0][:limit]


@torch.inference_mode()
def lossless_probe(pair: Pair, turns: Sequence[Turn], k: int, dtype: str) -> LosslessProbe:
    """The live loop at ``k`` against the target's plain greedy decoding on ``turns`` (temperature 0).

    A turn is identical when the live output equals a plain greedy decoding of its prompt token for
    token: the replay's batched answer (``turn.output_ids``, decoded already) or, only where the live
    output differs from that, an unbatched decoding, decoded here to arbitrate. The left padding of a
    batch can flip a near-tie that batch-1 decoding does not, so a mismatch with the batched answer alone
    is no evidence of loss; a divergence is reported against the unbatched decoding, with the target's
    top-2 logit margin at the first differing token and both kernel paths' scores there
    (:func:`kernel_path_evidence`). The kernels the target runs (:func:`~dflash_doctor.engine.kernels.kernel_paths`)
    are recorded with the probe.
    """
    probe = LosslessProbe(num_requests=0, num_identical=0, dtype=dtype, kernels=kernel_paths(pair.target.model))
    for turn in turns:
        prompt = torch.tensor(turn.prompt_ids, device=pair.target.device)
        result = speculative_generate(
            pair.target,
            pair.proposer,
            prompt,
            k=k,
            max_new_tokens=turn.max_new_tokens,
            stop_ids=pair.stop_ids,
            record_tokens=False,
        )
        live = result.output_ids
        probe.num_requests += 1
        if live == turn.output_ids:
            probe.num_identical += 1
            continue
        plain = plain_generate(
            pair.target, prompt, max_new_tokens=turn.max_new_tokens, stop_ids=pair.stop_ids
        ).output_ids
        if live == plain:
            probe.num_identical += 1
            continue
        position = next(i for i, (a, b) in enumerate(zip(live + [-1], plain + [-1])) if a != b)
        pair.target.reset()
        context = torch.cat([prompt, torch.tensor(plain[:position], device=prompt.device)])
        logits = pair.target.forward(context, taps=(), logits_from=len(context) - 1).logits[-1]
        pair.target.reset()
        top2 = logits.topk(2).values
        divergence = Divergence(
            request_id=turn.key,
            position=position,
            speculative_token=live[position] if position < len(live) else -1,
            plain_token=plain[position] if position < len(plain) else -1,
            speculative_text=pair.decode_token(live[position]) if position < len(live) else "",
            plain_text=pair.decode_token(plain[position]) if position < len(plain) else "",
            top2_margin=float(top2[0] - top2[1]),
            top1_logit=float(top2[0]),
        )
        lengths = verify_forwards(result.steps, position)
        if lengths is not None and position < min(len(live), len(plain)):
            tokens = plain[:position] + live[position:]  # the committed prefix, then what the live loop fed after it
            divergence = kernel_path_evidence(divergence, pair.target, prompt, tokens, lengths)
        probe.divergences.append(divergence)
    return probe


def verify_forwards(steps: Sequence[StepRecord], position: int) -> list[int] | None:
    """The lengths of the live loop's forwards over its output tokens, after the prefill, up to the one that
    scored output ``position``: each earlier step's committed tokens (what its forward left in the cache once
    the rejected drafts were rolled back out: a recurrent layer re-runs them through the same kernel a forward
    of that length calls), then that step's whole block (the last committed token and its drafts). None where
    the live loop left no steps to follow."""
    scoring = [s for s in steps if s.position <= position]
    if not scoring:
        return None
    return [b.position - a.position for a, b in zip(scoring, scoring[1:])] + [scoring[-1].num_drafted + 1]


@torch.inference_mode()
def rescore(
    target: TargetModel, prompt: torch.Tensor, tokens: Sequence[int], lengths: Sequence[int], position: int
) -> torch.Tensor:
    """The target's logits [V] for output token ``position``: the prompt prefilled, then ``tokens`` (the output
    from its first token on) fed in forwards of ``lengths`` tokens until one scores that position (row ``i`` of
    a forward starting at output token ``start`` scores output token ``start + i + 1``). All ones is plain
    decoding's path, :func:`verify_forwards` the live loop's; nothing is rolled back on either, so a rollback
    defect shows in neither."""
    target.reset()
    row = target.forward(prompt, taps=(), logits_from=len(prompt) - 1).logits[-1]
    start = 0
    for length in lengths:
        if position <= start:
            break
        out = target.forward(torch.tensor(list(tokens[start : start + length]), device=prompt.device), taps=())
        if position <= start + length:
            row = out.logits[position - start - 1]
        start += length
    target.reset()
    if start < position:
        raise ValueError(f"forwards of {start} output tokens do not reach output token {position}")
    return row


def kernel_path_evidence(
    divergence: Divergence, target: TargetModel, prompt: torch.Tensor, tokens: Sequence[int], lengths: Sequence[int]
) -> Divergence:
    """``divergence`` with its position scored both ways on the same committed prefix (``tokens`` up to it, then
    what the live loop fed after it): through the verify path (the live loop's multi-token forwards,
    ``lengths``) and through the decode path (one token per forward, as plain decoding did); each path's top-2
    tokens and margin, and the largest difference between the two paths' logits there. On a hybrid target
    the two paths run different recurrent kernels (chunked and recurrent); where they part as the outputs did,
    or disagree by the margin, the divergence is the kernels' numerics, not the engine's doing."""
    position = divergence.position
    verify = rescore(target, prompt, tokens, lengths, position)
    decode = rescore(target, prompt, tokens, [1] * position, position)
    (verify_values, verify_ids), (decode_values, decode_ids) = verify.topk(2), decode.topk(2)
    return dataclasses.replace(
        divergence,
        verify_top2=verify_ids.tolist(),
        verify_margin=float(verify_values[0] - verify_values[1]),
        decode_top2=decode_ids.tolist(),
        decode_margin=float(decode_values[0] - decode_values[1]),
        path_disagreement=float((verify - decode).abs().max()),
    )


@torch.inference_mode()
def layer_offset_probe(
    pair: Pair, turns: Sequence[Turn], matches_at_zero: dict[str, np.ndarray] | None = None
) -> tuple[dict[int, float], int] | None:
    """Mean acceptance length (accepted run + 1, T = 0, the full block) over every anchor of the turns'
    outputs with the draft's target layer ids shifted by -1, 0 and +1, and the number of drafts behind
    offset 0's figure (so the check can tell a verdict from noise). None for a draft kind that reads no
    target layers.

    A draft trained on layers ``l`` reads the right features only at offset 0; a neighbour beating it
    means the configured ids are off by one (vLLM PR #42704, llama.cpp #25792). Every anchor, not only
    the ~1/tau of them a live schedule drafts from: the teacher-forced table holds every anchor's run
    anyway, the offsets are compared at the same anchors, and a good draft reads neighbouring layers
    almost as well as its own, so a short run needs the larger sample to tell them apart (an earlier demo
    draft: offsets -1 and 0 tied at 1.90 over the schedule of 3 requests x 64 tokens).

    One target forward per turn taps every layer the three offsets read (each offset's features are
    columns of it, the same numbers a forward of its own would give). ``matches_at_zero``: the replay's
    full-block greedy matches by turn key (:attr:`dflash_doctor.replay.stream.Replay.full_block_matches`);
    offset 0 is the configured draft, so a turn found there is not drafted again.
    """
    kind = pair.kind
    if kind.layer_ids is None or kind.with_layer_ids is None:
        return None
    layer_ids = kind.layer_ids(pair.draft_model)
    num_layers = pair.target.model.config.num_hidden_layers
    k = pair.default_k
    offsets = [o for o in (-1, 0, 1) if min(layer_ids) + o >= 0 and max(layer_ids) + o < num_layers]
    proposers = {
        o: pair.with_draft(kind.with_layer_ids(pair.draft_model, [layer + o for layer in layer_ids])).proposer
        for o in offsets
    }
    taps = sorted({i for proposer in proposers.values() for i in proposer.needs.hidden_state_indices})
    drafts = dict.fromkeys(offsets, 0)
    accepted = dict.fromkeys(offsets, 0)
    for turn in turns:
        sequence = TeacherSequence(turn.prompt_ids, turn.output_ids)
        reused = (matches_at_zero or {}).get(turn.key)
        if reused is not None and reused.shape[1] != k:
            reused = None
        pair.target.reset()
        out = pair.target.forward(
            torch.tensor(turn.prompt_ids + turn.output_ids, device=pair.target.device),
            taps=tuple(taps),
            logits_from=len(turn.prompt_ids),
        )
        pair.target.reset()
        tapped = out.features
        if tapped is None:  # a forward given taps always returns their features; this narrows the type
            raise RuntimeError("the target forward returned no hidden states for the layer-offset probe's taps")
        width = tapped.shape[-1] // len(taps)
        column = {tap: tapped[:, n * width : (n + 1) * width] for n, tap in enumerate(taps)}
        for offset in offsets:
            if offset != 0 or reused is None:
                proposer = proposers[offset]
                features = torch.cat([column[tap] for tap in proposer.needs.hidden_state_indices], dim=-1)
                table, _ = slot_table(
                    pair.target,
                    proposer,
                    sequence,
                    k,
                    record_divergence=False,
                    full_anchors=lambda matches: (),
                    target_pass=(out.logits, features),
                )
                matches = table.matches
            else:
                matches = reused
            runs = matched_runs(matches)  # one per anchor
            drafts[offset] += len(runs)
            accepted[offset] += int(runs.sum())
    lengths = {o: 1.0 + accepted[o] / drafts[o] if drafts[o] else float("nan") for o in offsets}
    return lengths, drafts.get(0, 0)
