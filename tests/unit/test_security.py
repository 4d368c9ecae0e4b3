"""Control ports listen on the node's address only; checkpoints never unpickle code."""

import pathlib
import socket

import pytest
import torch

from elastic.checkpoint import load_checkpoint, write_checkpoint
from elastic.checkpoint.store import serialize
from elastic.collective import RendezvousServer
from elastic.errors import CheckpointCorruptError


def _listeners(port: int) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp*) listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = pathlib.Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if int(hex_port, 16) == port and fields[3] == "0A":  # LISTEN
                found.append(address)
    return found


@pytest.mark.skipif(not pathlib.Path("/proc/net/tcp").exists(), reason="needs Linux /proc")
def test_the_rendezvous_store_listens_on_the_given_address_only():
    server = RendezvousServer(host="127.0.0.1")
    try:
        assert _listeners(server.endpoint.port) == ["0100007F"]  # 127.0.0.1, not 0.0.0.0 or ::
        with socket.create_connection(("127.0.0.1", server.endpoint.port), timeout=5):
            pass
    finally:
        server.close()
    assert _listeners(server.endpoint.port) == []


class _Exploit:
    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def test_a_checkpoint_holding_a_pickled_object_is_refused_not_run(tmp_path):
    marker = tmp_path / "pwned"
    import io

    buffer = io.BytesIO()
    torch.save({"w": _Exploit(marker)}, buffer)
    root = str(tmp_path / "ckpt")
    write_checkpoint(root, 3, {"model": buffer.getvalue()}, {"world_size": 1})
    with pytest.raises(CheckpointCorruptError):
        load_checkpoint(root, step=3)
    assert not marker.exists()
    write_checkpoint(root, 4, {"model": serialize({"w": torch.ones(2)})}, {"world_size": 1})
    assert load_checkpoint(root).step == 4
