"""The plugin entry point, discovered and run by SGLang's own plugin loader.

Subprocesses, because ``load_plugins`` runs once per process and patches SGLang classes
for good; each one prints what it saw as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.sglang

_SCRIPT = """
import importlib.metadata, json, os, sys
fake = os.environ.get("FAKE_SGLANG_VERSION")
if fake:
    real = importlib.metadata.version
    importlib.metadata.version = lambda d: fake if d == "sglang" else real(d)
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import ServerArgs
from dmi_sglang.adapters.sglang_v0519._state import STATE
import pkgutil
from sglang.srt.managers.scheduler import Scheduler
out = {"patched": hasattr(ServerArgs.check_server_args, "__wrapped__"),
       "registered": STATE.registered, "monitoring": STATE.monitoring,
       "hooks": STATE.hooks, "problems": STATE.problems,
       "factory": type(STATE.factory).__name__,
       "unpatched": [t for t in STATE.hooks
                     if not hasattr(pkgutil.resolve_name(t), "__wrapped__")],
       "rpcs": [m for m in ("dmi_stop_monitoring", "dmi_assert_active")
                if hasattr(Scheduler, m)]}
if len(sys.argv) > 1:
    server_args = ServerArgs(model_path=sys.argv[1], device="cuda", tp_size=2)
    server_args.resolve_once()
    try:
        server_args.check_server_args()
        out["check"] = "accepted"
    except Exception as exc:
        out["check"] = f"{type(exc).__name__}: {exc}"
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def run_loader() -> Callable[..., dict[str, Any]]:
    def run(env: dict[str, str], *args: str) -> dict[str, Any]:
        clean = {k: v for k, v in os.environ.items()
                 if not k.startswith("DMX_") and k != "SGLANG_PLUGINS"}
        proc = subprocess.run([sys.executable, "-c", _SCRIPT, *args], env={**clean, **env},
                              capture_output=True, text=True, timeout=180, check=False)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert lines, proc.stdout + proc.stderr
        return json.loads(lines[-1].removeprefix("RESULT "))  # type: ignore[no-any-return]

    return run


def test_the_entry_point_is_declared() -> None:
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("dmi") == "dmi_sglang.app.plugin:register"


def test_sglang_loads_it_and_the_main_process_check_refuses_tp2(
    run_loader: Callable[..., dict[str, Any]], qwen3_dir: Path
) -> None:
    out = run_loader({"DMX_SGLANG_ENABLE": "1"}, str(qwen3_dir))
    assert out["registered"]
    assert out["monitoring"]
    assert out["patched"]
    from dmi_sglang.adapters.sglang_v0519.runtime_hooks import HOOKS

    assert out["hooks"] == ["sglang.srt.server_args.ServerArgs.check_server_args",
                            *(target for target, _, _ in HOOKS)]
    assert out["unpatched"] == []
    assert out["rpcs"] == ["dmi_stop_monitoring", "dmi_assert_active"]
    assert out["problems"] == []
    assert out["check"].startswith("UnsupportedConfigurationError")
    assert "tp_size=2; only tp_size=1" in out["check"]


@pytest.mark.parametrize(
    "env",
    [{"DMX_SGLANG_ENABLE": "0", "DMX_HOOK_SELECTION": "logits"},
     {"DMX_SGLANG_ENABLE": "1", "SGLANG_PLUGINS": "none"},
     {}],
    ids=["dmx-disabled", "sglang-plugins-none", "auto-without-dmx"],
)
def test_baseline_installs_nothing(
    run_loader: Callable[..., dict[str, Any]], qwen3_dir: Path, env: dict[str, str]
) -> None:
    out = run_loader(env, str(qwen3_dir))
    assert not out["patched"]
    assert out["hooks"] == []
    assert out["check"] == "accepted"  # SGLang itself accepts tp_size=2
    assert out["registered"] is ("SGLANG_PLUGINS" not in env)


def test_register_never_raises_and_records_problems(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    from dmi_sglang.adapters.sglang_v0519 import _state, plugin
    from dmi_sglang.app.composition import PipelineFactory
    from dmi_sglang.errors import UnsupportedConfigurationError

    calls: list[str] = []
    monkeypatch.setattr(HookRegistry, "register",
                        classmethod(lambda cls, target, *a, **k: calls.append(target)))
    monkeypatch.setattr(_state, "STATE", _state.PluginState())
    monkeypatch.setenv("DMX_SGLANG_ENABLE", "maybe")
    monkeypatch.setattr(plugin, "_version", lambda dist: "0.6.0" if dist == "sglang" else
                        "2.11.0")
    factory = PipelineFactory()
    plugin.register(factory)
    plugin.register(factory)  # idempotent
    from dmi_sglang.adapters.sglang_v0519.runtime_hooks import HOOKS

    assert calls == ["sglang.srt.server_args.ServerArgs.check_server_args",
                     *(target for target, _, _ in HOOKS)]
    assert _state.STATE.factory is factory
    problems = _state.pending_problems(check_torch=False)
    assert len(problems) == 2
    assert "DMX_SGLANG_ENABLE='maybe'" in problems[0]
    assert "sglang 0.6.0 is installed" in problems[1]
    assert "torch 2.11.0" in _state.pending_problems(check_torch=True)[2]
    assert _state.registration_problems() == problems  # no CUDA here: torch not checked
    with pytest.raises(UnsupportedConfigurationError, match=r"sglang 0\.6\.0"):
        _state.raise_pending_problems(check_torch=False)

    def boom() -> bool:
        msg = "unexpected"
        raise RuntimeError(msg)

    monkeypatch.setattr(_state, "STATE", _state.PluginState())
    monkeypatch.setattr(plugin, "monitoring_requested", boom)
    plugin.register(factory)
    assert _state.STATE.problems == ["dmi-sglang register() failed: RuntimeError('unexpected')"]


def test_the_entry_point_registers_the_installed_sglangs_adapter_with_the_factory(
    run_loader: Callable[..., dict[str, Any]], qwen3_dir: Path
) -> None:
    out = run_loader({"DMX_SGLANG_ENABLE": "1"})
    assert out["factory"] == "PipelineFactory"


def test_an_sglang_without_an_adapter_is_refused_with_the_supported_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dmi_sglang.adapters.sglang_v0519.adapter import ADAPTER
    from dmi_sglang.app import composition
    from dmi_sglang.errors import UnsupportedConfigurationError

    supported = r"sglang 0\.5\.23 is installed; dmi-sglang supports sglang==0\.5\.19"
    with pytest.raises(UnsupportedConfigurationError, match=supported):
        composition.sglang_adapter("0.5.23")
    assert composition.sglang_adapter("0.5.19").sglang_version == "0.5.19"
    monkeypatch.setattr(composition, "installed_sglang", lambda: "0.5.23")
    assert composition.nearest_sglang_adapter() is ADAPTER
    registered: list[object] = []
    monkeypatch.setattr(ADAPTER, "register", registered.append)
    monkeypatch.setenv("DMX_SGLANG_ENABLE", "1")
    composition.register_plugin()  # never raises: SGLang would swallow it
    assert len(registered) == 1


def test_a_monitored_engine_on_an_sglang_without_an_adapter_is_refused_at_startup(
    run_loader: Callable[..., dict[str, Any]], qwen3_dir: Path
) -> None:
    out = run_loader({"DMX_SGLANG_ENABLE": "1", "FAKE_SGLANG_VERSION": "0.6.0"},
                     str(qwen3_dir))
    assert out["patched"]
    assert any("sglang 0.6.0 is installed" in p for p in out["problems"])
    assert out["check"].startswith("UnsupportedConfigurationError")
    assert "sglang 0.6.0 is installed; this adapter supports exactly sglang==0.5.19" in (
        out["check"])
