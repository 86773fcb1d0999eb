"""Errors of a broken collective become messages that name the cause and a fix the user can reach."""

from __future__ import annotations

import pytest

from multigpu.errors import CollectiveTimeoutError, PeerExitedError
from multigpu.runtime.collective_failures import explain_collective_failures


def test_a_timeout_names_the_settings_that_raise_it() -> None:
    with pytest.raises(CollectiveTimeoutError) as caught:
        with explain_collective_failures("the loss all_reduce"):
            raise RuntimeError("[gloo] Timed out waiting 3000ms for recv operation to complete")
    message = str(caught.value)
    assert message.startswith("the loss all_reduce on this process timed out after 3 s")
    # Session users never call init_process_group: the fix must be a setting they have.
    assert "multigpu launch --collective-timeout SECONDS" in message
    assert "Session(timeout_s=...) / SessionConfig(timeout_s=...)" in message
    assert "if you create the process group yourself: init_process_group(timeout=...)" in message
    assert message.endswith("Backend said: [gloo] Timed out waiting 3000ms for recv operation to complete")


def test_a_vanished_peer_is_named_as_the_cause() -> None:
    with pytest.raises(PeerExitedError, match="failed because another rank exited"):
        with explain_collective_failures("checkpoint save"):
            raise RuntimeError("Connection reset by peer")


def test_other_errors_pass_through_unchanged() -> None:
    with pytest.raises(RuntimeError, match=r"^shape mismatch$"):
        with explain_collective_failures("the loss all_reduce"):
            raise RuntimeError("shape mismatch")


def test_a_vanished_peer_s_address_is_named() -> None:
    with pytest.raises(PeerExitedError, match=r"another rank \(the peer at \[10\.213\.7\.2\]:14561\) exited"):
        with explain_collective_failures("backward"):
            raise RuntimeError(
                "[../gloo/transport/tcp/pair.cc:537] Read error [10.213.7.2]:14561: Connection reset by peer."
            )
