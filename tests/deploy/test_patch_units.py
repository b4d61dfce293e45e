"""The upstream patch's pieces that need no upstream checkout: the start-up hook is inert
unless asked for, configuration errors name what to change, and code that is not upstream's
3.3.x CausalLM (here: our own server's) is refused by name."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "patches"))

from tgi_layerskip_patch import boot, compat  # noqa: E402
from tgi_layerskip_patch.config import PatchConfig  # noqa: E402


@pytest.fixture
def clean_meta_path() -> Iterator[None]:
    saved = list(sys.meta_path)
    yield
    sys.meta_path[:] = saved


def hooks() -> int:
    return sum(isinstance(f, boot._PatchOnImport) for f in sys.meta_path)


@pytest.mark.usefixtures("clean_meta_path")
def test_the_startup_hook_is_installed_only_when_a_mode_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    for value in (None, "", "off", "OFF"):
        if value is None:
            monkeypatch.delenv(boot.MODE_VARIABLE, raising=False)
        else:
            monkeypatch.setenv(boot.MODE_VARIABLE, value)
        boot.install()
        assert hooks() == 0
    monkeypatch.setenv(boot.MODE_VARIABLE, "shadow")
    boot.install()
    boot.install()
    assert hooks() == 1
    assert boot._PatchOnImport().find_spec("json", None) is None, "only causal_lm is intercepted"


@pytest.mark.parametrize("mode,policy,message", [
    ("verified", None, "not provided by the patch"),
    ("fast", None, "is not known"),
    ("lossy", None, "needs TGI_LAYER_SKIP_POLICY"),
    ("shadow", "/nonexistent/policy.json", "is not a file"),
])
def test_configuration_errors_name_the_variable(mode: str, policy: str | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PatchConfig(mode, Path(policy) if policy else None)


def test_configuration_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    policy = tmp_path / "policy.json"
    policy.write_text("{}")
    monkeypatch.setenv("TGI_LAYER_SKIP_MODE", " Lossy ")
    monkeypatch.setenv("TGI_LAYER_SKIP_POLICY", str(policy))
    monkeypatch.delenv("TGI_LAYER_SKIP_REPORT", raising=False)
    assert PatchConfig.from_env() == PatchConfig("lossy", policy, None)


def test_our_own_servers_causal_lm_is_not_taken_for_upstreams() -> None:
    from text_generation_server.engine import causal_lm

    with pytest.raises(compat.UnknownUpstreamError) as refused:
        compat.check_upstream(causal_lm)
    text = str(refused.value)
    assert "refuses to patch this TGI" in text and "text-generation-server 3.3.6.post1" in text
    assert "Unset TGI_LAYER_SKIP_MODE" in text


def test_a_changed_signature_is_named() -> None:
    module = ModuleType("fake_causal_lm")

    class CausalLMBatch:
        requests: list[int]

    class CausalLM:
        def generate_token(self, batch: object, extra: int) -> None: ...
        def forward(self, input_ids: object) -> None: ...

    module.CausalLM, module.CausalLMBatch = CausalLM, CausalLMBatch  # type: ignore[attr-defined]
    with pytest.raises(compat.UnknownUpstreamError, match=r"generate_token\(self, batch.*extra") as refused:
        compat.check_upstream(module)
    assert "CausalLMBatch lacks fields" in str(refused.value)
