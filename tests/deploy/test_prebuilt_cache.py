"""download-weights finds a checkpoint baked into an image (TGI_PREBUILT_HUB_CACHE) when the
hub cache folder (a mounted /data volume in the image) does not hold it."""

from __future__ import annotations

from pathlib import Path

from text_generation_server.download import resolve_local
from text_generation_server.env import HubEnv

MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def make_snapshot(cache: Path, revision: str) -> Path:
    repo = cache / ("models--" + MODEL_ID.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot / "model.safetensors").write_bytes(b"")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def test_prebuilt_cache_is_searched_after_the_hub_cache(tmp_path: Path) -> None:
    hub, prebuilt = tmp_path / "data", tmp_path / "opt-models"
    hub.mkdir()
    baked = make_snapshot(prebuilt, "baked")
    assert resolve_local(MODEL_ID, hub=HubEnv.read({"HUGGINGFACE_HUB_CACHE": str(hub)})) is None
    caches = HubEnv.read({"HUGGINGFACE_HUB_CACHE": str(hub), "TGI_PREBUILT_HUB_CACHE": str(prebuilt)})
    assert resolve_local(MODEL_ID, hub=caches) == baked
    # A checkpoint in the (writable) hub cache wins over the baked one.
    own = make_snapshot(hub, "own")
    assert resolve_local(MODEL_ID, hub=caches) == own
