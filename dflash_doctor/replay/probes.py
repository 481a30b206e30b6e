"""Probes: measurements beyond the replay that the checks judge, run on the replay's in-memory turns.

* :func:`lossless_probe`: the live speculative loop must reproduce the target's own unbatched greedy
  decoding token for token; the first divergence is reported with the target's top-2 logit margin.
* :func:`layer_offset_probe`: acceptance length with the draft's target layer ids shifted by -1, 0, +1
  (docs/draft-formats.md); only for draft kinds that read target layers (declared in the draft-kind registry).

Both reuse the prompts and the target's answers of the replay's first turns: nothing is re-encoded or
read back from the run directory.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from dflash_doctor.engine.live import plain_generate, speculative_generate
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
    top-2 logit margin at the first differing token.
    """
    probe = LosslessProbe(num_requests=0, num_identical=0, dtype=dtype)
    for turn in turns:
        prompt = torch.tensor(turn.prompt_ids, device=pair.target.device)
        live = speculative_generate(
            pair.target,
            pair.proposer,
            prompt,
            k=k,
            max_new_tokens=turn.max_new_tokens,
            stop_ids=pair.stop_ids,
            record_tokens=False,
        ).output_ids
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
        probe.divergences.append(
            Divergence(
                request_id=turn.key,
                position=position,
                speculative_token=live[position] if position < len(live) else -1,
                plain_token=plain[position] if position < len(plain) else -1,
                speculative_text=pair.decode_token(live[position]) if position < len(live) else "",
                plain_text=pair.decode_token(plain[position]) if position < len(plain) else "",
                top2_margin=float(top2[0] - top2[1]),
                top1_logit=float(top2[0]),
            )
        )
    return probe


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
