"""API keys for both transports (``[server] api_keys`` / ``api_key_file``, ``--api-key``).

With keys configured, every HTTP endpoint but ``/healthz`` (and those listed in ``[server]
open_endpoints``: ``/readyz``, ``/metrics``) needs ``Authorization: Bearer KEY``, and every gRPC
call ``authorization: Bearer KEY`` metadata; anything else is ``401`` / ``UNAUTHENTICATED``.

- A presented token is compared with every configured key in constant time (SHA-256 digests,
  ``hmac.compare_digest``, no early exit), so response timing tells nothing about a key.
- Keys are never logged, echoed in an error or shown by ``repr`` (``ServerConfig`` hides them).
- The admin API (``/v1/admin``) has keys of its own (``[server] admin_api_keys``,
  :meth:`ApiKeys.check_admin`): with any key configured, only an admin key opens it; an
  inference key there is ``403``, as is every key when no admin key is configured.  With no
  key at all, the admin API is as open as the rest (the server says so at start when it is
  bound beyond loopback).
- Each key gets a random *scope*, made when the server starts and unrelated to the key.  The
  transports prefix ``lumen.sequence.id`` with it before the runtime sees the request
  (:meth:`ApiKeys.scoped_meta`), so a sequence belongs to the key that started it: another
  client cannot continue or end it, even knowing its id.  The client keeps seeing its own id
  (:func:`unscope_error` takes the prefix out of error messages).  The scope is also the
  call's tenant for the response cache (``cache.TENANT``): a key never gets, or learns of,
  another key's cached answers.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Any, Iterable, Optional

from ..cache import TENANT
from ..contract import KEY_SEQUENCE_ID, MAX_SEQUENCE_ID_CHARS
from ..errors import InvalidArgument, LumenError, PermissionDenied, Unauthenticated

BEARER = "bearer"
#: ``scope`` + this + the client's sequence id is what the runtime sees
SCOPE_SEPARATOR = ":"
SCOPE_BYTES = 6


def read_key_file(path: str) -> list:
    """Keys of ``api_key_file``: one a line; blank lines and ``#`` comments are skipped."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError as exc:
        raise OSError(f"server.api_key_file {path!r}: {exc.strerror or exc}") from None
    keys = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    if not keys:
        raise ValueError(f"server.api_key_file {path!r} holds no keys")
    return keys


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


class ApiKeys:
    """The configured keys (possibly none: then every call is let in, unscoped)."""

    def __init__(self, keys: Iterable[str] = (), open_endpoints: Iterable[str] = (),
                 admin_keys: Iterable[str] = ()):
        unique = list(dict.fromkeys(keys))
        self._digests = [_digest(k.encode("utf-8")) for k in unique]
        self._scopes = [secrets.token_hex(SCOPE_BYTES) for _ in unique]
        self._admin = [_digest(k.encode("utf-8")) for k in dict.fromkeys(admin_keys)]
        self.open_endpoints = frozenset(open_endpoints)

    @classmethod
    def from_config(cls, server_cfg: Any, extra_keys: Iterable[str] = ()) -> "ApiKeys":
        keys = list(server_cfg.api_keys) + list(extra_keys)
        if server_cfg.api_key_file:
            keys += read_key_file(server_cfg.api_key_file)
        return cls(keys, server_cfg.open_endpoints, getattr(server_cfg, "admin_api_keys", ()))

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    @property
    def admin_enabled(self) -> bool:
        """Whether the admin API needs a key (some key, admin or inference, is configured)."""
        return bool(self._digests or self._admin)

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"ApiKeys(<{len(self)} keys>)"

    def check(self, authorization: Optional[str]) -> Optional[str]:
        """The scope of the key in an ``Authorization`` value (``None`` when keys are off);
        Unauthenticated when it carries none of the keys.  The scope is also made the tenant
        of the call being served (``cache.TENANT``, in this context only), so the response
        cache keeps each key's answers to that key."""
        if not self._digests:
            return None
        found = _find(self._digests, _token(authorization))
        if found < 0:
            raise Unauthenticated("the API key is not valid", "authorization")
        TENANT.set(self._scopes[found])
        return self._scopes[found]

    def check_admin(self, authorization: Optional[str]) -> None:
        """Let an admin-API call through: always when no key is configured, else only with an
        admin key (an inference key is PermissionDenied, anything else Unauthenticated)."""
        if not self.admin_enabled:
            return
        given = _token(authorization)
        if _find(self._admin, given) >= 0:
            return
        if _find(self._digests, given) >= 0:
            raise PermissionDenied("this is an inference key; the admin API takes only its own "
                                   "keys ([server] admin_api_keys" +
                                   (")" if self._admin else ", none configured)"),
                                   "authorization")
        raise Unauthenticated("the API key is not valid", "authorization")

    @staticmethod
    def scoped_meta(meta: dict, scope: Optional[str]) -> dict:
        """``meta`` with its sequence id (if any) moved into ``scope`` (in place)."""
        if scope is None:
            return meta
        sid = meta.get(KEY_SEQUENCE_ID)
        if sid:
            if len(sid) > MAX_SEQUENCE_ID_CHARS - len(scope) - len(SCOPE_SEPARATOR):
                raise InvalidArgument(f"{KEY_SEQUENCE_ID} must be a non-empty string of at most "
                                      f"{MAX_SEQUENCE_ID_CHARS - len(scope) - 1} characters on a "
                                      f"server with API keys", KEY_SEQUENCE_ID)
            meta[KEY_SEQUENCE_ID] = f"{scope}{SCOPE_SEPARATOR}{sid}"
        return meta


def _token(authorization: Optional[str]) -> bytes:
    """The digest of the Bearer token in an ``Authorization`` value; Unauthenticated when
    there is none."""
    if not authorization:
        raise Unauthenticated("this server needs an API key: send 'Authorization: Bearer "
                              "<key>'", "authorization")
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != BEARER or not token.strip():
        raise Unauthenticated("the Authorization header must be 'Bearer <key>'",
                              "authorization")
    return _digest(token.strip().encode("utf-8", "surrogateescape"))


def _find(digests: list, given: bytes) -> int:
    """Index of ``given`` in ``digests`` (-1: none), every one compared: no early exit."""
    found = -1
    for i, d in enumerate(digests):
        if hmac.compare_digest(given, d):
            found = i
    return found


def unscope_error(exc: LumenError, scope: Optional[str]) -> LumenError:
    """``exc`` with the key scope taken out of its message (the client never sees it)."""
    if scope is not None:
        prefix = scope + SCOPE_SEPARATOR
        if prefix in exc.message:
            exc.message = exc.message.replace(prefix, "")
            exc.args = (exc.message,)
    return exc
