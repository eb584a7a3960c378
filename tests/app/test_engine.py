"""DMIEngine on CPU: settings transport, lazy imports, handles, lifecycle errors.

The real ``sglang.Engine`` cannot start without a GPU, so its ``__init__``/``generate``/
``collective_rpc``/``shutdown`` are replaced by recording fakes; everything DMIEngine
does around them is the code under test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Any

import pytest

from dmi_sglang.errors import CaptureError, ConfigurationError, DMIWarning


def _engine_class() -> Any:
    try:
        from sglang.srt.entrypoints.engine import Engine
    except ImportError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"sglang must be importable under CI=true: {exc}")
        pytest.skip("sglang is not installed")
    return Engine


class FakeEngineCalls:
    def __init__(self) -> None:
        self.env_at_start: dict[str, str] = {}
        self.kwargs: dict[str, Any] = {}
        self.rpcs: list[tuple[str, dict[str, Any]]] = []
        self.fail_start: BaseException | None = None
        self.fail_rpc: dict[str, str] = {}
        self.started = threading.Event()
        self.release = threading.Event()
        self.block = False
        self.shutdowns = 0
        self.generated: list[dict[str, Any]] = []


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeEngineCalls:
    engine_class = _engine_class()
    calls = FakeEngineCalls()

    def init(self: Any, **kwargs: Any) -> None:
        self.send_to_rpc = "rpc-socket"
        calls.env_at_start = {k: v for k, v in os.environ.items() if k.startswith("DMX_")}
        calls.kwargs = kwargs
        calls.started.set()
        if calls.block:
            calls.release.wait(10)
        if calls.fail_start is not None:
            raise calls.fail_start

    def generate(self: Any, prompt: Any = None, sampling_params: Any = None,
                 input_ids: Any = None, **kwargs: Any) -> Any:  # SGLang's leading ones
        calls.generated.append({**kwargs, "sampling_params": sampling_params,
                                "input_ids": input_ids})
        items = [{"text": "x", "output_ids": [1], "meta_info": {"id": f"rid-{i}"}}
                 for i, _ in enumerate(prompt if isinstance(prompt, list) else [prompt])]
        return items if isinstance(prompt, list) else items[0]

    from sglang.srt.managers import io_struct

    answers: list[Any] = []

    def send(socket: Any, request: Any, flags: int = 0) -> None:
        assert socket == "rpc-socket"
        calls.rpcs.append((request.method, request.parameters))
        failure = calls.fail_rpc.get(request.method)
        answers.append(io_struct.RpcReqOutput(success=failure is None, message=failure or ""))

    def recv(socket: Any, flags: int = 0) -> Any:
        return answers.pop(0)

    def shutdown(self: Any) -> None:
        calls.shutdowns += 1

    monkeypatch.setattr(engine_class, "__init__", init)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(engine_class, "generate", generate)
    monkeypatch.setattr(io_struct, "sock_send", send)
    monkeypatch.setattr(io_struct, "sock_recv", recv)
    monkeypatch.setattr(engine_class, "shutdown", shutdown)
    return calls


def _engine(**kwargs: Any) -> Any:
    from dmi_sglang.app.engine import DMIEngine

    return DMIEngine(model_path="/models/Qwen3-0.6B", **kwargs)


def test_settings_travel_as_env_and_are_restored(fake: FakeEngineCalls,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Any) -> None:
    monkeypatch.setenv("DMX_RING_PINNED_MB", "2048")
    monkeypatch.chdir(tmp_path)
    engine = _engine(dmx_model_id="my-run", dmx_hook_selection="resid_pre,final_ln",
                     dmx_ring_payload_mb=512, mem_fraction_static=0.5)
    env = fake.env_at_start
    assert env["DMX_SGLANG_ENABLE"] == "1"
    assert env["DMX_MODEL_ID"] == "my-run"
    assert env["DMX_HOOK_SELECTION"] == "resid_pre,final_ln"
    assert env["DMX_RING_PAYLOAD_MB"] == "512"
    assert env["DMX_RING_PINNED_MB"] == "2048"  # the parent's variables still count
    assert env["DMX_DB_URL"] == f"chdb://{tmp_path}/dmi-captures"
    assert fake.kwargs == {"model_path": "/models/Qwen3-0.6B", "mem_fraction_static": 0.5}
    after = {k: v for k, v in os.environ.items() if k.startswith("DMX_")}
    assert after == {"DMX_RING_PINNED_MB": "2048"}
    assert fake.rpcs == [("dmi_assert_active", {"run_id": "my-run"})]
    assert engine.dmi_run_id == "my-run"


def test_env_restored_when_start_fails(fake: FakeEngineCalls) -> None:
    fake.fail_start = RuntimeError("scheduler died")
    with pytest.raises(RuntimeError, match="scheduler died"):
        _engine(dmx_model_id="r")
    assert not [k for k in os.environ if k.startswith("DMX_")]


def test_bad_settings_refused_before_anything_starts(fake: FakeEngineCalls) -> None:
    with pytest.raises(ConfigurationError, match="DMX_RING_PAYLOAD_MB='-5'"):
        _engine(dmx_ring_payload_mb=-5)
    with pytest.raises(ConfigurationError, match="unknown keyword dmx_hooks"):
        _engine(dmx_hooks="resid_pre")
    assert not fake.started.is_set()


def test_a_selection_the_local_model_cannot_have_is_refused_before_anything_starts(
        fake: FakeEngineCalls, tmp_path: Any) -> None:
    # found in review: serve and capture checked it, DMIEngine let SGLang start first
    import json

    from tests.sglang.conftest import QWEN3_CONFIG

    model = tmp_path / "qwen3"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_CONFIG))  # 4 layers
    from dmi_sglang.app.engine import DMIEngine

    with pytest.raises(ConfigurationError, match="outside the model's layers 0-3"):
        DMIEngine(model_path=str(model), dmx_model_id="r", dmx_hook_selection="resid_pre@9")
    assert not fake.started.is_set()


def test_no_cuda_is_one_clear_error_before_anything_starts(
        fake: FakeEngineCalls, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError, match=r"DMIEngine needs an NVIDIA GPU with CUDA"):
        _engine(dmx_model_id="r")  # a DMIWarning here would fail: warnings are errors
    assert not fake.started.is_set()
    assert not (tmp_path / "dmi-captures").exists()  # no run id was claimed


def test_attach_failure_is_loud(fake: FakeEngineCalls) -> None:
    fake.fail_rpc["dmi_assert_active"] = "DMI monitoring is not active in this scheduler"
    with pytest.raises(CaptureError, match=r"did not attach.*not active"):
        _engine()
    assert fake.shutdowns == 1


def test_second_engine_while_one_starts_is_refused(fake: FakeEngineCalls) -> None:
    fake.block = True
    errors: list[BaseException] = []
    first = threading.Thread(target=lambda: _engine(dmx_model_id="a"))
    first.start()
    assert fake.started.wait(10)
    try:
        _engine(dmx_model_id="b")
    except RuntimeError as exc:
        errors.append(exc)
    finally:
        fake.release.set()
        first.join(10)
    assert errors
    assert "another DMIEngine is starting" in str(errors[0])


def test_generate_tags_outputs_with_lazy_handles(fake: FakeEngineCalls, tmp_path: Any) -> None:
    engine = _engine(dmx_model_id="run-x", dmx_db_url=f"chdb://{tmp_path}/nowhere")
    outs = engine.generate(prompt=["a", "b"], sampling_params={"max_new_tokens": 1})
    handles = [o["dmi_internal"] for o in outs]
    assert [(h.run_id, h.request_id) for h in handles] == [("run-x", "rid-0"),
                                                           ("run-x", "rid-1")]
    assert not (tmp_path / "nowhere").exists()  # free until used
    single = engine.generate(prompt="a")
    assert single["dmi_internal"].request_id == "rid-0"
    with pytest.raises(ValueError, match="stream=True"):
        engine.generate(prompt="a", stream=True)
    with pytest.raises(ValueError, match=r"image_data=\.\.\.\) is refused: .*no token ids"):
        engine.generate(prompt="a", image_data="x.png")


def test_generate_sends_a_capture_choice_as_custom_params(fake: FakeEngineCalls,
                                                          tmp_path: Any) -> None:
    engine = _engine(dmx_model_id="run-y", dmx_db_url=f"chdb://{tmp_path}/nowhere")
    engine.generate(prompt=["a", "b"], sampling_params={"max_new_tokens": 1},
                    dmi_capture=[True, False])
    assert fake.generated[-1]["sampling_params"] == [
        {"max_new_tokens": 1, "custom_params": {"dmi_capture": True}},
        {"max_new_tokens": 1, "custom_params": {"dmi_capture": False}}]
    engine.generate(prompt="a")
    assert fake.generated[-1]["sampling_params"] is None  # nothing added unless asked
    with pytest.raises(ValueError, match="dmi_capture=1 is invalid"):
        engine.generate(prompt="a", dmi_capture=1)
    # found in review: SGLang fails on too few with a bare IndexError, drops too many
    sent = len(fake.generated)
    for kwargs, words in (({"prompt": ["a", "b", "c"]}, "2 values for 3 prompts"),
                          ({"prompt": "a"}, "2 values for one prompt"),
                          ({"input_ids": [1, 2, 3]}, "2 values for one prompt"),
                          ({"input_ids": [[1], [2], [3]]}, "2 values for 3 prompts")):
        with pytest.raises(ValueError, match=words):
            engine.generate(**kwargs, dmi_capture=[True, False])
    assert len(fake.generated) == sent  # nothing sent


def test_stop_is_terminal_and_failures_stick(fake: FakeEngineCalls) -> None:
    engine = _engine()
    engine.dmi_stop_monitoring()
    engine.dmi_stop_monitoring()
    assert [m for m, _ in fake.rpcs].count("dmi_stop_monitoring") == 1
    with pytest.raises(CaptureError, match="stopped"):
        engine.generate(prompt="a")
    engine.shutdown()
    failing = _engine()
    fake.fail_rpc["dmi_stop_monitoring"] = "sink failed: disk full"
    for _ in range(2):
        with pytest.raises(CaptureError, match="disk full"):
            failing.dmi_stop_monitoring()
    assert [m for m, _ in fake.rpcs].count("dmi_stop_monitoring") == 2


def test_shutdown_without_stop_warns(fake: FakeEngineCalls) -> None:
    engine = _engine(dmx_model_id="r1")
    with pytest.warns(DMIWarning, match="'r1' are incomplete"):
        engine.shutdown()
    assert fake.shutdowns == 1


def test_no_persistence_handle_says_so(fake: FakeEngineCalls) -> None:
    engine = _engine(dmx_db_url="none")
    handle = engine.generate(prompt="a")["dmi_internal"]
    assert handle.available is False
    from dmi_sglang.errors import IncompleteCaptureError

    with pytest.raises(IncompleteCaptureError, match="stored nothing"):
        _ = handle.hidden_states


def test_imports_are_lazy_and_aliased() -> None:
    _engine_class()
    code = (
        "import sys, dmi_sglang, dmi_sglang_integration\n"
        "assert 'sglang' not in sys.modules and 'torch' not in sys.modules\n"
        "from dmi_sglang_integration import DMIEngine as A\n"
        "from dmi_sglang import DMIEngine as B\n"
        "from dmi_sglang.app.engine import DMIEngine as C\n"
        "from dmi_sglang.app import DMIEngine as D, open_store\n"
        "import dmi_sglang\n"
        "assert A is B is C is D and open_store is dmi_sglang.open_store\n"
        "from sglang.srt.entrypoints.engine import Engine\n"
        "assert issubclass(C, Engine)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_plugin_entry_point_imports_no_framework_when_monitoring_is_off() -> None:
    code = (
        "import os, sys\n"
        "os.environ['DMX_SGLANG_ENABLE'] = '0'\n"
        "from dmi_sglang.app.plugin import register\n"
        "register()\n"
        "bad = [m for m in ('torch', 'sglang', 'clickhouse_connect', 'chdb') "
        "if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_an_sglang_without_an_adapter_is_refused_before_anything_starts(
        fake: FakeEngineCalls, monkeypatch: pytest.MonkeyPatch) -> None:
    from dmi_sglang.app import composition
    from dmi_sglang.errors import UnsupportedConfigurationError

    monkeypatch.setattr(composition, "installed_sglang", lambda: "0.6.0")
    with pytest.raises(UnsupportedConfigurationError, match=r"sglang 0\.6\.0 is installed"):
        _engine(dmx_db_url="none")
    assert not fake.started.is_set()


def test_ignored_settings_are_logged_from_the_environment_and_keywords(
        fake: FakeEngineCalls, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from structlog.testing import capture_logs

    monkeypatch.setenv("DMX_CH_PARALLELISM", "4")
    monkeypatch.chdir(tmp_path)
    with capture_logs() as logs:
        _engine(dmx_model_id="r", dmx_step_debug=1)
    ignored = sorted(e["variable"] for e in logs if e["event"] == "setting ignored")
    assert ignored == ["DMX_CH_PARALLELISM", "dmx_step_debug"]


# -- found in review: keywords, enable, dmi_capture, positional arguments, shutdown ------
def test_a_store_keyword_replaces_every_store_variable(
        fake: FakeEngineCalls, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DMX_DB_URL", "chdb:///data/old-store")
    engine = _engine(dmx_model_id="r", dmx_db_host="none")  # "store nothing" wins
    assert engine.dmi_settings.store().url == "none"
    assert fake.env_at_start["DMX_DB_URL"] == "none"


def test_a_store_keyword_wins_over_an_environment_null_mode(
        fake: FakeEngineCalls, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("DMX_NULL_MODE", "1")
    engine = _engine(dmx_model_id="r", dmx_db_url=f"chdb://{tmp_path}/new-store")
    assert engine.dmi_settings.store().url == f"chdb://{tmp_path}/new-store"


def test_sglang_enable_0_is_refused_before_anything_starts(fake: FakeEngineCalls) -> None:
    with pytest.raises(ConfigurationError, match="dmx_sglang_enable=0"):
        _engine(dmx_model_id="r", dmx_sglang_enable=0)
    assert not fake.started.is_set()


@pytest.mark.parametrize("capture", [(True, False), (True, False, True, False)])
def test_a_dmi_capture_tuple_of_another_length_is_refused(
        fake: FakeEngineCalls, tmp_path: Any, capture: tuple[bool, ...]) -> None:
    engine = _engine(dmx_model_id="r", dmx_db_url=f"chdb://{tmp_path}/s")
    sent = len(fake.generated)
    with pytest.raises(ValueError, match="dmi_capture"):
        engine.generate(prompt=["a", "b", "c"], sampling_params={"max_new_tokens": 1},
                        dmi_capture=capture)
    assert len(fake.generated) == sent


def test_arguments_by_position_get_the_same_checks(
        fake: FakeEngineCalls, tmp_path: Any) -> None:
    engine = _engine(dmx_model_id="r", dmx_db_url=f"chdb://{tmp_path}/s")
    with pytest.raises(ValueError, match="image_data"):
        engine.generate("a", {"max_new_tokens": 1}, None, "x.png")
    with pytest.raises(ValueError, match="2 values for 3 prompts"):
        engine.generate(None, None, [[1], [2], [3]], dmi_capture=[True, False])
    with pytest.raises(TypeError, match="sampling_params"):
        engine.generate("a", {"max_new_tokens": 1}, sampling_params={})
    engine.generate(["a", "b"], {"max_new_tokens": 1}, dmi_capture=[True, False])
    sent = fake.generated[-1]["sampling_params"]
    assert [p["custom_params"]["dmi_capture"] for p in sent] == [True, False]


def test_stop_after_shutdown_is_a_capture_error(
        fake: FakeEngineCalls, monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.entrypoints.engine import Engine

    engine = _engine(dmx_model_id="r")
    monkeypatch.setattr(Engine, "shutdown", lambda self: None)
    with pytest.warns(DMIWarning):
        engine.shutdown()
    with pytest.raises(CaptureError, match="after shutdown"):
        engine.dmi_stop_monitoring()
    with pytest.raises(CaptureError, match="after shutdown"):  # the same, every time
        engine.dmi_stop_monitoring()
    with pytest.raises(CaptureError, match="captures no more"):
        engine.generate(prompt="a")


def test_async_generate_gets_the_same_checks_and_handles(
        fake: FakeEngineCalls, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from sglang.srt.entrypoints.engine import Engine

    sent: list[dict[str, Any]] = []

    async def async_generate(self: Any, prompt: Any = None, sampling_params: Any = None,
                             **kwargs: Any) -> Any:
        sent.append({"prompt": prompt, "sampling_params": sampling_params, **kwargs})
        return [{"meta_info": {"id": f"rid-{i}"}} for i, _ in enumerate(prompt)]

    monkeypatch.setattr(Engine, "async_generate", async_generate)
    engine = _engine(dmx_model_id="r", dmx_db_url=f"chdb://{tmp_path}/s")
    out = asyncio.run(engine.async_generate(["a", "b"], {"max_new_tokens": 1},
                                            dmi_capture=[True, False]))
    assert [o["dmi_internal"].request_id for o in out] == ["rid-0", "rid-1"]
    assert [p["custom_params"]["dmi_capture"] for p in sent[-1]["sampling_params"]] == [
        True, False]
    with pytest.raises(ValueError, match="stream=True"):
        asyncio.run(engine.async_generate(prompt=["a"], stream=True))
    with pytest.raises(ValueError, match="2 values for 3 prompts"):
        asyncio.run(engine.async_generate(prompt=["a", "b", "c"], dmi_capture=[True, False]))
    assert len(sent) == 1  # nothing else sent
