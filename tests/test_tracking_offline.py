"""Tracking can never fail or hang a stage (issue 19, item 2): the documented W&B mode precedence
(disabled wins, then WANDB_MODE, then tracking.wandb_mode; WANDB_API_KEY never selects a mode), and an
online run without network or with a rejected key degrades to offline with one warning."""

import http.server
import logging
import socket
import threading
import time

import pytest

from conftest import mini_params


def params_with(wandb_mode="offline", report_to=("tensorboard", "dvclive", "wandb")):
    from agentrl.config import validate_params

    p = mini_params()
    p["tracking"].update(wandb_mode=wandb_mode, report_to=list(report_to))
    return validate_params(p)


@pytest.fixture
def tracking(monkeypatch, tmp_path):
    """agentrl.tracking with a dummy W&B key, no reachable W&B server and warnings recorded."""
    from agentrl import tracking

    with socket.socket() as s:  # a port nobody listens on: "no network"
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv("WANDB_API_KEY", "dummy-key-0123456789abcdef0123456789abcdef01234567")
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{closed}")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setattr(tracking, "_degraded", None, raising=False)
    monkeypatch.chdir(tmp_path)
    warnings: list[str] = []

    class Record(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    handler = Record()
    logger = logging.getLogger("agentrl.tracking")
    logger.addHandler(handler)
    tracking.warnings = warnings
    yield tracking
    logger.removeHandler(handler)
    import wandb

    if wandb.run is not None:
        wandb.finish()


@pytest.mark.parametrize(
    "env_mode, params_mode, report_to, expected",
    [
        ("offline", "offline", None, "offline"),  # the case: the key must not switch to online
        (None, "offline", None, "offline"),  # a key alone never selects online
        ("offline", "online", None, "offline"),  # WANDB_MODE beats params.yaml
        ("dryrun", "online", None, "offline"),
        ("online", "offline", None, "online"),
        ("disabled", "online", None, "disabled"),  # disabled anywhere wins
        ("online", "disabled", None, "disabled"),
        (None, "online", None, "online"),
        ("online", "online", ("tensorboard",), "disabled"),  # wandb not reported to
    ],
)
def test_wandb_mode_precedence_with_a_key_set(tracking, monkeypatch, env_mode, params_mode, report_to, expected):
    if env_mode:
        monkeypatch.setenv("WANDB_MODE", env_mode)
    p = params_with(params_mode, report_to or ("tensorboard", "dvclive", "wandb"))
    assert tracking.wandb_mode(p) == expected


def test_unknown_wandb_mode_env_is_an_error_naming_it(tracking, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offlien")
    with pytest.raises(ValueError, match="WANDB_MODE='offlien'"):
        tracking.wandb_mode(params_with())


@pytest.mark.timeout(120)
def test_online_without_network_degrades_to_offline_with_one_warning(tracking, tmp_path):
    """A dummy key and no reachable server: the training set-up and an eval's W&B logging both finish
    quickly, log offline, and warn once for the process."""
    p = params_with("online")
    t0 = time.time()
    track = tracking.setup(p, "sft")
    assert time.time() - t0 < 15, "tracking set-up waited on the network"
    assert track["report_to"] == ["tensorboard", "wandb"]
    import os

    assert os.environ["WANDB_MODE"] == "offline"
    t0 = time.time()
    tracking.log_eval_to_wandb(p, "sft", {"accuracy": 0.5}, [{"id": "a", "question": "q", "correct": True}])
    assert time.time() - t0 < 60, "eval logging waited on the network"
    assert len(tracking.warnings) == 1, tracking.warnings
    assert "offline" in tracking.warnings[0] and "cannot reach" in tracking.warnings[0]
    assert list((tmp_path / "wandb").glob("offline-run-*")), "no offline run was written"


def test_rejected_key_degrades_to_offline(tracking, monkeypatch):
    """A server that answers 401 (bad key): offline with one warning saying the key was rejected."""

    class Reject(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.send_response(401)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Reject)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{srv.server_address[1]}")
        assert tracking.effective_wandb_mode(params_with("online")) == "offline"
        assert tracking.effective_wandb_mode(params_with("online")) == "offline"
    finally:
        srv.shutdown()
    assert len(tracking.warnings) == 1 and "rejected the API key" in tracking.warnings[0], tracking.warnings
