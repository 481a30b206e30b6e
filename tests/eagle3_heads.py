"""EAGLE-3 heads fitted in seconds for a target, saved in the speculators layout vLLM reads.

A random head is rarely accepted, and a comparison of acceptance between engines needs acceptance to
compare: the head's first-pass objective (row i reads the target's aux states at i and the embedding of
token i + 1, and predicts the target's greedy choice after token i + 1) is fitted on a few hundred
positions of some text, the labels read off one target forward over it (no generation, which costs far
more on CPU), which is enough for slot 1 to be right often. Later slots run on the carried state, which
this fit does not train.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from dflash_doctor.engine.eagle3_model import Eagle3Config, Eagle3DraftModel, NormSwitches


def draft_vocabulary(sequences: list[list[int]], size: int, target_vocab: int) -> list[int]:
    """``size`` target ids, sorted: the ones the sequences use most, then the lowest unused ids."""
    counts = Counter(t for s in sequences for t in s)
    used = [t for t, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))][:size]
    filler = (t for t in range(target_vocab) if t not in counts)
    return sorted(used + [next(filler) for _ in range(size - len(used))])


def fitted_head(
    target,
    sequences: list[list[int]],
    aux_layer_ids: list[int],
    *,
    draft_vocab: int,
    steps: int = 120,
    lr: float = 0.02,
    norms: NormSwitches = NormSwitches(),
    seed: int = 0,
) -> Eagle3DraftModel:
    """A head shaped like one layer of ``target`` (its heads, head size, MLP width and RoPE), over the ``draft_vocab``
    target ids the target's greedy choices on ``sequences`` use most, reading ``aux_layer_ids`` (vLLM's meaning:
    HF ``hidden_states[k]``), its slot 1 fitted on ``sequences``. Its ``lm_head`` starts from the target's output
    rows of those ids (the head's normed output plays the target's final state), which a short fit then adjusts."""
    tc = target.config
    rope = getattr(tc, "rope_parameters", None) or {}
    heads = int(tc.num_attention_heads)
    cfg = Eagle3Config(
        layer_type="llama",
        hidden_size=tc.hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=int(tc.num_key_value_heads),
        head_dim=int(getattr(tc, "head_dim", None) or tc.hidden_size // heads),
        intermediate_size=int(tc.intermediate_size),
        rms_norm_eps=float(tc.rms_norm_eps),
        target_hidden_size=tc.hidden_size,
        target_vocab_size=tc.vocab_size,
        draft_vocab_size=draft_vocab,
        aux_layer_ids=list(aux_layer_ids),
        norms=norms,
        rope_theta=float(rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))),
    )
    torch.manual_seed(seed)
    head = Eagle3DraftModel(cfg, own_embedding=False, own_lm_head=True)
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(s) for s in sequences], batch_first=True)
    lengths = torch.tensor([len(s) for s in sequences])
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    greedy = out.logits.argmax(-1)  # [B, T]: the target's choice after each position
    valid = torch.arange(ids.shape[1] - 1)[None] < (lengths - 1)[:, None]  # rows 0..n-2 of each sequence
    choices = greedy[:, 1:]  # row i's label: the choice after token i + 1
    vocabulary = draft_vocabulary([choices[b][valid[b]].tolist() for b in range(len(ids))], draft_vocab, tc.vocab_size)
    draft_of = torch.full((tc.vocab_size,), -100)
    draft_of[torch.tensor(vocabulary)] = torch.arange(draft_vocab)
    labels = torch.where(valid, draft_of[choices], -100)
    aux = torch.cat([out.hidden_states[i] for i in aux_layer_ids], dim=-1)[:, :-1]
    embeds = head.embed(ids[:, 1:], target.get_input_embeddings()).detach()
    positions = torch.arange(ids.shape[1] - 1)[None].expand(len(ids), -1)
    assert head.lm_head is not None
    with torch.no_grad():
        head.d2t.copy_(torch.tensor(vocabulary) - torch.arange(draft_vocab))
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[vocabulary])
    optimiser = torch.optim.Adam(head.parameters(), lr=lr)
    for _ in range(steps):
        normed, _, _ = head(embeds, head.combine(aux), positions)
        loss = F.cross_entropy(head.lm_head(normed).flatten(0, 1), labels.flatten(), ignore_index=-100)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    return head.eval()


def speculators_layout_config(head: Eagle3DraftModel, *, verifier: str, k: int, max_positions: int = 8192) -> dict:
    """The head's config.json in the speculators layout, every norm switch written (as the head runs them)."""
    cfg = head.config
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": {
            "model_type": cfg.layer_type,
            "hidden_size": cfg.hidden_size,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
            "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": 1,
            "rms_norm_eps": cfg.rms_norm_eps,
            "vocab_size": cfg.target_vocab_size,
            "rope_theta": cfg.rope_theta,
            "max_position_embeddings": max_positions,
            "hidden_act": "silu",
        },
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        **{
            name: getattr(cfg.norms, name)
            for name in ("norm_before_residual", "norm_output", "norm_before_fc", "fc_norm")
        },
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
            "verifier": {"name_or_path": verifier},
        },
    }


def save_speculators_head(head: Eagle3DraftModel, folder: Path, *, verifier: str, k: int) -> Path:
    """The head as a speculators-layout checkpoint (config.json + model.safetensors)."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {name: t.detach().clone().contiguous() for name, t in head.state_dict().items()}, folder / "model.safetensors"
    )
    config = speculators_layout_config(head, verifier=verifier, k=k)
    (folder / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    return folder
