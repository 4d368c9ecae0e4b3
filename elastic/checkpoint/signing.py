"""Signed checkpoint manifests: write access to the checkpoint folder alone cannot plant a state.

The manifest carries the sha256 of every file, so signing the manifest (HMAC-SHA256 over its
canonical JSON) signs the checkpoint. The key lives outside the checkpoint folder: in a file of
the user's (`CheckpointConfig.key_file`, default `$ELASTIC_HOME/keys/checkpoint.key`, created
0600 in a 0700 folder on the machine that starts the run) and reaches the workers only through
Ray's authenticated calls. A checkpoint that is unsigned, signed with another key, or whose
signature does not match is not loaded (the loader skips it with an event, as a corrupt one).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import stat
from typing import Any

from elastic.config import storage_root
from elastic.errors import ConfigError
from elastic.private import ensure_private_dir

KEY_BYTES = 32
SIGNATURE = "signature"
_ALGORITHM = "hmac-sha256"


def default_key_file() -> str:
    """`$ELASTIC_HOME/keys/checkpoint.key` (default `~/.elastic/keys/checkpoint.key`)."""
    return os.path.join(storage_root(), "keys", "checkpoint.key")


def key_id(key: bytes) -> str:
    """A short public name of a key (never the key): tells which key signed a checkpoint."""
    return hashlib.sha256(b"elastic checkpoint key id\0" + key).hexdigest()[:16]


def read_key(path: str) -> bytes:
    """Reads a key file: this user's, readable by no one else, 64 hex digits.

    Raises:
        ConfigError: missing, a link, another user's, readable by others, or malformed.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise ConfigError(f"no checkpoint signing key at {path}: point checkpoint.key_file at the "
                          "key of the run that wrote the checkpoints") from e
    except OSError as e:
        raise ConfigError(f"checkpoint signing key {path} cannot be opened: {e}") from e
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise ConfigError(
                f"refusing checkpoint signing key {path}: it must be a regular file of this "
                f"user readable by no one else (mode {stat.S_IMODE(st.st_mode):o}, uid "
                f"{st.st_uid}); run `chmod 600 {path}`"
            )
        text = f.read(4 * KEY_BYTES).decode(errors="replace").strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) < KEY_BYTES:
        raise ConfigError(f"checkpoint signing key {path} is not {2 * KEY_BYTES} hex digits")
    return key


def load_or_create_key(path: str | None = None) -> bytes:
    """The key in `path` (default `default_key_file()`), created if the file does not exist.

    Raises:
        ConfigError: see `read_key`; or its folder is not private to this user.
    """
    path = os.path.abspath(path or default_key_file())
    directory = os.path.dirname(path)
    ensure_private_dir(directory, "checkpoint.key_file's folder")
    if os.path.lexists(path):
        return read_key(path)
    # Written in full under a fresh name, then linked into place: a run starting at the same
    # moment either finds no key yet or a whole one (link fails if the name exists).
    tmp = os.path.join(directory, f".checkpoint-key.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(KEY_BYTES) + "\n")
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        os.unlink(tmp)
    return read_key(path)


def _mac(manifest: dict[str, Any], key: bytes) -> str:
    body = {k: v for k, v in manifest.items() if k != SIGNATURE}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, canonical, hashlib.sha256).hexdigest()


def sign(manifest: dict[str, Any], key: bytes) -> dict[str, Any]:
    """`manifest` with its signature, computed over the manifest as it will read back from
    JSON (integer keys become strings and may sort differently)."""
    stored = json.loads(json.dumps(manifest))
    return {**stored, SIGNATURE: {"algorithm": _ALGORITHM, "key_id": key_id(key),
                                  "mac": _mac(stored, key)}}


def signature_problem(manifest: Any, key: bytes) -> str | None:
    """Why `manifest` is not validly signed with `key`, or None if it is."""
    if not isinstance(manifest, dict):
        return "the manifest is not a JSON object"
    signature = manifest.get(SIGNATURE)
    if not isinstance(signature, dict):
        return "not signed (written without a key, or planted)"
    if signature.get("algorithm") != _ALGORITHM:
        return f"signed with an unknown algorithm {signature.get('algorithm')!r:.40}"
    if signature.get("key_id") != key_id(key):
        return (f"signed with another key (id {signature.get('key_id')!s:.32}, this run's is "
                f"{key_id(key)}): point checkpoint.key_file at the key that wrote it")
    mac = signature.get("mac")
    if not isinstance(mac, str) or not hmac.compare_digest(mac.encode(), _mac(manifest, key).encode()):
        return "its signature does not match its contents (altered or planted)"
    return None
