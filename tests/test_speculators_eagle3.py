"""The eagle3 speculator: EAGLE-3 heads drafted as vLLM drafts them, checked against an independent reference
written here from vLLM's rule (no cache: every draft step recomputes the head's layer over the whole prefix,
with its own RMSNorm, RoPE and attention read from the saved tensors by name), the target's own greedy text,
the teacher-forced sweep, both checkpoint layouts, the refusals, the CLI and the eagle3 checks.

The heads are tiny and built in-process; the main one is trained for a moment on the tiny target's own
greedy text (slot 1 only) so that drafts are often accepted and acceptance counts mean something."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from cli_helpers import assert_usage_error, invoke, pair_args
from eagle3_heads import speculators_layout_config
from dflash_doctor.engine.eagle3_model import Eagle3Config, Eagle3DraftModel, NormSwitches
from dflash_doctor.engine.live import speculative_generate
from dflash_doctor.engine.proposers.eagle3 import Eagle3Proposer
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.engine.teacher import TeacherSequence, slot_table, token_rows, walk_schedule
from dflash_doctor.models.eagle3_format import (
    VLLM_DEFAULT,
    aux_layer_ids,
    checkpoint_layout,
    load_eagle3_head,
    norm_switches,
)
from tiny_models import TEACHER_PROMPTS, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

AUX_IDS = [1, 2, 3]
DRAFT_VOCAB = 64  # of the tiny target's 97 tokens: a real d2t, and target tokens the head can never propose
MAX_NEW = 24


# ----------------------------------------------------------------------------- building and saving heads


def draft_vocabulary(target, size: int = DRAFT_VOCAB) -> list[int]:
    """The ``size`` target ids the target's greedy text uses most (ties by id), sorted: the draft vocabulary."""
    counts = torch.zeros(target.config.vocab_size)
    for prompt in TEACHER_PROMPTS + [[7, 8, 9], [20, 21, 22, 23]]:
        text = greedy_text(target, prompt, 40)
        counts += torch.bincount(torch.tensor(text), minlength=len(counts))
    order = sorted(range(len(counts)), key=lambda i: (-float(counts[i]), i))
    return sorted(order[:size])


def greedy_text(target, prompt: list[int], max_new: int) -> list[int]:
    """The target's own greedy continuation by transformers' ``generate`` (no stop token: the tiny target's eos is
    one token like any other here)."""
    with torch.no_grad():
        out = target.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            suppress_tokens=None,
        )
    return out[0, len(prompt) :].tolist()


def make_head(
    target,
    *,
    layer_type: str = "llama",
    draft_ids: list[int] | None = None,
    norms: NormSwitches = NormSwitches(),
    own_embedding: bool = False,
    seed: int = 5,
) -> Eagle3DraftModel:
    """A random head for ``target`` reading :data:`AUX_IDS` (every weight drawn, norm weights near 1)."""
    tc = target.config
    vocab = tc.vocab_size if draft_ids is None else len(draft_ids)
    cfg = Eagle3Config(
        layer_type=layer_type,
        hidden_size=tc.hidden_size,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=2 * tc.hidden_size,
        rms_norm_eps=1e-6,
        target_hidden_size=tc.hidden_size,
        target_vocab_size=tc.vocab_size,
        draft_vocab_size=vocab,
        aux_layer_ids=list(AUX_IDS),
        norms=norms,
        rope_theta=10000.0,
    )
    head = Eagle3DraftModel(cfg, own_embedding=own_embedding, own_lm_head=True)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.7, 1.3)
            else:
                parameter.normal_(0, 0.25)
        if draft_ids is not None:
            head.d2t.copy_(torch.tensor(draft_ids) - torch.arange(vocab))
    return head.eval()


def train_slot_one(head: Eagle3DraftModel, target, steps: int = 120) -> None:
    """A few Adam steps on the first-pass objective (row i, reading the target's states at i and the embedding of
    token i + 1, predicts token i + 2 of the target's greedy text) over the test prompts' own continuations
    (padding rows included: they only add examples): enough for drafts to be accepted often."""
    ids = torch.nn.utils.rnn.pad_sequence(
        [torch.tensor(p + greedy_text(target, p, 30)) for p in TEACHER_PROMPTS], batch_first=True
    )
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
    aux = torch.cat([hidden[i] for i in AUX_IDS], dim=-1)
    draft_of = {int(t): i for i, t in enumerate(head.target_ids())}
    labels = torch.tensor([[draft_of.get(int(t), -100) for t in row[2:]] for row in ids])
    embedding = target.get_input_embeddings()
    positions = torch.arange(ids.shape[1] - 1)[None].expand(len(ids), -1)
    optimiser = torch.optim.Adam([p for p in head.parameters()], lr=0.02)
    for _ in range(steps):
        normed, _, _ = head(head.embed(ids[:, 1:], embedding).detach(), head.combine(aux[:, :-1]), positions)
        assert head.lm_head is not None
        loss = F.cross_entropy(head.lm_head(normed[:, :-1]).flatten(0, 1), labels.flatten(), ignore_index=-100)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    head.eval()


def speculators_config(head: Eagle3DraftModel, **overrides) -> dict:
    """The head's speculators config.json for the tiny targets; an override of None leaves that key out."""
    config = {**speculators_layout_config(head, verifier="tiny-target", k=3, max_positions=512), **overrides}
    return {key: value for key, value in config.items() if value is not None}


def original_config(head: Eagle3DraftModel, **overrides) -> dict:
    """SafeAILab's layout: a Llama config of one layer with draft_vocab_size (no norm switches: its layer is the
    all-False case)."""
    layer = speculators_config(head)["transformer_layer_config"]
    config = {
        **layer,
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": head.config.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": list(head.config.aux_layer_ids),
        **overrides,
    }
    return {key: value for key, value in config.items() if value is not None}


def save_head(
    head: Eagle3DraftModel,
    folder: Path,
    config: dict,
    *,
    layout: str = "speculators",
    tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    """The head as a checkpoint folder; ``tensors`` replace or add weights (None values drop them)."""
    state = {name: tensor.detach().clone().contiguous() for name, tensor in head.state_dict().items()}
    for name, tensor in (tensors or {}).items():
        if tensor is None:
            state.pop(name, None)
        else:
            state[name] = tensor
    if layout == "original":
        state = {
            ("midlayer." + name.removeprefix("layers.0.")) if name.startswith("layers.0.") else name: t
            for name, t in state.items()
        }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


# ----------------------------------------------------------------------------- the reference (vLLM's rule, no cache)


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x = x.float()
    return weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """RoPE, half-split (Llama/Qwen3): x [heads, S, D] at positions [S]."""
    d = x.shape[-1]
    angles = positions.float()[:, None] * (1.0 / theta ** (torch.arange(0, d, 2).float() / d))[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


class Reference:
    """vLLM's EAGLE-3 step computed the slow, obvious way from the saved tensors of a head (checkpoint names)."""

    def __init__(
        self, state: dict[str, torch.Tensor], config: dict, embedding: torch.Tensor, target_head: torch.Tensor
    ):
        self.w = {name.removeprefix("midlayer.").removeprefix("layers.0."): t.float() for name, t in state.items()}
        layer = config.get("transformer_layer_config", config)
        self.qwen3 = layer["model_type"] == "qwen3"
        self.heads, self.kv_heads, self.head_dim = (
            layer["num_attention_heads"],
            layer["num_key_value_heads"],
            layer["head_dim"],
        )
        self.switches = {
            name: config.get(name, name == "norm_before_residual" and "transformer_layer_config" in config)
            for name in ("norm_before_residual", "norm_output", "norm_before_fc", "fc_norm")
        }
        self.embedding = self.w.get("embed_tokens.weight", embedding.float())
        self.target_head = target_head.float()

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        aux = aux.float()
        if self.switches["norm_before_fc"]:
            aux = rms(aux, self.w["input_norm.weight"])
        if self.switches["fc_norm"]:
            width = self.w["fc.weight"].shape[1] // len(AUX_IDS)
            aux = torch.cat(
                [rms(aux[:, i * width : (i + 1) * width], self.w[f"fc_norm.{i}.weight"]) for i in range(len(AUX_IDS))],
                -1,
            )
        return aux @ self.w["fc.weight"].T

    def layer(self, ids: list[int], states: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row, causal attention over all of them: (normed [S, H], carried [S, H])."""
        w = self.w
        residual = states
        hidden = rms(states, w["hidden_norm.weight"])
        if self.switches["norm_before_residual"]:
            residual = hidden
        x = torch.cat([rms(self.embedding[ids], w["input_layernorm.weight"]), hidden], -1)
        s = len(ids)
        q = (x @ w["self_attn.q_proj.weight"].T).view(s, self.heads, self.head_dim)
        k = (x @ w["self_attn.k_proj.weight"].T).view(s, self.kv_heads, self.head_dim)
        v = (x @ w["self_attn.v_proj.weight"].T).view(s, self.kv_heads, self.head_dim).transpose(0, 1)
        if self.qwen3:
            q, k = rms(q, w["self_attn.q_norm.weight"]), rms(k, w["self_attn.k_norm.weight"])
        q, k = rotate(q.transpose(0, 1), positions), rotate(k.transpose(0, 1), positions)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = q @ k.transpose(1, 2) / self.head_dim**0.5
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        attended = (scores.softmax(-1) @ v).transpose(0, 1).reshape(s, -1)
        residual = residual + attended @ w["self_attn.o_proj.weight"].T
        h = rms(residual, w["post_attention_layernorm.weight"])
        prenorm = (
            residual
            + (F.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
        )
        normed = rms(prenorm, w["norm.weight"])
        return normed, normed if self.switches["norm_output"] else prenorm

    def target_id(self, normed: torch.Tensor) -> int:
        if "lm_head.weight" not in self.w:
            return int((normed @ self.target_head.T).argmax())
        draft = int((normed @ self.w["lm_head.weight"].T).argmax())
        return draft + int(self.w["d2t"][draft]) if "d2t" in self.w else draft

    def drafts(self, target, context: list[int], k: int) -> list[int]:
        """The k tokens vLLM drafts after ``context`` (its last token just sampled): the first pass over every
        committed position (ids shifted left), then k - 1 chain rows, the whole layer recomputed for each."""
        with torch.no_grad():
            hidden = target(torch.tensor([context[:-1]]), output_hidden_states=True).hidden_states
        aux = torch.cat([hidden[i][0] for i in AUX_IDS], -1)
        ids, states = list(context[1:]), self.combine(aux)
        out: list[int] = []
        for _ in range(k):
            normed, carried = self.layer(ids, states, torch.arange(len(ids)))
            out.append(self.target_id(normed[-1]))
            ids.append(out[-1])
            states = torch.cat([states, carried[-1:]])
        return out


def reference_for(head: Eagle3DraftModel, target, config: dict) -> Reference:
    return Reference(
        head.state_dict(),
        config,
        target.get_input_embeddings().weight.detach(),
        target.get_output_embeddings().weight.detach(),
    )


def reference_steps(reference: Reference, target, prompt: list[int], truth: list[int], k: int, max_new: int):
    """vLLM's greedy loop over the target's own greedy text: (position, drafted, accepted, draft tokens) per step."""
    steps, i = [], 0  # output index of the last committed token
    while i + 1 < max_new:
        budget = min(k, max_new - (i + 1) - 1)
        drafted = reference.drafts(target, prompt + truth[: i + 1], budget) if budget else []
        accepted = 0
        while accepted < len(drafted) and drafted[accepted] == truth[i + 1 + accepted]:
            accepted += 1
        steps.append((i + 1, len(drafted), accepted, drafted))
        i += accepted + 1
    return steps


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def llama():
    """The tiny Llama target, a trained head over a 64-token draft vocabulary, and its speculators config."""
    target = tiny_target()
    head = make_head(target, draft_ids=draft_vocabulary(target))
    train_slot_one(head, target)
    return target, head, speculators_config(head)


@pytest.fixture(scope="module")
def qwen3():
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config._attn_implementation = "sdpa"
    target = Qwen3ForCausalLM(config).eval()
    head = make_head(target, layer_type="qwen3", draft_ids=list(range(10, 90)), seed=9)
    return target, head, speculators_config(head)


def live(target, head, prompt: list[int], k: int, max_new: int = MAX_NEW):
    wrapped = TargetModel(target)
    return speculative_generate(
        wrapped, Eagle3Proposer(head, wrapped), torch.tensor(prompt), k=k, max_new_tokens=max_new
    )


# --------------------------------------------------------------------------- the live loop and the teacher-forced sweep


def test_live_loop_is_lossless_and_drafts_as_the_reference(llama):
    target, head, config = llama
    reference = reference_for(head, target, config)
    accepted_any = 0
    for prompt in TEACHER_PROMPTS:
        truth = greedy_text(target, prompt, MAX_NEW)
        for k in (1, 3, 5):
            run = live(target, head, prompt, k)
            assert run.output_ids == truth  # lossless: the target's own greedy text
            expected = reference_steps(reference, target, prompt, truth, k, MAX_NEW)
            assert [(s.position, s.num_drafted, s.num_accepted) for s in run.steps] == [e[:3] for e in expected], (
                prompt,
                k,
            )
            drafted = [[t.draft_token for t in run.tokens if t.step == s.step] for s in run.steps]
            assert drafted == [e[3] for e in expected], (prompt, k)
            accepted_any += sum(s.num_accepted >= 1 for s in run.steps)
            assert all(t.draft_token in set(head.target_ids().tolist()) for t in run.tokens)
    assert accepted_any >= 10  # the trained head is often right: the counts above compare something


def test_teacher_forced_sweep_equals_the_live_loop(llama):
    target, head, _ = llama
    for prompt in TEACHER_PROMPTS:
        truth = greedy_text(target, prompt, MAX_NEW)
        wrapped = TargetModel(target)
        table, _ = slot_table(wrapped, Eagle3Proposer(head, wrapped), TeacherSequence(prompt, truth), 5)
        for k in (1, 3, 5):
            run = live(target, head, prompt, k)
            walked = walk_schedule(table.matches[:, :k], truth, k, MAX_NEW, frozenset())
            assert [(s.position, s.num_drafted, s.num_accepted, s.bonus_token) for s in walked] == [
                (s.position, s.num_drafted, s.num_accepted, s.bonus_token) for s in run.steps
            ], (prompt, k)
            if k == 5:  # token records up to each step's first miss (after it the teacher chains on the true tokens,
                # the live loop on its own drafts): the same tokens and divergence columns
                accepted = {s.step: s.num_accepted for s in run.steps}
                rows = [r for r in token_rows(table, walked, truth) if r.offset <= accepted[r.step] + 1]
                mine = [r for r in run.tokens if r.offset <= accepted[r.step] + 1]
                assert [(r.position, r.draft_token, r.accepted) for r in rows] == [
                    (r.position, r.draft_token, r.accepted) for r in mine
                ]
                for ours, theirs in zip(rows, mine):
                    assert ours.target_prob_of_draft == pytest.approx(theirs.target_prob_of_draft, abs=1e-4)
                    assert ours.draft_prob_of_target == pytest.approx(theirs.draft_prob_of_target, abs=1e-4)


def test_qwen3_layer_drafts_as_the_reference(qwen3):
    target, head, config = qwen3
    assert head.layer.self_attn.q_norm is not None
    reference = reference_for(head, target, config)
    prompt = TEACHER_PROMPTS[0]
    truth = greedy_text(target, prompt, 16)
    run = live(target, head, prompt, 4, max_new=16)
    assert run.output_ids == truth
    expected = reference_steps(reference, target, prompt, truth, 4, 16)
    assert [[t.draft_token for t in run.tokens if t.step == s.step] for s in run.steps] == [e[3] for e in expected]


def first_drafts(head: Eagle3DraftModel, target, prompt: list[int], k: int = 4) -> torch.Tensor:
    """The logits [k, V] of the first proposal after ``prompt`` (its last token just sampled)."""
    wrapped = TargetModel(target)
    proposer = Eagle3Proposer(head, wrapped)
    out = wrapped.forward(torch.tensor(prompt[:-1]), taps=proposer.needs.hidden_state_indices)
    proposer.start(torch.tensor(prompt[:-1]), out.features)
    return proposer.propose(prompt[-1], k, k).logits


# --------------------------------------------------------------------------- checkpoints: layouts, switches, layer ids


def test_both_layouts_load_into_the_same_drafts(llama, tmp_path):
    target, head, config = llama
    speculators = load_eagle3_head(save_head(head, tmp_path / "spec", config), target.config)
    original = load_eagle3_head(
        save_head(head, tmp_path / "orig", original_config(head), layout="original"), target.config
    )
    assert speculators.facts["format"] == "speculators" and original.facts["format"] == "original EAGLE-3"
    prompt = TEACHER_PROMPTS[2]
    assert torch.equal(first_drafts(speculators, target, prompt), first_drafts(head, target, prompt))
    assert torch.equal(first_drafts(original, target, prompt), first_drafts(head, target, prompt))
    # a speculators config that leaves norm_before_residual out is read as vLLM reads it (True): other drafts
    silent = load_eagle3_head(
        save_head(head, tmp_path / "silent", speculators_config(head, norm_before_residual=None)), target.config
    )
    assert silent.config.norms.norm_before_residual is True
    recorded = silent.facts["norm_switches"]["norm_before_residual"]
    assert (recorded["checkpoint"], recorded["vllm"], recorded["trained_default"], recorded["replay"]) == (
        None,
        True,
        False,
        True,
    )
    assert not torch.equal(first_drafts(silent, target, prompt), first_drafts(head, target, prompt))


@pytest.mark.parametrize("switch", ["norm_before_residual", "norm_output", "norm_before_fc", "fc_norm"])
def test_each_norm_switch_is_wired_as_vllm_runs_it(switch, tmp_path):
    """The head with one switch on drafts as the reference does with it on, and otherwise than with it off."""
    target = tiny_target()
    head = make_head(target, draft_ids=list(range(5, 85)), norms=NormSwitches(**{switch: True}), seed=11)
    on = load_eagle3_head(save_head(head, tmp_path / "on", speculators_config(head)), target.config)
    off = load_eagle3_head(
        save_head(head, tmp_path / "off", speculators_config(head, **{switch: False})), target.config
    )
    assert getattr(on.config.norms, switch) and not getattr(off.config.norms, switch)
    prompt = TEACHER_PROMPTS[0]
    assert not torch.allclose(first_drafts(on, target, prompt), first_drafts(off, target, prompt))
    truth = greedy_text(target, prompt, 12)
    run = live(target, on, prompt, 4, max_new=12)
    expected = reference_steps(reference_for(head, target, speculators_config(head)), target, prompt, truth, 4, 12)
    assert [[t.draft_token for t in run.tokens if t.step == s.step] for s in run.steps] == [e[3] for e in expected]


def test_layer_ids_are_looked_up_where_vllm_looks():
    assert aux_layer_ids(
        {"eagle_aux_hidden_state_layer_ids": [3, 5], "dflash_config": {"target_layer_ids": [1]}}, 36
    ) == ([3, 5], "eagle_aux_hidden_state_layer_ids")
    assert aux_layer_ids(
        {
            "eagle_aux_hidden_state_layer_ids": [],
            "dflash_config": {"target_layer_ids": [1, 17]},
            "eagle_config": {"layer_ids": [4]},
        },
        36,
    ) == ([2, 18], "dflash_config.target_layer_ids + 1")
    assert aux_layer_ids({"eagle_config": {"layer_ids": [4, 9]}}, 36) == ([4, 9], "eagle_config.layer_ids")
    assert aux_layer_ids({}, 36) == ([2, 18, 33], VLLM_DEFAULT)  # Qwen3-8B
    assert aux_layer_ids({}, 32) == ([2, 16, 29], VLLM_DEFAULT)  # Llama-3.1-8B
    assert aux_layer_ids({}, 80) == ([2, 40, 77], VLLM_DEFAULT)  # Llama-3.3-70B


def test_layouts_and_switch_readings_are_recognised(llama):
    _, head, config = llama
    assert checkpoint_layout(config) == "speculators"
    assert checkpoint_layout(original_config(head)) == "original EAGLE-3"
    assert checkpoint_layout({"dflash_config": {}, "draft_vocab_size": 8, "num_hidden_layers": 1}) is None
    assert checkpoint_layout({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}) is None
    original = norm_switches(original_config(head))["norm_before_residual"]
    assert (original.checkpoint, original.replay) == (None, False)  # a Llama config: missing means False in vLLM
    written = norm_switches(config)["norm_before_residual"]
    assert (written.checkpoint, written.replay) == (False, False)


# ----------------------------------------------------------------------------- the CLI


@pytest.fixture(scope="module")
def head_dir(llama, tmp_path_factory) -> Path:
    _, head, config = llama
    return save_head(head, tmp_path_factory.mktemp("eagle3") / "head", config)


@pytest.mark.parametrize(
    "case,fragments",
    [
        ("fc", ("fc.weight combines 3 target states", "eagle_aux_hidden_state_layer_ids gives 2 layer ids")),
        ("ids", ("aux layer id 9", "outside the target's 4 layers")),
        ("d2t", ("d2t has 63 entries", "draft_vocab_size is 64")),
    ],
)
def test_bad_heads_are_refused_in_one_sentence(llama, tiny_dir, tmp_path, case, fragments):
    _, head, config = llama
    if case == "fc":
        folder = save_head(head, tmp_path / case, speculators_config(head, eagle_aux_hidden_state_layer_ids=[1, 2]))
    elif case == "ids":
        folder = save_head(head, tmp_path / case, speculators_config(head, eagle_aux_hidden_state_layer_ids=[1, 2, 9]))
    else:
        folder = save_head(head, tmp_path / case, config, tensors={"d2t": head.d2t[:-1].clone()})
    assert_usage_error(invoke("check", *pair_args(tiny_dir, folder, "--out", tmp_path / "run")), *fragments)


def test_check_runs_end_to_end_and_records_the_head(head_dir, tiny_dir, tmp_path):
    result = invoke("check", *pair_args(tiny_dir, head_dir, "--k", "1-3", "--out", tmp_path / "run"))
    assert result.exit_code in (0, 1), result.output
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    draft = record["models"]["draft"]
    assert draft["kind"] == "eagle3"
    assert (draft["format"], draft["aux_layer_ids"], draft["aux_layer_ids_source"]) == (
        "speculators",
        AUX_IDS,
        "eagle_aux_hidden_state_layer_ids",
    )
    assert draft["draft_vocab_size"] == DRAFT_VOCAB and draft["target_vocab_coverage"] == pytest.approx(
        DRAFT_VOCAB / 97
    )
    assert draft["norm_switches"]["norm_before_residual"]["replay"] is False and draft["default_k"] == 3
    assert set(record["probes"]["offset_probe"]) == {
        "-1",
        "0",
    }  # the layer-offset probe ran (ids 1..3 of 4 layers: no +1)
    checks = {c["id"]: c for c in record["checks"]}
    assert checks["draft-config"]["status"] == "skip"
    assert "DFlash" not in checks["tokenizer-parity"]["summary"]
    assert checks["eagle3-config"]["status"] != "skip" and "output_token_coverage" in checks["eagle3-config"]["metrics"]


def test_head_to_head_with_ngram_prints_the_table(head_dir, tiny_dir, tmp_path):
    result = invoke(
        "check",
        *pair_args(
            tiny_dir,
            head_dir,
            "--draft",
            "ngram:prompt_lookup_min=1,prompt_lookup_max=3",
            "--k",
            "1-2",
            "--out",
            tmp_path / "h2h",
        ),
    )
    assert result.exit_code in (0, 1), result.output
    table = json.loads((tmp_path / "h2h" / "head_to_head.json").read_text())
    assert [s["name"] for s in table["speculators"]] == ["head", "ngram"]
    assert "head" in result.output and "ngram" in result.output and "head-to-head:" in result.output
    assert json.loads((tmp_path / "h2h" / "head" / "run.json").read_text())["models"]["draft"]["kind"] == "eagle3"


# ----------------------------------------------------------------------------- the eagle3-config check


def eagle3_context(
    config: dict, *, draft: Path | None = None, output: list[int] | dict[str, list[int]] | None = None, probe=None
):
    """A check context for eagle3-config; ``output``: the run's output ids (one class) or ids per class."""
    from types import SimpleNamespace

    from dflash_doctor.checks import CheckContext
    from dflash_doctor.rundir.run_record import Probes

    record = SimpleNamespace(probes=Probes(offset_probe=probe[0], offset_probe_drafts=probe[1]) if probe else Probes())
    return CheckContext(
        draft_config=config,
        draft_kind="eagle3",
        target_config={"num_hidden_layers": 36},
        config=SimpleNamespace(draft=str(draft) if draft else None),
        record=record,  # pyright: ignore
        output_token_ids_by_class={"chat": output} if isinstance(output, list) else output,
    )


def findings_of(ctx):
    """The eagle3-config check's result on ``ctx``, run through the registry as every check is."""
    from dflash_doctor.checks import run_checks

    (result,) = run_checks(ctx, only=["eagle3-config"])
    return result


def test_eagle3_config_warn_on_missing_layer_ids_and_a_norm_switch_vllm_reads_otherwise(llama):
    _, head, config = llama
    good = findings_of(eagle3_context(config))
    assert all(f.severity == "info" for f in good.findings)
    missing = findings_of(
        eagle3_context(speculators_config(head, eagle_aux_hidden_state_layer_ids=None, norm_before_residual=None))
    )
    assert missing.status == "warn"
    messages = " ".join(f.message + f.fix for f in missing.findings)
    assert "vLLM reads its default layers [2, 18, 33]" in messages
    assert "leaves norm_before_residual out: vLLM runs the head with norm_before_residual = True" in messages
    assert '"norm_before_residual": false' in messages
    # the original layout reads a missing switch as False, as its trainer built it: nothing to say
    assert not any(
        "norm_before_residual" in f.message for f in findings_of(eagle3_context(original_config(head))).findings
    )


def test_eagle3_config_fail_when_a_shifted_layer_wins_the_offset_probe(llama):
    _, _, config = llama
    result = findings_of(eagle3_context(config, probe=({-1: 2.4, 0: 1.5, 1: 1.4}, 200)))
    assert result.status == "fail" and "eagle_aux_hidden_state_layer_ids = [0, 1, 2]" in result.findings[0].fix
    assert findings_of(eagle3_context(config, probe=({-1: 1.5, 0: 1.6, 1: 1.4}, 200))).status == "pass"
    assert (
        findings_of(eagle3_context(config, probe=({-1: 2.4, 0: 1.5}, 10))).status == "pass"
    )  # too few drafts: inconclusive


def test_eagle3_config_pass_when_the_head_covers_the_run(llama, head_dir):
    _, head, config = llama
    covered = findings_of(eagle3_context(config, draft=head_dir, output=head.target_ids().tolist() * 3))
    assert covered.status == "pass" and covered.metrics["output_token_coverage"] == 1.0


def test_eagle3_config_warn_and_fail_on_poor_vocabulary_coverage(llama, head_dir):
    _, head, config = llama
    inside = head.target_ids().tolist()
    outside = sorted(set(range(97)) - set(inside))
    mostly = findings_of(
        eagle3_context(config, draft=head_dir, output=inside + inside[:26] + outside[:10])
    )  # 90 of 100
    assert mostly.status == "warn" and mostly.metrics["output_token_coverage"] == pytest.approx(0.9)
    poor = findings_of(eagle3_context(config, draft=head_dir, output=inside[:10] + outside[:20]))
    assert poor.status == "fail" and "upper bound" in poor.summary
    assert poor.metrics["most_missed_tokens"] == outside[:5]


def test_eagle3_config_judges_each_class_so_a_well_covered_run_cannot_hide_a_poor_class(llama, head_dir):
    """99% of the run is covered (a pass, judged overall) while code, 30 of its 979 tokens, is covered at 70%:
    a fail naming code, each class's share in the metrics and the evidence."""
    _, head, config = llama
    inside = head.target_ids().tolist()
    outside = sorted(set(range(97)) - set(inside))
    chat = (inside * 20)[: 970 - 21]
    code = (inside * 2)[:21] + (outside * 3)[:9]
    result = findings_of(eagle3_context(config, draft=head_dir, output={"chat": chat, "code": code}))
    metrics = result.metrics
    assert metrics["output_token_coverage"] == pytest.approx(0.991, abs=1e-3)
    assert metrics["output_token_coverage_by_class"] == {"chat": 1.0, "code": pytest.approx(0.7)}
    assert result.status == "fail"
    failing = [f for f in result.findings if f.severity == "fail"]
    assert len(failing) == 1 and failing[0].message.startswith("class code: the head can propose 70.0%")
    assert "per class: chat 100.0%; code 70.0%" in result.findings[0].evidence
