"""The suffix speculator: vLLM's suffix decoding (Arctic Inference's rule), the live loop and the teacher-forced
replay against an independent reference written here from the rule: occurrence counts kept per token string
(a dict of tuples, not a tree), the sibling order of equal counts as the engine moves children, float32 scores."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from cli_helpers import assert_usage_error, invoke, pair_args
from dflash_doctor.engine.live import plain_generate, speculative_generate
from dflash_doctor.engine.proposers.suffix import SuffixProposer, SuffixSettings, SuffixTree, candidates, choose
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.engine.teacher import TeacherSequence, slot_table, walk_schedule
from dflash_doctor.errors import UsageError
from dflash_doctor.models.draft_kinds import weightless_kind
from tiny_models import VOCAB, tiny_target

F32 = np.float32


class ReferenceTree:
    """Counts of every string of at most ``depth`` tokens, keyed by the string; children of a string in the
    engine's order: new ones last; on +1 to the front of the new count's class if the child led its old
    class, else to its back; on -1 to the front of the new class; gone at 0."""

    def __init__(self, depth: int):
        self.depth = depth
        self.count: Counter[tuple[int, ...]] = Counter()
        self.kids: dict[tuple[int, ...], list[int]] = {}
        self.seqs: dict[int, list[int]] = {}

    def _up(self, s: tuple[int, ...]) -> None:
        parent, token, old = s[:-1], s[-1], self.count[s]
        kids = self.kids.setdefault(parent, [])
        self.count[s] = old + 1
        if old == 0:
            kids.append(token)
            return
        i = kids.index(token)
        led = i == 0 or self.count[parent + (kids[i - 1],)] != old
        kids.pop(i)
        bound = old + 1 if led else old  # insert before the first sibling whose count is <= bound
        j = next((n for n, t in enumerate(kids) if self.count[parent + (t,)] <= bound), len(kids))
        kids.insert(j, token)

    def _down(self, s: tuple[int, ...]) -> bool:
        parent, token, old = s[:-1], s[-1], self.count[s]
        kids = self.kids[parent]
        kids.remove(token)
        self.count[s] = old - 1
        if old == 1:  # the string and everything under it are gone
            for key in [key for key in self.count if key[: len(s)] == s]:
                del self.count[key]
                self.kids.pop(key, None)
            return False
        j = next((n for n, t in enumerate(kids) if self.count[parent + (t,)] < old), len(kids))
        kids.insert(j, token)
        return True

    def append(self, seq_id: int, token: int) -> None:
        seq = self.seqs.setdefault(seq_id, [])
        seq.append(token)
        for start in range(max(0, len(seq) - self.depth), len(seq)):
            self._up(tuple(seq[start:]))

    def remove(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id)
        for start in range(len(seq)):
            for end in range(start + 1, min(start + self.depth, len(seq)) + 1):
                if not self._down(tuple(seq[start:end])):
                    break

    def draft(self, pattern: list[int], budget: int, factor: float, min_prob: float) -> tuple[F32, int, list[int]]:
        """(score, match length, tokens): every match length below len(pattern) until one is absent."""
        best: tuple[F32, int, list[int]] = (F32(0), 0, [])
        for m in range(1, len(pattern)):
            node = tuple(pattern[-m:])
            if self.count[node] == 0:
                break
            cap = max(min(budget, int(float(F32(m) * F32(factor)) + 1e-6)), 0)
            prob, score, tokens = F32(1), F32(0), []
            while len(tokens) < cap and self.kids.get(node):
                child = node + (self.kids[node][0],)
                prob = F32(prob * (F32(self.count[child]) / F32(self.count[node])))
                if prob < F32(min_prob):
                    break
                tokens.append(child[-1])
                score = F32(score + prob)
                node = child
            if score >= best[0]:
                best = (score, m, tokens)
        return best


class ReferenceEngine:
    """vLLM's suffix proposer over Arctic Inference's cache, requests one after another."""

    def __init__(self, settings: SuffixSettings):
        self.s = settings
        self.global_tree = ReferenceTree(settings.max_tree_depth)
        self.fifo: list[int] = []
        self.next_id = 0

    def start(self, prompt: list[int]) -> None:
        self.local = ReferenceTree(self.s.max_tree_depth)
        for t in prompt:
            self.local.append(0, t)
        self.seq = None
        if self.s.max_cached_requests:
            self.seq, self.next_id = self.next_id, self.next_id + 1
            self.fifo.append(self.seq)
            while len(self.fifo) > self.s.max_cached_requests:
                old = self.fifo.pop(0)
                if old in self.global_tree.seqs:
                    self.global_tree.remove(old)

    def add(self, tokens: list[int]) -> None:
        for t in tokens:
            self.local.append(0, t)
            if self.seq is not None:
                self.global_tree.append(self.seq, t)

    def speculate(self, context: list[int], k: int) -> list[int]:
        budget = k if self.s.max_model_len is None else max(min(k, self.s.max_model_len - len(context) - 1), 0)
        pattern = context[-self.s.max_tree_depth :]
        local = self.local.draft(pattern, budget, self.s.max_spec_factor, self.s.min_token_prob)
        other = self.global_tree.draft(pattern, budget, self.s.max_spec_factor, self.s.min_token_prob)
        return local[2] if local[0] >= other[0] else other[2]


def reference_run(
    engine: ReferenceEngine, prompt: list[int], truth: list[int], k: int, max_new: int
) -> list[tuple[int, int, int]]:
    """vLLM's greedy loop over the target's own greedy text: (position, drafted, accepted) per step; the
    proposal is drafted at K and the step uses what fits the budget."""
    engine.start(prompt)
    engine.add(truth[:1])
    steps, i = [], 0
    while i + 1 < max_new and i + 1 < len(truth):
        proposal = engine.speculate(prompt + truth[: i + 1], k)[: min(k, max_new - (i + 1) - 1)]
        accepted = 0
        while (
            accepted < len(proposal) and i + 1 + accepted < len(truth) and proposal[accepted] == truth[i + 1 + accepted]
        ):
            accepted += 1
        steps.append((i + 1, len(proposal), accepted))
        engine.add(truth[i + 1 : i + accepted + 2])
        i += accepted + 1
    engine.add(truth[i + 1 :])  # only when the loop stopped early; vLLM adds what the last step sampled
    return steps


# ------------------------------------------------------------------------------------------- the tree rule


def test_tie_order_and_probabilities_by_hand():
    settings = SuffixSettings(max_tree_depth=4, min_token_prob=0.0)
    tree = SuffixTree(4)
    tree.extend(0, [1, 2, 1, 3])
    # "1" is followed once by 2 and once by 3: equal counts keep insertion order, and the trailing "3" ends there
    local = candidates(tree, [9, 1], settings)
    assert [c.tokens for c in local] == [[2]]
    assert float(local[0].scores[1]) == pytest.approx(0.5)
    tree.extend(0, [1, 3])  # 3's count rises past 2's
    assert candidates(tree, [9, 1], settings)[0].tokens == [3]
    tree.extend(0, [1, 2])  # 2 catches up; it led its class (alone at 1), so it goes to the front of the new one
    assert candidates(tree, [9, 1], settings)[0].tokens == [2]
    tree = SuffixTree(4)
    tree.extend(0, [1, 5, 1, 6, 1, 7])  # 5, 6, 7 at count 1, in that order
    tree.extend(0, [1, 5])  # 5 led its class: front of class 2 -> 5, 6, 7
    tree.extend(0, [1, 7])  # 7 did not lead (6 is ahead at 1): back of class 2 -> 5, 7, 6
    assert candidates(tree, [9, 1], settings)[0].tokens == [5]
    tree.extend(0, [1, 6])  # 6 led class 1: front of class 2 -> 6, 5, 7
    assert candidates(tree, [9, 1], settings)[0].tokens == [6]
    assert [c.token for c in tree.find([1]).order or []] == [6, 5, 7]


@pytest.mark.parametrize("seed", range(6))
def test_tree_equals_the_reference_on_random_sequences(seed):
    rng = np.random.default_rng(seed)
    depth = int(rng.integers(2, 7))
    settings = SuffixSettings(
        max_tree_depth=depth,
        max_spec_factor=float(rng.choice([0.5, 1.0, 2.0])),
        min_token_prob=float(rng.choice([0.0, 0.1, 0.3])),
    )
    tree, ref = SuffixTree(depth), ReferenceTree(depth)
    for step in range(300):
        if rng.random() < 0.05 and len(tree.sequences) > 1:
            victim = sorted(tree.sequences)[0]
            tree.remove(victim)
            ref.remove(victim)
            continue
        seq_id = int(rng.integers(0, 4))
        token = int(rng.integers(0, 4))
        tree.append(seq_id, token)
        ref.append(seq_id, token)
        pattern = rng.integers(0, 4, size=int(rng.integers(1, depth + 2))).tolist()
        budget = int(rng.integers(0, 8))
        got = choose(candidates(tree, pattern, settings), [], budget)
        want = ref.draft(pattern, budget, settings.max_spec_factor, settings.min_token_prob)
        assert got == want[2], (step, pattern, budget)


# ------------------------------------------------------------------------------------------- the loops

PROMPTS = [
    [5, 17, 42, 8, 9, 5, 17, 42, 8, 9, 5, 17],
    [11, 12, 13, 11, 12],
    [60, 61, 62, 63, 64, 65, 66, 67],
    [5, 17, 42, 8, 9, 5, 17, 42, 8, 9, 5, 17],
]
SETTINGS = [
    SuffixSettings(),
    SuffixSettings(max_tree_depth=6, max_cached_requests=1, max_spec_factor=2.0, min_token_prob=0.2),
    SuffixSettings(max_cached_requests=0, max_spec_factor=0.5, min_token_prob=0.0),
]


@pytest.fixture(scope="module")
def target_model():
    return tiny_target()


@pytest.mark.parametrize("settings", SETTINGS, ids=["defaults", "small", "no-global"])
def test_live_loop_and_teacher_equal_the_reference_across_requests(target_model, settings):
    max_new = 40
    truths = [
        plain_generate(TargetModel(target_model), torch.tensor(p), max_new_tokens=max_new).output_ids for p in PROMPTS
    ]
    drafted_any = 0
    for k in (1, 3, 8):
        live_proposer, teacher_proposer = SuffixProposer(settings, VOCAB), SuffixProposer(settings, VOCAB)
        reference = ReferenceEngine(settings)
        for prompt, truth in zip(PROMPTS, truths):  # one proposer over the requests, in order: the global tree carries
            live = speculative_generate(
                TargetModel(target_model), live_proposer, torch.tensor(prompt), k=k, max_new_tokens=max_new
            )
            live_proposer.finish_request(prompt, live.output_ids)
            assert live.output_ids == truth  # lossless: the target's own greedy text
            expected = reference_run(reference, prompt, truth, k, max_new)
            assert [(s.position, s.num_drafted, s.num_accepted) for s in live.steps] == expected, (prompt, k)
            # teacher forcing: two passes over one request (as a sweep runs one per K) see the same trees
            for bk in (8, k):
                table, _ = slot_table(TargetModel(target_model), teacher_proposer, TeacherSequence(prompt, truth), bk)
            teacher_proposer.finish_request(prompt, truth)
            walked = walk_schedule(table.matches[:, :k], truth, k, max_new, frozenset(), drafted=table.drafted)
            assert [(s.position, s.num_drafted, s.num_accepted, s.bonus_token) for s in walked] == [
                (s.position, s.num_drafted, s.num_accepted, s.bonus_token) for s in live.steps
            ], (prompt, k)
            for r in live.tokens:
                assert r.draft_prob_of_target == (1.0 if r.draft_token == r.target_token else 0.0)
            drafted_any += sum(s.num_drafted for s in live.steps)
    assert drafted_any > 0


def test_the_global_tree_carries_earlier_responses_in_order(target_model):
    prompt, max_new, k = PROMPTS[2], 40, 8
    truth = plain_generate(TargetModel(target_model), torch.tensor(prompt), max_new_tokens=max_new).output_ids

    def accepted(settings: SuffixSettings, requests: int) -> list[int]:
        proposer, out = SuffixProposer(settings, VOCAB), []
        for _ in range(requests):
            result = speculative_generate(
                TargetModel(target_model), proposer, torch.tensor(prompt), k=k, max_new_tokens=max_new
            )
            proposer.finish_request(prompt, result.output_ids)
            out.append(sum(s.num_accepted for s in result.steps))
        return out

    first, second = accepted(SuffixSettings(), 2)
    alone, again = accepted(SuffixSettings(max_cached_requests=0), 2)
    assert first == alone == again  # without a global tree each request sees only its own text
    assert second > first  # the same request again finds its earlier answer in the global tree
    assert len(truth) > 2


def test_teacher_request_with_one_token_enters_the_global_tree():
    settings = SuffixSettings(min_token_prob=0.0)
    proposer = SuffixProposer(settings, VOCAB)
    proposer.prepare_teacher(torch.tensor([4, 5, 6]), None)  # a one-token answer: no anchor, no proposal asked
    proposer.finish_request([4, 5], [6])
    assert proposer.cache.global_tree.sequences == {0: [6]}


# ------------------------------------------------------------------------------------------- settings and the CLI


def test_settings_parse_with_vllm_names_and_defaults():
    kind, raw = weightless_kind("suffix")
    assert kind.name == "suffix" and raw == {}
    config = type("Config", (), {"vocab_size": VOCAB, "max_position_embeddings": 512})()
    module = kind.from_spec(raw, Path("."), config, type("O", (), {"device": "cpu"})())
    assert module.settings == SuffixSettings(24, 10000, 1.0, 0.1, 512)
    _, raw = weightless_kind(
        "suffix:suffix_decoding_max_tree_depth=8,max_spec_factor=2,suffix_decoding_min_token_prob=0"
    )
    assert kind.from_spec(raw, Path("."), config, type("O", (), {"device": "cpu"})()).settings == SuffixSettings(
        8, 10000, 2.0, 0.0, 512
    )


@pytest.mark.parametrize(
    "spec,fragment",
    [
        ("suffix:suffix_decoding_max_tree_depth=0", "suffix_decoding_max_tree_depth=0 must be in [1, "),
        ("suffix:suffix_decoding_max_cached_requests=-1", "must be in [0, "),
        ("suffix:suffix_decoding_max_spec_factor=-0.5", "must be in [0, "),
        ("suffix:suffix_decoding_min_token_prob=1.5", "must be in [0, 1]"),
        ("suffix:suffix_decoding_max_tree_depth=2.5", "is not a whole number"),
        ("suffix:suffix_decoding_min_token_prob=nan", "is not a decimal number"),
        ("suffix:depth=3", "unknown setting 'depth'"),
    ],
)
def test_bad_settings_are_one_sentence(spec, fragment):
    with pytest.raises(UsageError) as error:  # refused where the string is read, before any model
        weightless_kind(spec)
    assert fragment in str(error.value)


def test_cli_refuses_a_bad_setting_with_exit_2(tiny_dir):
    result = invoke("replay", *pair_args(tiny_dir, "suffix:suffix_decoding_min_token_prob=2", "--k", "2"))
    assert_usage_error(result, "suffix_decoding_min_token_prob")


def test_head_to_head_accepts_suffix_and_its_sweep_is_exact_for_every_k(tiny_dir, tmp_path):
    profile = tmp_path / "costs.json"
    profile.write_text(
        '{"t_decode_s": 0.010, "t_verify_s": {"1": 0.011, "8": 0.016}, "t_draft_s": {"1": 0.001, "8": 0.004}}'
    )
    result = invoke(
        "check",
        *pair_args(
            tiny_dir,
            "ngram:prompt_lookup_min=1,prompt_lookup_max=3",
            "--draft",
            "suffix:suffix_decoding_min_token_prob=0.05",
            "--k",
            "1-4",
            "--cost-profile",
            str(profile),
            "--out",
            tmp_path / "run",
            "--json",
        ),
    )
    assert result.exit_code in (0, 1), result.output
    data = json.loads(result.stdout[result.stdout.index("{") :])
    assert [s["name"] for s in data["head_to_head"]["speculators"]] == ["ngram", "suffix"]
    run = json.loads((tmp_path / "run" / "suffix" / "run.json").read_text())
    assert run["models"]["draft"]["suffix_decoding_min_token_prob"] == 0.05
    assert run["models"]["draft"]["suffix_decoding_max_tree_depth"] == 24
    rows = run["summary"]["sweep"]["overall"]
    assert len(rows) > 1 and {r["estimate"] for r in rows} == {"exact"}


def test_replay_and_sweep_agree_step_for_step_over_the_workload(tiny_dir, tmp_path):
    """The live loop (replay) and the teacher-forced sweep carry the global tree over the same request order."""
    import pandas as pd

    for command in ("replay", "sweep"):
        result = invoke(
            command,
            *pair_args(tiny_dir, "suffix:suffix_decoding_min_token_prob=0.05", "--k", "3", "--out", tmp_path / command),
        )
        assert result.exit_code == 0, result.output
    columns = ["request_id", "position", "num_drafted", "num_accepted", "bonus_token"]
    live = pd.read_parquet(tmp_path / "replay" / "steps.parquet")[columns]
    teacher = pd.read_parquet(tmp_path / "sweep" / "steps.parquet")[columns]
    assert live.reset_index(drop=True).equals(teacher.reset_index(drop=True))
    assert live["num_accepted"].sum() > 0


def test_a_replay_split_over_ranks_is_refused(tiny_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    result = invoke("replay", *pair_args(tiny_dir, "suffix", "--k", "2", "--out", str(tmp_path / "run")))
    assert_usage_error(result, "suffix speculator remembers earlier requests", "one process")
