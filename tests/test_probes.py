"""Probes on the replay's in-memory turns: work they share with the replay or with each other must give
the numbers a probe computing everything alone gives."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dflash_doctor.inputs.config import build_config
from dflash_doctor.engine.kernels import kernel_paths
from dflash_doctor.engine.teacher import TeacherSequence, slot_table
from dflash_doctor.models.loading import save_dflash_draft
from dflash_doctor.models.pair import load_pair
from dflash_doctor.replay import probes
from dflash_doctor.engine.live import plain_generate
from dflash_doctor.replay.probes import layer_offset_probe, lossless_probe, probe_turns
from dflash_doctor.rundir.run_record import LosslessProbe, RunMeta, RunRecord
from dflash_doctor.replay.stream import replay_teacher
from dflash_doctor.rundir.writer import RunWriter
from dflash_doctor.inputs.workloads import load_workload
from tiny_models import tiny_dflash, tiny_target, tiny_tokenizer, torch_threads, write_workload

MAX_NEW_TOKENS = 16
LAYER_IDS = (1, 2)  # of 4 target layers: offsets -1, 0 and +1 all exist


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    """A tiny pair (favoured tokens, so drafts are accepted) and its teacher-forced replay at the full block."""
    with torch_threads(1):
        root = tmp_path_factory.mktemp("probes")
        target = tiny_target()
        with torch.no_grad():
            target.lm_head.weight[75] *= 2.0  # the untrained draft leans to token 75: the target often agrees
        target.save_pretrained(root / "target")
        tiny_tokenizer().save_pretrained(root / "target")
        save_dflash_draft(tiny_dflash(target, block_size=6, layer_ids=LAYER_IDS), root / "dflash")
        config = build_config(
            target=str(root / "target"),
            draft=str(root / "dflash"),
            workload=str(write_workload(root / "workload.jsonl", per_class=1)),
            max_new_tokens=MAX_NEW_TOKENS,
        )
        pair = load_pair(config)
        requests = load_workload(config.workload, seed=config.seed)
        with RunWriter(root / "run", RunRecord(meta=RunMeta(command="sweep")).to_json()) as writer:
            replay = replay_teacher(
                pair,
                requests,
                ks=tuple(range(1, pair.default_k + 1)),
                max_new_tokens=MAX_NEW_TOKENS,
                temperature=0.0,
                seed=config.seed,
                exact_blocks=False,
                writer=writer,
            )
        yield pair, replay


def test_layer_offset_probe_equals_each_offset_drafted_alone(replayed):
    """One target forward tapping every offset's layers, and offset 0 read from the replay (whose anchors off the
    schedule hold only their matched runs), give the acceptance lengths over every anchor and the draft count of
    one target forward and one full drafting pass per offset."""
    pair, replay = replayed
    turns = probe_turns(replay.turns)
    assert set(replay.full_block_matches) >= {turn.key for turn in turns}
    expected: dict[int, float] = {}
    drafts_by_offset: dict[int, int] = {}
    for offset in (-1, 0, 1):
        draft = pair.kind.with_layer_ids(pair.draft_model, [layer + offset for layer in LAYER_IDS])
        proposer = pair.with_draft(draft).proposer
        drafts = accepted = 0
        for turn in turns:
            table, _ = slot_table(
                pair.target,
                proposer,
                TeacherSequence(turn.prompt_ids, turn.output_ids),
                pair.default_k,
                record_divergence=False,
            )
            for row in table.matches.tolist():  # every anchor drafts; its run ends at the first miss
                drafts += 1
                accepted += next((j for j, hit in enumerate(row) if not hit), len(row))
        expected[offset], drafts_by_offset[offset] = 1.0 + accepted / drafts, drafts
    assert expected[0] > 1.0 and expected[-1] != expected[0]  # drafts accepted, offsets told apart: a mix-up would show
    assert layer_offset_probe(pair, turns, replay.full_block_matches) == (expected, drafts_by_offset[0])
    assert layer_offset_probe(pair, turns) == (expected, drafts_by_offset[0])


def test_lossless_probe_decodes_unbatched_only_where_the_live_loop_differs_from_the_batched_answer(
    replayed, monkeypatch
):
    """Equal to the replay's batched answer: identical, no decoding. Different from it: an unbatched
    decoding arbitrates (a padding near-tie is no loss); different from both: a divergence against it."""
    pair, replay = replayed
    turns = probe_turns(replay.turns)
    decoded = []
    monkeypatch.setattr(
        probes, "plain_generate", lambda *args, **kwargs: decoded.append(1) or plain_generate(*args, **kwargs)
    )
    k = pair.default_k

    assert lossless_probe(pair, turns, k, "float32") == LosslessProbe(
        num_requests=len(turns), num_identical=len(turns), dtype="float32", kernels=kernel_paths(pair.target.model)
    )
    assert decoded == []  # the live loop reproduced every batched answer: nothing decoded again

    flipped = [
        dataclasses.replace(
            t, result=dataclasses.replace(t.result, output_ids=[t.output_ids[0] + 1, *t.output_ids[1:]])
        )
        for t in turns
    ]
    probe = lossless_probe(pair, flipped, k, "float32")
    assert (probe.num_identical, probe.divergences, len(decoded)) == (
        len(turns),
        [],
        len(turns),
    )  # unbatched decoding agreed

    live_generate = probes.speculative_generate

    def broken(*args, **kwargs):  # an engine that loses the fourth token
        result = live_generate(*args, **kwargs)
        result.output_ids[3] = (result.output_ids[3] + 1) % pair.target.model.config.vocab_size
        return result

    monkeypatch.setattr(probes, "speculative_generate", broken)
    probe = lossless_probe(pair, turns[:1], k, "float32")
    assert probe.num_identical == 0 and [d.position for d in probe.divergences] == [3]
    assert probe.divergences[0].plain_token == turns[0].output_ids[3] and probe.divergences[0].top2_margin > 0
