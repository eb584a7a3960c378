"""Typed settings: defaults, resolution, validation, env round trip."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dmi_sglang.domain.settings import (
    Enable,
    Settings,
    ignored_variables,
    monitoring_requested,
)
from dmi_sglang.domain.store_config import StoreConfig, StoreKind
from dmi_sglang.errors import ConfigurationError

NOW = datetime(2026, 11, 29, 15, 4, 5, tzinfo=UTC)


def test_defaults_match_the_settings_table() -> None:
    s = Settings.from_env({})
    assert s.enable is Enable.AUTO
    assert s.hook_selection == "sglang-full"
    assert (s.ring_payload_mb, s.ring_pinned_mb, s.ring_task_entries) == (1024, 1024, 65536)
    assert s.drain_flush_timeout_us == 400_000
    assert s.gpu_padding_strip is True
    assert s.allow_prefix_cache is False
    assert (s.db_port, s.db_database, s.db_table) == (None, "default", "offload")
    assert (s.ch_user, s.ch_password, s.ch_secure, s.ch_compression) == ("default", "", False,
                                                                         "lz4")
    assert (s.ch_insert_rows, s.ch_insert_mb, s.ch_queue_mb) == (131_072, 0, 1024)
    assert s.preload_libstdcxx == "auto"


def _documented_defaults() -> dict[str, str | None]:
    """docs/settings.md's default of each variable its table names (a row may name
    several, ``DMX_DB_HOST`` / ``_PORT``, with as many values; ``unset``: None,
    ``empty``: "", a value's parenthesised note left out)."""
    doc = (Path(__file__).parents[2] / "docs" / "settings.md").read_text(encoding="utf-8")
    stated: dict[str, str | None] = {}
    for names, values in re.findall(r"^\| (`DMX_[^|]+?) \| ([^|]+?) \|", doc, re.MULTILINE):
        keys = [n.strip().strip("`") for n in names.split(" / ")]
        prefix = keys[0].rsplit("_", 1)[0]
        shown = [v.split(" (")[0].strip().strip("`") for v in values.split(" / ")]
        if len(shown) != len(keys):  # a retired variable's row: words, not values
            continue
        for key, value in zip(keys, shown, strict=True):
            name = key if key.startswith("DMX_") else prefix + key
            stated[name] = None if value == "unset" else "" if value == "empty" else value
    return stated


def test_the_settings_doc_states_the_defaults_the_settings_have() -> None:
    """Every variable of docs/settings.md that has a value when unset shows the value
    :class:`Settings` takes then (as ``to_env`` renders it), and every setting with a
    value is in the table."""
    stated = _documented_defaults()
    defaults = Settings.from_env({}).to_env()
    assert set(defaults) <= set(stated), set(defaults) - set(stated)
    assert {key: stated[key] for key in defaults} == defaults


def test_an_insert_holds_an_eighth_of_the_queue_unless_set() -> None:
    mib = 1 << 20

    def store(**env: str) -> StoreConfig:
        return Settings.from_env(env).resolve(model_path="/m", cwd="/w").store()

    assert store().insert_bytes == 128 * mib  # a 1024 MiB queue
    assert store(DMX_CH_QUEUE_MB="8192").insert_bytes == 128 * mib  # at most 128 MiB
    assert store(DMX_CH_QUEUE_MB="100").insert_bytes == 100 * mib // 8
    assert store(DMX_CH_QUEUE_MB="1").insert_bytes == 128 * 1024
    assert store(DMX_CH_INSERT_MB="128").insert_bytes == 128 * mib
    fixed = store(DMX_CH_INSERT_MB="512", DMX_CH_QUEUE_MB="100")
    assert fixed.insert_bytes == 512 * mib  # as set, even beyond the queue


def test_resolution_fills_run_id_and_embedded_store() -> None:
    s = Settings.from_env({}).resolve(model_path="/models/Qwen3-0.6B/", cwd="/work/x",
                                      now=NOW, token="abc123")
    assert s.model_id == "Qwen3-0.6B-20261129T150405-abc123"
    assert s.db_url == "chdb:///work/x/dmi-captures"
    store = s.store()
    assert store.kind is StoreKind.EMBEDDED
    assert store.path == "/work/x/dmi-captures"
    assert s.resolve(model_path="other") == s  # resolving twice changes nothing


def test_run_ids_are_unique_per_engine() -> None:
    a = Settings.from_env({}).resolve(model_path="m", now=NOW)
    b = Settings.from_env({}).resolve(model_path="m", now=NOW)
    assert a.model_id != b.model_id


def test_server_shorthand_and_none() -> None:
    s = Settings.from_env({"DMX_DB_HOST": "ch.local", "DMX_DB_PORT": "9123",
                           "DMX_DB_DATABASE": "caps", "DMX_DB_TABLE": "t"})
    store = s.resolve(model_path="m").store()
    assert store.kind is StoreKind.SERVER
    assert (store.host, store.port, store.database, store.table) == ("ch.local", 9123, "caps",
                                                                     "t")
    assert store.url == "http://ch.local:9123/caps"
    off = Settings.from_env({"DMX_DB_HOST": "none"}).resolve(model_path="m").store()
    assert off.kind is StoreKind.NONE
    url = Settings.from_env({"DMX_DB_URL": "https://h/db2", "DMX_DB_HOST": "ignored"})
    store = url.resolve(model_path="m").store()
    assert (store.kind, store.host, store.port, store.secure, store.database) == (
        StoreKind.SERVER, "h", 8443, True, "db2")
    assert Settings.from_env({"DMX_DB_URL": "none"}).resolve(model_path="m").store().kind \
        is StoreKind.NONE


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"DMX_RING_PAYLOAD_MB": "0"},
         "DMX_RING_PAYLOAD_MB='0' is invalid; accepted: an integer from 1 to 131,072"),
        ({"DMX_RING_PINNED_MB": "lots"}, "DMX_RING_PINNED_MB='lots'"),
        ({"DMX_SGLANG_ENABLE": "maybe"}, "DMX_SGLANG_ENABLE='maybe' is invalid; accepted: auto"),
        ({"DMX_GPU_PADDING_STRIP": "2"}, "DMX_GPU_PADDING_STRIP='2'"),
        ({"DMX_HOOK_SELECTION": "resid_pre@x"}, "bad layer range 'x'"),
        ({"DMX_DB_URL": "chdb://relative/dir"}, "needs an absolute path"),
        ({"DMX_DB_URL": "ftp://h"},
         "DMX_DB_URL='ftp://h' is invalid; accepted: chdb:///absolute/path, http"),
        ({"DMX_DB_URL": "http://h/bad-db"}, "bad database name 'bad-db'"),
        ({"DMX_DB_PORT": "70000"}, "DMX_DB_PORT='70000' is invalid; accepted: a TCP port"),
        ({"DMX_DB_TABLE": "drop table;"}, "DMX_DB_TABLE='drop table;'"),
        ({"DMX_MODEL_ID": "has space"}, "DMX_MODEL_ID='has space'"),
        ({"DMX_CH_COMPRESSION": "br"}, "accepted: lz4, zstd, gzip, none"),
        ({"DMX_RING_SIZE": "1"}, "unknown setting DMX_RING_SIZE; accepted: DMX_SGLANG_ENABLE"),
    ],
)
def test_invalid_values_name_variable_value_and_accepted(env: dict[str, str],
                                                         message: str) -> None:
    with pytest.raises(ConfigurationError, match=message.replace("(", r"\(")):
        Settings.from_env(env)


def test_keywords_override_variables() -> None:
    s = Settings.from_kwargs({"dmx_ring_payload_mb": 256, "dmx_gpu_padding_strip": False},
                             env={"DMX_RING_PAYLOAD_MB": "512", "DMX_MODEL_ID": "run-1"})
    assert s.ring_payload_mb == 256
    assert s.gpu_padding_strip is False
    assert s.model_id == "run-1"
    with pytest.raises(ConfigurationError, match="unknown keyword dmx_ring; accepted: "):
        Settings.from_kwargs({"dmx_ring": 1}, env={})


def test_monitoring_requested() -> None:
    assert not monitoring_requested({})
    assert not monitoring_requested({"DMX_SGLANG_ENABLE": "auto"})
    assert monitoring_requested({"DMX_HOOK_SELECTION": "resid_pre"})
    assert not monitoring_requested({"DMX_SGLANG_ENABLE": "0", "DMX_MODEL_ID": "x"})
    assert monitoring_requested({"DMX_SGLANG_ENABLE": "1"})
    with pytest.raises(ConfigurationError):
        monitoring_requested({"DMX_SGLANG_ENABLE": "sometimes"})


def test_secrets_can_be_left_out() -> None:
    s = Settings.from_env({"DMX_CH_PASSWORD": "hunter2"})
    assert s.to_env()["DMX_CH_PASSWORD"] == "hunter2"
    assert "DMX_CH_PASSWORD" not in s.to_env(include_secrets=False)
    assert "hunter2" not in repr(s)


settings_values = st.fixed_dictionaries(
    {},
    optional={
        "DMX_SGLANG_ENABLE": st.sampled_from(["auto", "0", "1"]),
        "DMX_MODEL_ID": st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True),
        "DMX_HOOK_SELECTION": st.sampled_from(["sglang-full", "resid_pre@0-3,final_ln",
                                               "hf-only", "logits,token_ids"]),
        "DMX_DB_URL": st.sampled_from(["none", "chdb:///tmp/a", "http://h:1/d"]),
        "DMX_DB_HOST": st.sampled_from(["localhost", "none"]),
        "DMX_RING_PAYLOAD_MB": st.integers(1, 10**5).map(str),
        "DMX_RING_PINNED_MB": st.integers(1, 10**5).map(str),
        "DMX_RING_TASK_ENTRIES": st.integers(1, 10**6).map(str),
        "DMX_GPU_PADDING_STRIP": st.sampled_from(["0", "1", "true", "no"]),
        "DMX_ALLOW_PREFIX_CACHE": st.sampled_from(["0", "1"]),
        "DMX_CH_COMPRESSION": st.sampled_from(["lz4", "zstd", "none"]),
        "DMX_CH_PASSWORD": st.text(max_size=8),
    },
)


@given(settings_values, st.booleans())
def test_settings_round_trip_through_env(env: dict[str, str], resolve: bool) -> None:
    s = Settings.from_env(env)
    if resolve:
        s = s.resolve(model_path="/m/model", cwd="/tmp", now=NOW, token="000000")
    assert Settings.from_env(s.to_env()) == s


def test_writers_setting_reaches_the_store_config() -> None:
    s = Settings.from_env({"DMX_CH_WRITERS": "6"}).resolve(model_path="m", now=NOW)
    assert s.store().writers == 6
    assert Settings.from_env({}).resolve(model_path="m", now=NOW).store().writers == 4
    with pytest.raises(ConfigurationError, match="DMX_CH_WRITERS"):
        Settings.from_env({"DMX_CH_WRITERS": "0"})


@pytest.mark.parametrize("name", ["DMX_CH_PARALLELISM", "DMX_CH_MAX_BATCH_ITEMS",
                                  "DMX_CH_MAX_BATCH_BYTES", "DMX_STEP_DEBUG",
                                  "DMX_DRAIN_COPY_THREADS"])
def test_variables_that_change_nothing_stored_are_ignored_with_one_line(name: str) -> None:
    assert Settings.from_env({name: "10"}) == Settings.from_env({})
    assert [v for v, _why in ignored_variables({name: "10", "DMX_DB_URL": "none"})] == [name]
    assert Settings.from_kwargs({name.lower(): 10}, env={}) == Settings.from_env({})


def test_dmi_null_mode_means_no_store_and_contradicting_it_is_refused() -> None:
    null = Settings.from_env({"DMX_NULL_MODE": "1"}).resolve(model_path="m").store()
    assert null == Settings.from_env({"DMX_DB_URL": "none"}).resolve(model_path="m").store()
    assert Settings.from_env({"DMX_NULL_MODE": "true", "DMX_DB_URL": "none"}).db_url == "none"
    assert Settings.from_env({"DMX_NULL_MODE": "0"}) == Settings.from_env({})
    assert [v for v, _why in ignored_variables({"DMX_NULL_MODE": "0"})] == ["DMX_NULL_MODE"]
    with pytest.raises(ConfigurationError, match=r"DMX_NULL_MODE=1 .*contradicts DMX_DB_URL="
                                                 r"chdb:///tmp/s"):
        Settings.from_env({"DMX_NULL_MODE": "1", "DMX_DB_URL": "chdb:///tmp/s"})
    with pytest.raises(ConfigurationError, match="DMX_NULL_MODE='maybe' is invalid; accepted"):
        Settings.from_env({"DMX_NULL_MODE": "maybe"})


def test_dmi_native_port_gets_the_http_port_hint() -> None:
    with pytest.raises(ConfigurationError) as refused:
        Settings.from_env({"DMX_DB_PORT": "9000"})
    assert str(refused.value) == (
        "DMX_DB_PORT='9000': 9000 is ClickHouse's native-protocol port, DMI's default; "
        "dmi-sglang speaks ClickHouse's HTTP protocol, by default on 8123")
    assert Settings.from_env({"DMX_DB_PORT": "8124"}).db_port == 8124


def test_other_unknown_variables_are_still_refused() -> None:
    with pytest.raises(ConfigurationError, match="unknown setting DMX_CH_PARALELISM"):
        Settings.from_env({"DMX_CH_PARALELISM": "4"})


def test_every_wire_compression_the_server_inserter_makes_is_a_setting() -> None:
    # Found in review: docs/storage.md offered gzip, which the setting refused
    for method in ("lz4", "zstd", "gzip", "none"):
        store = Settings.from_env({"DMX_DB_URL": "http://h:8123/db",
                                   "DMX_CH_COMPRESSION": method}).resolve(model_path="m").store()
        assert store.compression == method


def test_a_generated_run_id_reads_back_in_the_scheduler_for_a_long_model_dir() -> None:
    """A model directory name over 177 characters made an id of more than 200, which
    the scheduler's own parsing of the settings refused."""
    resolved = Settings().resolve(model_path="/models/" + "m" * 190,
                                  now=datetime(2026, 1, 1, tzinfo=UTC), token="abcdef")
    again = Settings.from_env(resolved.to_env())
    assert again.model_id == resolved.model_id
    assert resolved.model_id is not None
    assert resolved.model_id.endswith("-20260101T000000-abcdef")


def test_a_password_is_taken_as_given_whitespace_included() -> None:
    """"Any string": its leading and trailing spaces were stripped (authentication then
    failed with nothing pointing at why)."""
    assert Settings.from_env({"DMX_CH_PASSWORD": " s3cret "}).ch_password == " s3cret "
    assert Settings.from_kwargs({"dmx_ch_password": "s3cret\t"}, env={}).ch_password \
        == "s3cret\t"


def test_an_empty_sglang_enable_means_auto_for_parsing_as_for_monitoring() -> None:
    """The plugin read it as auto and decided to monitor; the settings then refused it."""
    env = {"DMX_SGLANG_ENABLE": "", "DMX_HOOK_SELECTION": "logits"}
    assert monitoring_requested(env)
    assert Settings.from_env(env).hook_selection == "logits"


def test_dmx_null_mode_false_keeps_the_exported_store() -> None:
    """False (store captures, the default) dropped the exported store: captures went to
    ./dmi-captures instead of the configured server."""
    env = {"DMX_DB_URL": "http://clickhouse.internal:8123/acts"}
    settings = Settings.from_kwargs({"dmx_null_mode": False}, env=env)
    assert settings.db_url == "http://clickhouse.internal:8123/acts"
    assert Settings.from_kwargs({"dmx_null_mode": True}, env=env).db_url == "none"
