"""How each draft kind is served: what vLLM, SGLang and llama.cpp take for it, declared once per kind.

This is the serving half of the kind registry (:mod:`dflash_doctor.models.draft_kinds`). It lives apart
because the registry imports torch and the engine, while the views that write a serving setting (the
head-to-head pages, ``tune``'s advice) must run in the light install, which has neither: this module
imports nothing of the model stack, so a view reads a kind's serving here by its name.

A built-in kind's declaration is a :func:`register_kind_serving` call below, and its
:class:`~dflash_doctor.models.draft_kinds.DraftKind` holds it as ``serving``; a kind registered from
elsewhere (a plugin) only sets ``serving`` on its ``DraftKind``: ``register_draft_kind`` registers it here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class KindServing:
    """How the serving engines serve one kind.

    ``name``: the kind's name, as in the registry. ``vllm_method``: the ``"method"`` of vLLM's
    ``--speculative-config``. ``vllm_settings``: the kind's own settings vLLM takes in that config, by
    vLLM's names (the run records them under the same names in its draft facts). ``has_checkpoint``: the
    kind has a draft checkpoint of its own, named as the config's ``"model"``; False for a kind served from
    its settings (n-gram, suffix) or from the target's own checkpoint (MTP). ``sglang`` and ``llamacpp``:
    the flags that serve the kind in SGLang and llama.cpp, with ``{k}`` the drafted tokens per step and
    ``{k_with_anchor}`` K + 1 (SGLang's ``--speculative-num-draft-tokens`` counts the anchor), DRAFT the
    draft checkpoint; None where that engine does not serve the kind.
    """

    name: str
    vllm_method: str
    vllm_settings: tuple[str, ...] = ()
    has_checkpoint: bool = True
    sglang: str | None = None
    llamacpp: str | None = None

    def vllm_config(self, k: int, facts: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """vLLM's ``--speculative-config`` serving this kind at ``k`` drafted tokens: the method, DRAFT as the
        ``"model"`` for a kind with a checkpoint, the kind's own settings where ``facts`` (a run's draft facts)
        hold them."""
        config: dict[str, Any] = {"method": self.vllm_method}
        if self.has_checkpoint:
            config["model"] = "DRAFT"
        config.update({key: facts[key] for key in self.vllm_settings if facts and key in facts})
        config["num_speculative_tokens"] = k
        return config

    def serves(self, engine: str) -> bool:
        """Whether flags for ``engine`` (``"sglang"`` or ``"llamacpp"``) are declared for this kind."""
        return self._template(engine) is not None

    def _template(self, engine: str) -> str | None:
        return {"sglang": self.sglang, "llamacpp": self.llamacpp}[engine]

    def flags(self, engine: str, k: int | None) -> str:
        """The flags serving this kind in ``engine`` (``"sglang"`` or ``"llamacpp"``) at ``k`` drafted tokens
        (None: written as K, for a setting whose K the reader picks), or a sentence saying the engine is not
        named for this kind."""
        template = self._template(engine)
        if template is None:
            return f"not named for a {self.name} speculator here: serve it with vLLM (docs/speculators.md)"
        if k is None:
            return template.format(k="K", k_with_anchor="K+1")
        return template.format(k=k, k_with_anchor=k + 1)


_SERVING: dict[str, KindServing] = {}


def register_kind_serving(serving: KindServing) -> KindServing:
    """Add a kind's serving; the same declaration again is kept as it is (``register_draft_kind`` registers
    the serving of every kind it adds, a built-in's included), another one under a taken name is refused."""
    if _SERVING.setdefault(serving.name, serving) is not serving:
        raise ValueError(f"draft kind {serving.name!r} already has another serving declaration")
    return serving


def kind_serving(name: str) -> KindServing | None:
    """The serving declared for the kind called ``name``; None for a kind this install does not know (a run
    written by a plugin kind, read where the plugin is not loaded)."""
    return _SERVING.get(name)


DFLASH = register_kind_serving(
    KindServing(
        name="dflash",
        vllm_method="dflash",
        sglang="--speculative-algorithm DFLASH --speculative-draft-model-path DRAFT "
        "--speculative-num-draft-tokens {k_with_anchor}",
        llamacpp="-md DRAFT.gguf --spec-type draft-dflash --spec-draft-n-max {k}",
    )
)
NGRAM = register_kind_serving(
    KindServing(
        name="ngram",
        vllm_method="ngram",
        vllm_settings=("prompt_lookup_min", "prompt_lookup_max"),
        has_checkpoint=False,
    )
)
SUFFIX = register_kind_serving(
    KindServing(
        name="suffix",
        vllm_method="suffix",
        vllm_settings=(
            "suffix_decoding_max_tree_depth",
            "suffix_decoding_max_cached_requests",
            "suffix_decoding_max_spec_factor",
            "suffix_decoding_min_token_prob",
        ),
        has_checkpoint=False,
    )
)
EAGLE3 = register_kind_serving(
    KindServing(
        name="eagle3",
        vllm_method="eagle3",
        sglang="--speculative-algorithm EAGLE3 --speculative-draft-model-path DRAFT --speculative-num-steps {k} "
        "--speculative-eagle-topk 1 --speculative-num-draft-tokens {k_with_anchor}",
    )
)
MTP = register_kind_serving(KindServing(name="mtp", vllm_method="mtp", has_checkpoint=False))
AUTOREGRESSIVE = register_kind_serving(
    KindServing(name="autoregressive", vllm_method="draft_model", llamacpp="-md DRAFT.gguf --spec-draft-n-max {k}")
)
