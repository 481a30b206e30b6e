"""draft-config: does a DFlash draft's config.json fit the target it is served with?

A DFlash draft borrows the target's embedding and LM head and reads hidden states of chosen target
layers (docs/draft-formats.md), so its ``hidden_size``, ``fc`` width (len(target_layer_ids) x hidden),
layer ids, RoPE settings and mask id are only meaningful relative to one target. A mismatch often loads
without an error and silently drafts garbage. The offset probe (fed by the engine through
``ctx.record.probes.offset_probe``) catches the classic off-by-one in layer ids (vLLM PR #42704,
llama.cpp #25792): if reading layer l - 1 or l + 1 gives clearly better acceptance, the ids are shifted.

Every config dialect is first normalised (:mod:`dflash_doctor.models.draft_formats`; an unreadable config fails
here with the loader's sentence), then the variant rules apply: causal training vs how the
engine will attend, layer ids written in another dialect's convention, a mask id that is an ordinary
special token, a draft that ships its own lm_head / embeddings, and the draft sampling method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_doctor.checks.base import Check, CheckContext, CheckResult, Finding, config_value, register, skipped
from dflash_doctor.checks.draft_facts import block_size, is_dflash, mask_token_id, target_layer_ids
from dflash_doctor.models.draft_formats import normalise_draft_config
from dflash_doctor.engine.dflash_model import DSPARK_ARCHITECTURE
from dflash_doctor.errors import UsageError

# fp16 vs bf16 is a real risk (fp16 overflows where bf16 was trained); fp32 vs either is only slower.
_HALF_DTYPES = {"float16", "bfloat16"}


def _rope(config: Any) -> tuple[Any, Any]:
    """(rope_theta, rope scaling) from either transformers 4 keys or transformers 5 ``rope_parameters``.

    transformers 5 also answers ``config.rope_scaling`` with the whole ``rope_parameters`` dict, so a
    scaling dict is normalised: ``rope_theta`` and ``rope_type: default`` are not scaling (None).
    """
    parameters = config_value(config, "rope_parameters") or {}
    theta = config_value(config, "rope_theta") or parameters.get("rope_theta")
    scaling = config_value(config, "rope_scaling") or parameters
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta" and not (k == "rope_type" and v == "default")}
    return theta, scaling or None


def decoder_config(config: Any) -> Any:
    """The target's decoder config: a multimodal checkpoint (Qwen3.5/3.6, gemma-4) nests the layers,
    hidden size and RoPE under ``text_config``."""
    nested = config_value(config, "text_config")
    return config if nested is None else nested


def layer_kinds(config: Any) -> list[str] | None:
    """Each decoder layer's kind, where the config lists them: ``layer_types`` (Qwen3.5/3.6, Qwen3-Next,
    LFM2, gemma, gpt-oss) or Nemotron-H's ``layers_block_type``."""
    return config_value(config, "layer_types") or config_value(config, "layers_block_type")


#: Layer kinds of a hybrid target that are not attention (their cache is a recurrent or convolution state).
RECURRENT_KINDS = {"linear_attention", "conv", "mamba"}


def _dtype(config: Any) -> str | None:
    value = config_value(config, "dtype") or config_value(config, "torch_dtype")
    return None if value is None else str(value).replace("torch.", "")


@register
@dataclass(frozen=True)
class DraftConfigCheck(Check):
    """A DFlash draft's config is consistent with the target: sizes, layer ids, RoPE, dtype, block vs K, mask.

    Fails on a hidden-size or fc-width mismatch, layer ids outside the target, a K larger than the block
    drafts, a mask id outside the embedding, or an offset probe where a shifted layer id clearly wins.
    Warns on RoPE differences, a different target depth, and fp16/bf16 mixes.
    """

    id = "draft-config"
    title = "Draft config"
    needs = ("draft_config",)

    # A neighbour offset fails the check when it accepts this share more tokens per draft (tau - 1) than
    # offset 0. Relative, because a weak draft's neighbours differ by little absolute tau: the demo draft
    # (tau ~2) loses ~14% of its accepted tokens one layer off, a strong one (tau ~6) far more.
    offset_probe_margin: float = 0.10
    # ... and at least this many more tokens per draft: a draft broken by something else accepts almost
    # nothing at every offset, where a relative margin of 0.13 vs 0.15 tokens is noise, not a shift
    offset_probe_min_gain: float = 0.05
    offset_probe_min_drafts: int = 50  # fewer drafts behind offset 0 and the probe only reports, never fails

    def run(self, ctx: CheckContext) -> CheckResult:
        if not is_dflash(ctx):
            return skipped(self.id, "the draft is not a DFlash checkpoint (static config checks are DFlash-specific)")
        raw, target = ctx.draft_config, decoder_config(ctx.target_config)
        try:
            normalised = normalise_draft_config(
                raw or {}, source="the draft config", served_target_layers=config_value(target, "num_hidden_layers")
            )
        except UsageError as exc:
            return CheckResult.from_findings(
                self.id, [Finding("fail", str(exc), "", "fix or convert the draft config")], {}, ""
            )
        draft = normalised.config
        findings: list[Finding] = []
        metrics: dict[str, Any] = {
            "hidden_size": config_value(draft, "hidden_size"),
            "block_size": block_size(draft),
            "target_layer_ids": target_layer_ids(draft),
            "mask_token_id": mask_token_id(draft),
            "dialect": normalised.dialect,
        }
        findings += self._size_findings(ctx, target, metrics)
        findings += self._layer_findings(draft, target)
        findings += variant_findings(ctx, raw or {}, normalised)
        findings += self._rope_dtype_findings(raw or {}, target)
        findings += self._block_findings(ctx, metrics)
        findings += served_format_findings(ctx, normalised)
        findings += self._offset_probe_findings(ctx, metrics)
        return CheckResult.from_findings(self.id, findings, metrics, "draft config fits the target")

    def _size_findings(self, ctx: CheckContext, target: Any, metrics: dict[str, Any]) -> list[Finding]:
        findings = []
        hidden = metrics["hidden_size"]
        target_hidden = config_value(target, "hidden_size")
        if hidden is not None and target_hidden is not None and hidden != target_hidden:
            findings.append(
                Finding(
                    "fail",
                    f"draft hidden_size {hidden} differs from the target's {target_hidden}",
                    "DFlash embeds with the target's embed_tokens and projects with its lm_head",
                    "use a draft trained for this target",
                )
            )
        ids = metrics["target_layer_ids"]
        fc_shape = (ctx.draft_weight_shapes or {}).get("fc.weight")
        if fc_shape is not None and ids and hidden:
            expected = [hidden, len(ids) * hidden]
            if list(fc_shape) != expected:
                findings.append(
                    Finding(
                        "fail",
                        f"fc.weight is {list(fc_shape)} but {len(ids)} layer ids x hidden {hidden} needs {expected}",
                        "fc fuses the concatenated hidden states of every target layer id",
                        "make dflash_config.target_layer_ids match the ids the draft was trained with",
                    )
                )
        return findings

    def _layer_findings(self, draft: dict[str, Any], target: Any) -> list[Finding]:
        ids = target_layer_ids(draft)
        num_layers = config_value(target, "num_hidden_layers")
        findings = []
        if ids is None:  # normalise_draft_config has refused it already, naming every engine's guess
            return findings
        if len(set(ids)) != len(ids):
            findings.append(Finding("warn", f"target_layer_ids {ids} repeat a layer", "", "list each layer once"))
        if num_layers is not None:
            outside = [i for i in ids if not 0 <= i < num_layers]
            if outside:
                findings.append(
                    Finding(
                        "fail",
                        f"target_layer_ids {outside} are outside the target's {num_layers} layers",
                        f"ids {ids}; HF convention: layer l is hidden_states[l + 1]",
                        "use ids in 0..num_hidden_layers-1 (llama.cpp GGUF ids are shifted by one)",
                    )
                )
            findings += _hybrid_tap_findings(ids, layer_kinds(target))
            trained_for = config_value(draft, "num_target_layers")
            if trained_for is not None and trained_for != num_layers:
                findings.append(
                    Finding(
                        "warn",
                        f"the draft was trained for a {trained_for}-layer target; this target has {num_layers}",
                        f"num_target_layers {trained_for}",
                        "use the draft trained for this target size",
                    )
                )
        return findings

    def _rope_dtype_findings(self, draft: dict[str, Any], target: Any) -> list[Finding]:
        if target is None:
            return []
        findings = []
        (draft_theta, draft_scaling), (target_theta, target_scaling) = _rope(draft), _rope(target)
        if draft_theta is not None and target_theta is not None and float(draft_theta) != float(target_theta):
            findings.append(
                Finding(
                    "warn",
                    f"rope_theta differs: draft {draft_theta} vs target {target_theta}",
                    "the draft applies RoPE to the context at the target's absolute positions",
                    "use the target's rope_theta in the draft config",
                )
            )
        if draft_scaling != target_scaling:
            findings.append(
                Finding(
                    "warn",
                    f"rope scaling differs: draft {draft_scaling} vs target {target_scaling}",
                    "long contexts drift apart first",
                    "copy the target's rope scaling into the draft config",
                )
            )
        draft_dtype, target_dtype = _dtype(draft), _dtype(target)
        if draft_dtype and target_dtype and draft_dtype != target_dtype:
            severity = "warn" if {draft_dtype, target_dtype} == _HALF_DTYPES else "info"
            findings.append(
                Finding(
                    severity,
                    f"dtype differs: draft {draft_dtype} vs target {target_dtype}",
                    "fp16 overflows where bf16 was trained" if severity == "warn" else "a wider dtype only costs speed",
                    "serve the draft in the dtype it was trained in (--dtype)",
                )
            )
        return findings

    def _block_findings(self, ctx: CheckContext, metrics: dict[str, Any]) -> list[Finding]:
        findings = []
        block = metrics["block_size"]
        ks = tuple(getattr(ctx.config, "k", ()) or ())
        if block is None:
            findings.append(
                Finding(
                    "warn", "the draft config records no block_size", "", "set block_size (or dflash_config.block_size)"
                )
            )
        elif ks and max(ks) > block - 1:
            findings.append(
                Finding(
                    "fail",
                    f"K {max(ks)} exceeds the {block - 1} tokens one block of {block} drafts",
                    f"--k {','.join(map(str, ks))}",
                    f"use --k {block - 1} or less",
                )
            )
        mask = metrics["mask_token_id"]
        rows = config_value(decoder_config(ctx.target_config), "vocab_size") or config_value(
            ctx.draft_config, "vocab_size"
        )
        if mask is not None and rows is not None and not 0 <= mask < rows:
            findings.append(
                Finding(
                    "fail",
                    f"mask token id {mask} is outside the embedding (vocab_size {rows})",
                    "",
                    "set dflash_config.mask_token_id to a reserved row below vocab_size",
                )
            )
        return findings

    def _offset_probe_findings(self, ctx: CheckContext, metrics: dict[str, Any]) -> list[Finding]:
        probe = {int(k): float(v) for k, v in (ctx.value("record.probes.offset_probe") or {}).items()}
        if not probe:
            return []
        metrics["offset_probe"] = probe
        if 0 not in probe:
            return [Finding("warn", "the offset probe has no result for offset 0", str(probe), "rerun the probe")]
        best_offset = max(probe, key=probe.__getitem__)
        gain = (probe[best_offset] - 1.0) / max(probe[0] - 1.0, 1e-9) - 1.0
        num_drafts = ctx.value("record.probes.offset_probe_drafts")
        if best_offset != 0 and num_drafts is not None and num_drafts < self.offset_probe_min_drafts:
            return [
                Finding(
                    "info",
                    f"offset probe inconclusive: {num_drafts} drafts are too few to judge the layer ids",
                    _offset_evidence(probe),
                    "rerun with more --max-requests or --max-new-tokens",
                )
            ]
        if (
            best_offset != 0
            and gain > self.offset_probe_margin
            and probe[best_offset] - probe[0] >= self.offset_probe_min_gain
        ):
            return [
                Finding(
                    "fail",
                    f"layer ids shifted by {best_offset:+d} give acceptance length {probe[best_offset]:.2f} vs "
                    f"{probe[0]:.2f} as configured",
                    _offset_evidence(probe),
                    f"shift dflash_config.target_layer_ids by {best_offset:+d} "
                    "(off-by-one: vLLM PR #42704, llama.cpp #25792)",
                )
            ]
        if best_offset == 0:
            return [Finding("info", "offset probe: the configured layer ids are the best", _offset_evidence(probe))]
        return [
            Finding(
                "info",
                "offset probe: no shifted layer ids accept "
                f"{self.offset_probe_margin:.0%} more tokens than the configured ones "
                f"(offset {best_offset:+d}: {probe[best_offset]:.2f} vs {probe[0]:.2f})",
                _offset_evidence(probe),
            )
        ]


def _offset_evidence(probe: dict[int, float]) -> str:
    figures = ", ".join(f"offset {k:+d}: {v:.2f}" for k, v in sorted(probe.items()))
    return f"mean acceptance length at every anchor of the replayed outputs (teacher-forced, full block): {figures}"


def _engine(ctx: CheckContext) -> dict[str, Any]:
    return ctx.engine_config or {}


def _trained_sample_method(raw: dict[str, Any]) -> str:
    """How the draft's own evaluation drafts under sampling: a speculators proposal type, else the
    official ``dflash_generate`` (samples drafts from the draft distribution: ``probabilistic``)."""
    spec = raw.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or []
    kind = spec.get("default_proposal_method") or next(
        (m.get("proposal_type") for m in methods if "proposal_type" in m), None
    )
    if kind is None:
        return "probabilistic"
    return "greedy" if str(kind).lower() == "greedy" else "probabilistic"


def _hybrid_tap_findings(ids: list[int], kinds: list[str] | None) -> list[Finding]:
    """On a hybrid target, which kind of layer each id taps (info). Every tap reads the residual stream
    after its layer whatever the kind: vLLM taps aux layer ``id + 1``, the stream entering the next layer
    (vllm 0.32.0, v1/worker/gpu_model_runner.py and qwen3_next.py / gpt_oss.py ``_maybe_add_hidden_state``),
    the same for gated-delta-net, Mamba and attention layers; so ids count every decoder layer."""
    if not kinds or not RECURRENT_KINDS & set(kinds) or any(not 0 <= i < len(kinds) for i in ids):
        return []
    tapped = ", ".join(f"{i} ({kinds[i]})" for i in ids)
    return [
        Finding(
            "info",
            f"target_layer_ids tap layers {tapped} of a hybrid target",
            f"{sum(kind in RECURRENT_KINDS for kind in kinds)} of its {len(kinds)} layers are recurrent; "
            "ids count every decoder layer, each tap reads the stream after its layer",
            "",
        )
    ]


def variant_findings(ctx: CheckContext, raw: dict[str, Any], normalised) -> list[Finding]:
    """The DFlash format rules: causality, layer-id convention, reserved mask row, own lm_head, draft sampling."""
    draft = normalised.config
    dflash = draft.get("dflash_config") or {}
    findings: list[Finding] = []
    # causal-trained vs served
    top, nested = raw.get("is_causal"), dflash.get("causal")
    if normalised.dialect != "speculators" and top is not None and nested is not None and bool(top) != bool(nested):
        findings.append(
            Finding(
                "fail",
                f"is_causal {top} contradicts dflash_config.causal {nested}",
                "vLLM obeys is_causal; the trainer that wrote dflash_config.causal meant the other",
                "keep the value the draft was trained with and delete the other key",
            )
        )
    elif normalised.dialect != "speculators" and nested is not None and top is None:
        findings.append(
            Finding(
                "warn",
                f"causality is set only by dflash_config.causal = {nested}",
                "vLLM honours it, but the official dflash 0.1.0 loop and engines that read only is_causal "
                "attend per layer type (sliding causal, full bidirectional) instead",
                f"also set top-level is_causal = {str(bool(nested)).lower()}",
            )
        )
    layer_types = draft.get("layer_types") or []
    if "sliding_attention" in layer_types and "full_attention" in layer_types and _engine(ctx).get("engine") == "vllm":
        findings.append(
            Finding(
                "warn",
                "the draft mixes sliding and full attention layers",
                f"layer_types {layer_types}; vLLM refuses mixed drafts unless VLLM_USE_V2_MODEL_RUNNER=1",
                "serve with VLLM_USE_V2_MODEL_RUNNER=1",
            )
        )
    # layer ids written in the +1 convention
    ids, num_layers = target_layer_ids(draft), config_value(decoder_config(ctx.target_config), "num_hidden_layers")
    if normalised.layer_id_offset == 0 and ids and num_layers is not None and max(ids) == num_layers and min(ids) >= 1:
        findings.append(
            Finding(
                "fail",
                f"target_layer_ids {ids} look like the +1 convention (speculators aux ids, GGUF target_layers)",
                f"the largest id equals the target's {num_layers} layers; z-lab ids are 0..{num_layers - 1}",
                f"write dflash_config.target_layer_ids = {[i - 1 for i in ids]}",
            )
        )
    if normalised.layer_id_offset:
        findings.append(
            Finding(
                "info",
                f"{normalised.dialect} layer ids {normalised.source_layer_ids} read as {ids}",
                "this dialect stores layer + 1 (vLLM converts with i - 1, its PR #40727)",
            )
        )
    # the mask row must be reserved, not a token with another job
    mask = mask_token_id(draft)
    specials = {
        name: config_value(ctx.target_config, name) for name in ("eos_token_id", "pad_token_id", "bos_token_id")
    }
    clash = [
        name
        for name, value in specials.items()
        if mask is not None and (value == mask or (isinstance(value, list) and mask in value))
    ]
    if clash:
        findings.append(
            Finding(
                "fail",
                f"mask token id {mask} is the target's {clash[0].removesuffix('_token_id')} token",
                "a mask row that is also a real token (often pad = eos) trains and serves differently "
                "(NeMo Automodel #2461)",
                "use a reserved, otherwise unused embedding row as the mask",
            )
        )
    # own lm_head / embeddings the engine replaces
    shapes = ctx.draft_weight_shapes or {}
    own = [name for name in ("lm_head.weight", "embed_tokens.weight") if name in shapes]
    if own and normalised.draft_vocab_size is None:
        findings.append(
            Finding(
                "warn",
                f"the draft ships its own {', '.join(own)}",
                "DFlash engines use the target's embedding and lm_head; a draft trained with its own head "
                "loses acceptance when it is replaced (vllm-ascend #11374)",
                "check the draft was trained with the target's head, or serve it with an engine that loads its own",
            )
        )
    elif normalised.draft_vocab_size is not None:
        findings.append(
            Finding(
                "info",
                f"the draft predicts over its own {normalised.draft_vocab_size}-token vocabulary",
                "its lm_head and d2t map draft ids to target ids; other target tokens are never drafted",
            )
        )
    # draft sampling method: engine vs training
    temperature = float(getattr(ctx.config, "temperature", 0.0) or 0.0)
    served = _engine(ctx).get("draft_sample_method")
    trained = _trained_sample_method(raw)
    if served is not None and temperature > 0 and served != trained:
        findings.append(
            Finding(
                "warn",
                f"the engine drafts {served} but the draft was evaluated with {trained} drafts",
                f"at temperature {temperature:g} the draft sample method changes acceptance "
                "(DFlash2 tau 3.19 -> 2.66 with greedy: syv-ai/qwen38-27b-rtx3090#73)",
                f'set draft_sample_method = "{trained}" in the speculative config',
            )
        )
    return findings


#: Tokens each engine drafts per step for a DFlash block of B (docs/engines.md#how-each-engine-counts-k): the
#: setting and the value that uses the whole block, and the engine's default.
_FULL_BLOCK_SETTINGS = (
    ("vLLM", "speculative_config.num_speculative_tokens", "B - 1", "none (required)"),
    ("SGLang", "--speculative-num-draft-tokens", "B", "the draft's block_size"),
    ("llama.cpp", "--spec-draft-n-max", "B - 1", "3 (common/common.h), clamped to B - 1"),
)


def served_format_findings(ctx: CheckContext, normalised) -> list[Finding]:
    """How the served engine reads this draft's format: block size, causality, and the K that uses the block."""
    draft = normalised.config
    engine = _engine(ctx)
    block = block_size(draft)
    findings: list[Finding] = []
    served_block = engine.get("dflash_block_size")
    if block is not None and served_block is not None and served_block != block:
        findings.append(
            Finding(
                "fail",
                f"the engine drafts blocks of {served_block} but the draft was trained with block_size {block}",
                f"--speculative-dflash-block-size {served_block} ({engine.get('engine')})",
                f"serve with --speculative-dflash-block-size {block} or drop the flag",
            )
        )
    dspark = (draft.get("architectures") or [""])[0] == DSPARK_ARCHITECTURE
    method = str(engine.get("method") or "")
    if method and dspark != ("dspark" in method):
        findings.append(
            Finding(
                "fail" if not dspark else "warn",
                f"the engine serves this {'DSpark' if dspark else 'DFlash'} draft with method {method}",
                "a DSpark draft adds a Markov head that only the DSpark proposers run (vLLM method dspark, "
                "llama.cpp --spec-type draft-dspark); a DFlash draft has none to run",
                f"serve it with method {'dspark' if dspark else 'dflash'}",
            )
        )
    types = draft.get("layer_types") or []
    top, nested = draft.get("is_causal"), (draft.get("dflash_config") or {}).get("causal")
    per_layer = top is None and nested is None and "sliding_attention" in types and "full_attention" in types
    if per_layer and engine.get("engine") in (None, "llamacpp"):
        findings.append(
            Finding(
                "warn",
                "the draft's sliding layers attend causally and its full layers bidirectionally, "
                "but llama.cpp applies one causality to every draft layer",
                f"layer_types {types}; llama.cpp reads dflash.attention.causal (absent: bidirectional everywhere, "
                "common/speculative.cpp llama_set_causal_attn), vLLM and the official loop decide per layer",
                "serve this draft with vLLM or SGLang, or expect lower acceptance on llama.cpp",
            )
        )
    if block is not None and not engine:
        settings = "; ".join(
            f"{name} {setting} = {value.replace('B - 1', str(block - 1)).replace('B', str(block))} (default {default})"
            for name, setting, value, default in _FULL_BLOCK_SETTINGS
        )
        findings.append(
            Finding(
                "info",
                f"serving the whole block of {block} takes: {settings}",
                "a smaller K leaves acceptance unused; `dflash-doctor sweep` measures how much per K",
            )
        )
    return findings
