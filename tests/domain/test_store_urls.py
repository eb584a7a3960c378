"""Server store URLs as a user writes them: IPv6 hosts, TLS, ports, odd paths, and the
errors that say what is accepted without showing a password."""

from __future__ import annotations

from typing import Any

import pytest

import dmi_sglang
from dmi_sglang.domain.settings import Settings, StoreUrl, redact_url
from dmi_sglang.domain.store_config import StoreConfig
from dmi_sglang.errors import ConfigurationError

SECRET = "S3CRET-pw"


def _store(env: dict[str, str]) -> StoreConfig:
    return Settings.from_env(env).resolve(model_path="m").store()


def test_ch_secure_with_a_plain_http_url_is_refused_not_dropped() -> None:
    with pytest.raises(ConfigurationError, match="https://") as info:
        _store({"DMX_DB_URL": f"http://alice:{SECRET}@h:8123/db", "DMX_CH_SECURE": "1"})
    assert SECRET not in str(info.value)
    assert _store({"DMX_DB_URL": f"https://alice:{SECRET}@h/db",
                   "DMX_CH_SECURE": "1"}).secure


def test_db_host_with_ch_secure_defaults_to_the_https_port() -> None:
    store = _store({"DMX_DB_HOST": "ch.example", "DMX_CH_SECURE": "1"})
    assert (store.secure, store.port) == (True, 8443)
    assert _store({"DMX_DB_HOST": "ch.example"}).port == 8123
    assert _store({"DMX_DB_HOST": "ch.example", "DMX_CH_SECURE": "1",
                   "DMX_DB_PORT": "9440"}).port == 9440


@pytest.mark.parametrize(("url", "host"), [("http://[::1]:8123/db", "::1"),
                                           (f"http://alice:{SECRET}@[fd00::5]/db", "fd00::5")])
def test_an_ipv6_server_url_is_accepted(url: str, host: str) -> None:
    assert StoreUrl.parse(url).host == host
    store = _store({"DMX_DB_URL": url})
    assert store.host == host  # clickhouse-connect brackets it itself
    assert f"[{host}]" in store.url


@pytest.mark.parametrize("host", ["[::1]", "::1"])
def test_an_ipv6_db_host_is_accepted(host: str) -> None:
    assert _store({"DMX_DB_HOST": host}).url == "http://[::1]:8123/default"


def test_the_native_port_is_refused_in_a_url_as_in_db_port() -> None:
    with pytest.raises(ConfigurationError, match="8123"):
        Settings.from_env({"DMX_DB_PORT": "9000"})
    with pytest.raises(ConfigurationError, match="8123") as info:
        StoreUrl.parse(f"http://alice:{SECRET}@h:9000/db")
    assert SECRET not in str(info.value)


def test_an_unsupported_scheme_names_what_is_accepted() -> None:
    with pytest.raises(ConfigurationError) as info:
        dmi_sglang.open_store(f"clickhouse://alice:{SECRET}@h:8123/db")
    assert SECRET not in str(info.value)
    assert "http(s)://" in str(info.value)


def test_an_embedded_path_holding_an_at_sign_is_taken_whole() -> None:
    assert StoreUrl.parse("chdb:///data/run@1/store").path == "/data/run@1/store"


@pytest.mark.parametrize("url", [f"http://alice:{SECRET}/db", f"https://alice:{SECRET}"])
def test_a_password_without_its_host_is_not_shown_as_a_port(url: str) -> None:
    """``user:password`` whose ``@host`` was left out reads as a host and a port: the
    error says the port is not a number without showing it."""
    with pytest.raises(ConfigurationError, match="not a number") as info:
        StoreUrl.parse(url)
    assert SECRET not in str(info.value)
    with pytest.raises(ConfigurationError) as again:
        Settings.from_env({"DMX_DB_URL": url})
    assert SECRET not in str(again.value)


def test_an_embedded_path_is_shown_whole_whatever_it_holds() -> None:
    url = "chdb:///data/run-12:30@gpu0/store"
    assert StoreUrl.parse(url).path == "/data/run-12:30@gpu0/store"
    assert redact_url(url) == url  # a path holds no password: logs and errors name it
    assert Settings.from_env({"DMX_DB_URL": url}).to_env(include_secrets=False)[
        "DMX_DB_URL"] == url


def test_a_store_keyword_replaces_where_but_never_drops_tls() -> None:
    """Found in review: a URL keyword dropped an exported DMX_CH_SECURE=1, so an http://
    URL went unencrypted without a word; a port keyword alone dropped the exported host,
    so captures went to ./dmi-captures."""
    secure = {"DMX_CH_SECURE": "1"}
    with pytest.raises(ConfigurationError, match="DMX_CH_SECURE=1 contradicts"):
        Settings.from_kwargs({"dmx_db_url": "http://h:8123/db"}, env=secure).resolve(
            model_path="m").store()
    host = {"DMX_DB_HOST": "ch.example", "DMX_DB_PORT": "8124"}
    store = Settings.from_kwargs({"dmx_db_port": 8125}, env=host).resolve(
        model_path="m").store()
    assert (store.host, store.port) == ("ch.example", 8125)
    store = Settings.from_kwargs({"dmx_db_url": "http://other/db"}, env=host).resolve(
        model_path="m").store()
    assert (store.host, store.port) == ("other", 8123)  # the exported port went with it


def test_a_reading_commands_url_replaces_where_the_environment_says(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from dmi_sglang.app.reading import store_config

    monkeypatch.setenv("DMX_NULL_MODE", "1")  # exported for an earlier capture
    monkeypatch.setenv("DMX_DB_PORT", "9000")
    assert store_config(f"chdb://{tmp_path}/s").path == f"{tmp_path}/s"
    monkeypatch.delenv("DMX_NULL_MODE")
    monkeypatch.delenv("DMX_DB_PORT")
    monkeypatch.setenv("DMX_CH_SECURE", "1")
    with pytest.raises(ConfigurationError, match="contradicts"):
        store_config("http://h:8123/db")
