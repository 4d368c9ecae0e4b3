"""Which Ray cluster a run starts on (`elastic.actors.client._init`), with Ray's calls faked:
never on another process's local cluster, which ends with that process."""

from __future__ import annotations

import pytest

from elastic.actors import client


@pytest.fixture
def calls(monkeypatch):
    made: list[tuple[str, object]] = []
    owner = {"pid": None}
    monkeypatch.setattr(client.ray, "init", lambda address=None, **kw: made.append(("init", address)))
    monkeypatch.setattr(client.ray, "shutdown", lambda: made.append(("shutdown", None)))
    monkeypatch.setattr(client, "throwaway_owner", lambda: owner["pid"])
    monkeypatch.setattr(client.ray._private.worker, "_global_node", None, raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return made, owner


def test_a_run_found_only_another_processs_local_cluster_starts_one_of_its_own(calls):
    made, owner = calls
    owner["pid"] = 4242
    client._init(None, start=True)
    assert made == [("init", "auto"), ("shutdown", None), ("init", "local")]


def test_a_cluster_that_outlives_its_starter_is_joined(calls):
    made, _ = calls
    client._init(None, start=True)
    assert made == [("init", "auto")]


def test_status_and_a_run_given_the_address_still_join_another_processs_cluster(calls,
                                                                               monkeypatch):
    made, owner = calls
    owner["pid"] = 4242
    client._init(None, start=False)  # `elastic status` of the run on it, from another terminal
    assert made == [("init", "auto")]
    made.clear()
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # the user's own choice
    client._init(None, start=True)
    assert made == [("init", "auto")]
