"""``sentinel://`` URLs (Celery's form) as the settings, the Celery app and the client builders read them: no
processes (tests/test_sentinel.py runs a real primary, replica and sentinels)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from embedq import sentinel
from embedq.broker import celery_config, make_app, safe_url, sentinel_kwargs
from embedq.producers.direct import direct_route
from embedq.settings import Settings

URL = "sentinel://:s3cret@10.0.0.1:26379;sentinel://:s3cret@10.0.0.2;sentinel://10.0.0.3:26380/2"


def test_a_sentinel_url_names_every_sentinel_the_database_and_the_servers_credentials():
    spec = sentinel.parse(URL)
    assert spec.hosts == (("10.0.0.1", 26379), ("10.0.0.2", 26379), ("10.0.0.3", 26380))
    assert spec.db == 2 and spec.password == "s3cret" and spec.username is None
    assert spec.connection_kwargs() == {"db": 2, "password": "s3cret"}
    user = sentinel.parse("sentinel://worker:p%40ss@h:1/0")
    assert (user.username, user.password, user.db) == ("worker", "p@ss", 0)
    assert sentinel.parse("sentinel://h").hosts == (("h", 26379),)


@pytest.mark.parametrize("url, says", [
    ("sentinel://h:1;redis://h:2", "must start with sentinel://"),
    ("sentinel://h:1/0;sentinel://h:2/1", "different databases"),
    ("sentinel://h:1/zero", "must be a number"),
    ("sentinel://:26379", "no host"),
    ("sentinel://h:port", "not a number"),
])
def test_a_malformed_sentinel_url_is_refused_naming_what_is_wrong(url, says):
    with pytest.raises(ValueError, match=says):
        sentinel.parse(url)
    with pytest.raises(ValidationError, match=says):
        Settings(broker_url=url, sentinel_master="m")


def test_the_settings_take_a_sentinel_url_only_with_the_primarys_name():
    with pytest.raises(ValidationError, match="EMBEDQ_SENTINEL_MASTER"):
        Settings(broker_url=URL)
    with pytest.raises(ValidationError, match="EMBEDQ_SENTINEL_MASTER"):
        Settings(broker_url="redis://h:6379/0", result_backend=URL)
    settings = Settings(broker_url=URL, sentinel_master="mymaster")
    assert settings.result_url == URL
    with pytest.raises(ValidationError, match="must be a Redis URL"):
        Settings(broker_url="amqp://h//")


def test_messages_never_show_a_password_of_any_sentinel_address():
    shown = safe_url(URL)
    assert "s3cret" not in shown and shown.count("sentinel://") == 3
    assert safe_url("redis://:pw@h:6379/0") == "redis://:**@h:6379/0"


def test_the_celery_app_reaches_broker_and_results_through_the_sentinels():
    settings = Settings(broker_url=URL, sentinel_master="mymaster", sentinel_password="sentinel-pw",
                        sentinel_username="watcher")
    config = celery_config(settings)
    for options in (config["broker_transport_options"], config["result_backend_transport_options"]):
        assert options["master_name"] == "mymaster"
        assert options["sentinel_kwargs"]["password"] == "sentinel-pw"
        assert options["sentinel_kwargs"]["username"] == "watcher"
    assert "broker_use_ssl" not in config and "redis_backend_use_ssl" not in config
    app = make_app(settings)
    assert type(app.backend).__name__ == "SentinelBackend"
    # the client writes messages straight into the queue's list through its Sentinel-resolved connection too
    assert direct_route(app, "embedq.embed", settings.queue_name, settings.broker_url) is not None


def test_sentinel_tls_applies_to_the_sentinels_and_the_servers():
    settings = Settings(broker_url=URL, sentinel_master="m", sentinel_tls=True, tls_ca_file="/etc/ca.pem")
    assert sentinel_kwargs(settings)["ssl"] is True and sentinel_kwargs(settings)["ssl_ca_certs"] == "/etc/ca.pem"
    config = celery_config(settings)
    assert config["broker_use_ssl"]["ssl_ca_certs"] == "/etc/ca.pem"
    assert config["redis_backend_use_ssl"]["ssl_ca_certs"] == "/etc/ca.pem"
    assert "ssl" not in sentinel_kwargs(Settings(broker_url=URL, sentinel_master="m"))
