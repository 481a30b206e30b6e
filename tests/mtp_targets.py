"""Tiny targets with their own MTP head, and an independent reference of how vLLM drafts with one.

The reference recomputes the head over the whole prefix at every slot (no cache), from vLLM's rule; the
targets' MTP weights are written into their safetensors in each family's layout (DeepSeek-V3/GLM after the
last decoder layer, Qwen3.5 under ``mtp.*``), layer 0 fit to its target on the post-norm state, as the
engines train and serve them, so drafts are often accepted and a right replay can be told from a wrong one.
Used by the mtp speculator's tests and by the real-vLLM agreement test.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from target_families import tiny_family_target
from tiny_models import tiny_tokenizer

PROMPTS = [[5, 17, 42, 8, 9, 30], [11, 12, 13, 60, 61], [70, 3, 44, 21, 9, 9, 50, 6]]
MAX_NEW = 24


# ------------------------------------------------------------------------------------------- the reference


class ReferenceLayer(torch.nn.Module):
    """One MTP layer in the engines' terms: enorm/hnorm, eh_proj, a decoder block of the target's class, the
    output norm; the embedding and head are the target's."""

    def __init__(self, target, index: int):
        super().__init__()
        config = copy.deepcopy(target.config)
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = list(config.layer_types) + ["full_attention"] * 2
        last = target.model.layers[-1]
        self.block = type(last)(config, config.num_hidden_layers + index)
        self.block.load_state_dict(last.state_dict())  # start from the target's last layer
        norm = type(target.model.norm)
        hidden = config.hidden_size
        self.enorm, self.hnorm, self.onorm = (norm(hidden, eps=config.rms_norm_eps) for _ in range(3))
        self.proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
        with torch.no_grad():
            self.proj.weight.normal_(0, 0.1)
            self.onorm.weight.uniform_(-2.5, 2.5)  # the two sides of the output norm differ measurably


def reference_rows(layer: ReferenceLayer, target, ids, positions, states, zero_first: bool):
    """The layer over whole rows [B, S] at once (causal), no cache: (block output, normed output)."""
    embeds = target.model.embed_tokens(ids)
    if zero_first:
        embeds = torch.where((positions == 0)[..., None], 0.0, embeds)
    x = layer.proj(torch.cat([layer.enorm(embeds), layer.hnorm(states)], dim=-1))
    size = ids.shape[1]
    mask = torch.full((size, size), torch.finfo(x.dtype).min).triu(1)[None, None]
    out = layer.block(
        x, attention_mask=mask, position_ids=positions, position_embeddings=target.model.rotary_emb(x, positions)
    )
    return out, layer.onorm(out)


def target_states(target, tokens: list[int]) -> dict[str, torch.Tensor]:
    """The target's final state on both sides of its norm, for every position of ``tokens``."""
    captured = {}
    hook = target.model.layers[-1].register_forward_hook(
        lambda m, a, out: captured.update(pre=out[0] if isinstance(out, tuple) else out)
    )
    with torch.no_grad():
        post = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
    hook.remove()
    return {"post-norm": post, "pre-norm": captured["pre"][0]}


@torch.no_grad()
def reference_drafts(
    layers, target, committed: list[int], k: int, zero_first: bool, hidden="post-norm", carried="post-norm"
):
    """vLLM's rule, slowly: slot 1 from the committed rows (ids shifted left, the target's states); slot j > 1
    from the previous draft, one position on, the carried state; step s runs layer s % n over its
    committed rows and this step's earlier rows of the same layer."""
    a = len(committed) - 1
    states = target_states(target, committed[:-1])[hidden] if a else None
    rows = {i: ([], [], []) for i in range(len(layers))}  # chain rows per layer: ids, positions, states
    drafts, carry = [], None
    for s in range(k):
        layer = s % len(layers)
        chain_ids, chain_pos, chain_states = rows[layer]
        token, position, state = (committed[-1], a - 1, None) if s == 0 else (drafts[-1], a + s - 1, carry)
        if s:
            chain_ids.append(token), chain_pos.append(position), chain_states.append(state)
        ids = torch.tensor([committed[1:] + chain_ids])
        positions = torch.tensor([list(range(a)) + chain_pos])
        hidden_rows = torch.cat([states, *[c[None] for c in chain_states]])[None]
        out, normed = reference_rows(layers[layer], target, ids, positions, hidden_rows, zero_first)
        drafts.append(int(target.lm_head(normed[0, -1]).argmax()))
        carry = normed[0, -1] if carried == "post-norm" else out[0, -1]
    return drafts


def reference_steps(layers, target, prompt, truth, k, zero_first, **sides):
    """vLLM's greedy loop over the target's own greedy text: (position, drafts, accepted) per step."""
    steps, i = [], 0
    while i + 1 < MAX_NEW and i + 1 < len(truth):
        budget = min(k, MAX_NEW - (i + 1) - 1)
        drafts = (
            reference_drafts(layers, target, prompt + truth[: i + 1], budget, zero_first, **sides) if budget else []
        )
        accepted = 0
        while accepted < len(drafts) and i + 1 + accepted < len(truth) and drafts[accepted] == truth[i + 1 + accepted]:
            accepted += 1
        steps.append((i + 1, drafts, accepted))
        i += accepted + 1
    return steps


# ------------------------------------------------------------------------------------------- tiny MTP targets


def _fit(layer: ReferenceLayer, target, zero_first: bool, steps: int = 120) -> None:
    """Fit the layer to guess the target's greedy token two ahead from the post-norm state (its slot 1) on
    the test prompts' greedy continuations: a random tiny target is no language a small head could learn,
    but the head can learn these texts, which is all the tests need to see drafts accepted."""
    sequences = [
        target.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        for prompt in PROMPTS
    ]
    with torch.no_grad():
        passes = [target(ids, output_hidden_states=True) for ids in sequences]
    optimiser = torch.optim.Adam(layer.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = torch.zeros(())
        for ids, out in zip(sequences, passes):
            positions = torch.arange(ids.shape[1] - 1)[None]
            _, normed = reference_rows(layer, target, ids[:, 1:], positions, out.hidden_states[-1][:, :-1], zero_first)
            loss = loss + torch.nn.functional.cross_entropy(target.lm_head(normed)[0], out.logits.argmax(-1)[0, 1:])
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    layer.requires_grad_(False)


def _checkpoint_block(block: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The block's tensors as checkpoints store them: fused MoE experts split back into one tensor per expert."""
    tensors = {}
    for name, tensor in block.state_dict().items():
        stem, _, kind = name.rpartition(".")
        if kind == "gate_up_proj":
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                tensors[f"{stem}.{e}.gate_proj.weight"] = tensor[e, :half].clone()
                tensors[f"{stem}.{e}.up_proj.weight"] = tensor[e, half:].clone()
        elif kind == "down_proj" and tensor.dim() == 3:
            tensors.update({f"{stem}.{e}.down_proj.weight": tensor[e].clone() for e in range(tensor.shape[0])})
        else:
            tensors[name] = tensor.clone()
    return tensors


def write_mtp_target(family: str, folder: Path, n_predict: int = 1):
    """A tiny ``family`` target with ``n_predict`` MTP layers written into its checkpoint (layer 0 fit to the
    target, the others as initialised); returns the target module and the reference layers."""
    target = tiny_family_target(family)
    with torch.no_grad():
        target.model.norm.weight.uniform_(-2.5, 2.5)  # its two sides of the final norm differ measurably
    zero_first = family != "qwen3_5"
    torch.manual_seed(7)
    layers = [ReferenceLayer(target, i) for i in range(n_predict)]
    _fit(layers[0], target, zero_first)
    for layer in layers[1:]:
        layer.requires_grad_(False)
    target.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    hidden_count = target.config.num_hidden_layers
    for i, layer in enumerate(layers):
        if family == "qwen3_5":
            tensors.update(
                {
                    "mtp.fc.weight": layer.proj.weight,
                    "mtp.pre_fc_norm_embedding.weight": layer.enorm.weight,
                    "mtp.pre_fc_norm_hidden.weight": layer.hnorm.weight,
                    "mtp.norm.weight": layer.onorm.weight,
                }
            )
            prefix = f"mtp.layers.{i}."
        else:
            prefix = f"model.layers.{hidden_count + i}."
            tensors.update(
                {
                    prefix + "eh_proj.weight": layer.proj.weight,
                    prefix + "enorm.weight": layer.enorm.weight,
                    prefix + "hnorm.weight": layer.hnorm.weight,
                    prefix + "shared_head.norm.weight": layer.onorm.weight,
                }
            )
        tensors.update({prefix + name: t for name, t in _checkpoint_block(layer.block).items()})
    save_file(
        {name: t.detach().clone().contiguous() for name, t in tensors.items()},
        folder / "model.safetensors",
        metadata={"format": "pt"},
    )
    config = json.loads((folder / "config.json").read_text())
    config.pop("num_mtp_layers", None)
    config["mtp_num_hidden_layers" if family == "qwen3_5" else "num_nextn_predict_layers"] = n_predict
    (folder / "config.json").write_text(json.dumps(config))
    return target, layers
