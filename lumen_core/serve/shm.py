"""Triton's system shared-memory extension: regions a local client registers and names instead
of sending tensor bytes (``/v2/systemsharedmemory/...`` and the gRPC ``SystemSharedMemory*``
calls of :mod:`.oip_grpc`).

Only when ``[server] system_shared_memory = true`` (off by default: a region is read straight
from another process's memory, which only makes sense for clients on the same machine).

A registered region is one POSIX shared-memory object (``/dev/shm/<key>``), mapped read-only
once at registration (read-write when the server may write it, so a requested output can be
written into it too); an input that names it becomes a memoryview of the mapping, handed to
the runtime as the request's payload, so the batch is assembled straight from the client's
memory (no copy into a request buffer).  What a hostile or careless client can do, and what
answers it:

- a key with a path in it (``../``), a symlink, a non-regular file: refused at registration
  (the key is one name, opened with ``O_NOFOLLOW``; only regular files are mapped);
- offset / byte size outside the object, or a negative or non-integer one: refused at
  registration; an input's offset and size are checked against its region the same way
  (Python integers: no overflow);
- an unregistered (or never registered) name: ``invalid_argument`` naming it;
- a region unlinked meanwhile: the mapping stays valid (unlink only removes the name), so a
  request in flight reads the bytes it was sent with;
- a region truncated meanwhile (``ftruncate``; touching pages past the end would be SIGBUS):
  every use re-checks the object's size with ``fstat`` first and refuses a region that no
  longer covers what was registered.  (A truncation racing that check is the client attacking
  its own server process on its own machine; such clients must not be trusted with this
  extension.)
- unregistering while requests still read the region: the entry goes at once; the mapping is
  closed when the last view of it is released;
- another API key: regions belong to the key that registered them (its scope, :mod:`.auth`).
  Each key has its own namespace of region names: another key's regions are not listed, read,
  written or unregistered, and the same name may be registered by both;
- a peer that is not on this machine: every call of the extension (register, status,
  unregister, and an input or output naming a region) needs a loopback peer (or a Unix
  socket), and a request that carries a forwarding header (``X-Forwarded-For``,
  ``Forwarded``, ...) is never local, whatever address it names (uvicorn takes the peer from
  ``X-Forwarded-For`` of a loopback proxy): 403 / PERMISSION_DENIED;
- many registrations: a region holds one file descriptor (the mapping's own; the one it was
  opened with is closed at once), and at most :func:`region_budget` regions are registered at a
  time: ``[server] shm_max_regions``, never more than a :data:`FD_SHARE_DIVISOR`-th of the
  process's descriptor limit, so connections and model files keep the rest.
"""
from __future__ import annotations

import functools
import ipaddress
import logging
import mmap
import os
import re
import resource
import stat
import threading
import weakref
from typing import TYPE_CHECKING, Any, Iterable, NamedTuple, Optional

from ..config import DEFAULT_SHM_MAX_REGIONS
from ..errors import InvalidArgument, PermissionDenied

if TYPE_CHECKING:  # typing only: the runtime as the doors use it
    from .runtime_api import RuntimeQueries

log = logging.getLogger("lumen.shm")

SHM_DIR = "/dev/shm"
#: a key is one name in SHM_DIR (an optional leading '/', as shm_open takes it)
KEY_RE = re.compile(r"/?[A-Za-z0-9._-]{1,240}")
#: region names are the client's labels: printable, bounded
MAX_NAME_CHARS = 256
#: registered regions may hold at most this fraction (1/N) of the process's descriptor limit
FD_SHARE_DIVISOR = 4
#: headers a proxy adds: a request carrying one did not come from a local client
FORWARDING_HEADERS = ("x-forwarded-for", "forwarded", "x-real-ip", "x-forwarded-host",
                      "x-forwarded-proto")
#: uint64, the protocol's type for offsets and sizes
UINT64_MAX = (1 << 64) - 1

_REGISTRIES: "weakref.WeakKeyDictionary[Any, ShmRegistry]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _uint(value: Any, what: str, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= UINT64_MAX:
        raise InvalidArgument(f"{what} must be an integer in 0..2^64-1, got {str(value)[:40]}",
                              field)
    return value


class Region:
    __slots__ = ("name", "key", "offset", "byte_size", "mm", "base", "end", "writable")

    def __init__(self, name: str, key: str, offset: int, byte_size: int):
        path = os.path.join(SHM_DIR, key.lstrip("/"))
        flags = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        self.writable = True  # outputs may be written into a region the server can write
        try:
            try:
                fd = os.open(path, os.O_RDWR | flags)
            except PermissionError:
                fd = os.open(path, os.O_RDONLY | flags)
                self.writable = False
        except OSError as exc:
            raise InvalidArgument(f"unable to open shared memory key {key!r}: "
                                  f"{exc.strerror}", "key") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidArgument(f"shared memory key {key!r} is not a shared memory "
                                      f"object", "key")
            if byte_size == 0 or offset + byte_size > st.st_size:
                raise InvalidArgument(f"region {name!r}: offset {offset} + byte_size "
                                      f"{byte_size} must lie within the object's {st.st_size} "
                                      f"bytes (and byte_size be > 0)", "byte_size")
            start = offset - offset % mmap.ALLOCATIONGRANULARITY
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if self.writable else 0)
            mm = mmap.mmap(fd, offset + byte_size - start, mmap.MAP_SHARED, prot,
                           offset=start)
        finally:
            os.close(fd)  # the mapping holds its own descriptor (mm.size() reads it)
        self.name, self.key, self.offset, self.byte_size = name, key, offset, byte_size
        self.mm = mm
        self.base = offset - start  # where the region starts in the mapping
        self.end = offset + byte_size  # the object size the region needs

    def status(self) -> dict:
        return {"name": self.name, "key": self.key, "offset": self.offset,
                "byte_size": self.byte_size}

    def view(self, offset: int, byte_size: int) -> memoryview:
        if offset + byte_size > self.byte_size:
            raise InvalidArgument(f"shared memory region {self.name!r}: offset {offset} + "
                                  f"byte size {byte_size} exceeds its {self.byte_size} bytes",
                                  "shared_memory_byte_size")
        try:
            size = self.mm.size()  # fstat of the object under the mapping
        except (OSError, ValueError):
            size = -1
        if size < self.end:
            raise InvalidArgument(f"shared memory region {self.name!r} was truncated to "
                                  f"{size} bytes under the server (it needs {self.end}); "
                                  f"register it again", "shared_memory_region")
        start = self.base + offset
        return memoryview(self.mm)[start:start + byte_size]

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            pass  # a request still reads it: the mapping goes with its last view


class Caller(NamedTuple):
    """Who calls the extension: ``owner`` is the API key's scope (None when keys are off: one
    namespace), ``local`` whether the peer is on this machine and came through no proxy."""

    owner: Optional[str]
    local: bool


@functools.lru_cache(maxsize=1024)
def is_loopback(host: Optional[str]) -> bool:
    """Whether ``host`` (an IP address or the name ``localhost``) is this machine only:
    ``127.0.0.0/8``, ``::1`` (IPv4-mapped IPv6 included).  ``0.0.0.0`` / ``::`` (every
    interface) and other names are not.  Remembered per host (every OIP request asks; parsing
    the address cost more than the rest of its shared-memory bookkeeping)."""
    if not host:
        return False
    if host.lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def forwarded(names: Iterable[str]) -> bool:
    """Whether any of the header (metadata) names is a proxy's forwarding header."""
    return any(n.lower() in FORWARDING_HEADERS for n in names)


def http_caller(owner: Optional[str], client_host: Optional[str], headers: Iterable[str]) -> Caller:
    """The caller of an HTTP request: its key scope, its peer address (ASGI ``client``) and
    its header names."""
    return Caller(owner, is_loopback(client_host) and not forwarded(headers))


def grpc_peer_is_local(peer: str) -> bool:
    """Whether a gRPC peer string (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``,
    ``unix:/path``) is on this machine."""
    kind, _, rest = (peer or "").partition(":")
    if kind == "unix":
        return True
    if kind == "ipv4":
        return is_loopback(rest.rpartition(":")[0])
    if kind == "ipv6":
        return is_loopback(rest.rpartition("]")[0].lstrip("["))
    return False


def grpc_caller(owner: Optional[str], peer: str, metadata: Iterable[tuple]) -> Caller:
    """The caller of a gRPC call: its key scope, ``context.peer()`` and its metadata."""
    return Caller(owner, grpc_peer_is_local(peer) and not forwarded(k for k, _ in metadata))


def region_budget(configured: int = DEFAULT_SHM_MAX_REGIONS) -> int:
    """Regions that may be registered at once: ``configured`` (``[server] shm_max_regions``),
    but never more than a :data:`FD_SHARE_DIVISOR`-th of the descriptor limit (one each)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return configured
    return max(1, min(configured, soft // FD_SHARE_DIVISOR))


class ShmRegistry:
    """The registered regions of one server (shared by its HTTP and gRPC front doors), each
    under the :class:`Caller` owner that registered it."""

    def __init__(self, enabled: bool, max_regions: int = DEFAULT_SHM_MAX_REGIONS):
        self.enabled = enabled
        self.max_regions = region_budget(max_regions)
        if enabled and self.max_regions < max_regions:
            log.warning("shm_max_regions = %d is more than a 1/%d share of the descriptor "
                        "limit (ulimit -n); at most %d regions may be registered", max_regions,
                        FD_SHARE_DIVISOR, self.max_regions)
        self._regions: dict = {}  # (owner, name) -> Region
        self._lock = threading.Lock()

    def _check(self, caller: Caller) -> None:
        if not self.enabled:
            raise InvalidArgument("system shared memory is off on this server; enable it with "
                                  "[server] system_shared_memory = true (local clients only)",
                                  "shared_memory_region")
        if not caller.local:
            raise PermissionDenied("system shared memory is for clients on this machine: the "
                                   "peer must be a loopback address, not forwarded by a proxy",
                                   "shared_memory_region")

    def register(self, caller: Caller, name: Any, key: Any, offset: Any, byte_size: Any) -> None:
        self._check(caller)
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS \
                or not name.isprintable():
            raise InvalidArgument(f"a region name is 1..{MAX_NAME_CHARS} printable characters",
                                  "name")
        if not isinstance(key, str) or not KEY_RE.fullmatch(key) or key.strip("/.") == "":
            raise InvalidArgument(f"shared memory key {str(key)[:60]!r} must be one name such "
                                  f"as '/my_region' (letters, digits, . _ -)", "key")
        offset = _uint(offset, "offset", "offset")
        byte_size = _uint(byte_size, "byte_size", "byte_size")
        with self._lock:
            if (caller.owner, name) in self._regions:
                raise InvalidArgument(f"shared memory region {name!r} is already registered; "
                                      f"unregister it first", "name")
            if len(self._regions) >= self.max_regions:
                raise InvalidArgument(f"at most {self.max_regions} shared memory regions may be "
                                      f"registered at once ([server] shm_max_regions, within "
                                      f"the descriptor limit); unregister some first", "name")
            self._regions[(caller.owner, name)] = Region(name, key, offset, byte_size)

    def unregister(self, caller: Caller, name: str = "") -> None:
        """One region of the caller's, or all of them when ``name`` is empty (unknown names
        are no error, as in Triton)."""
        self._check(caller)
        owner = caller.owner
        with self._lock:
            if name:
                r = self._regions.pop((owner, name), None)
                gone = [r] if r is not None else []
            else:
                mine = [k for k in self._regions if k[0] == owner]
                gone = [self._regions.pop(k) for k in mine]
        for r in gone:
            r.close()

    def status(self, caller: Caller, name: str = "") -> list:
        self._check(caller)
        with self._lock:
            if name:
                r = self._regions.get((caller.owner, name))
                if r is None:
                    raise InvalidArgument(f"no shared memory region {name[:MAX_NAME_CHARS]!r} "
                                          f"is registered", "name")
                return [r.status()]
            return [r.status() for (owner, _n), r in self._regions.items()
                    if owner == caller.owner]

    def _region(self, caller: Caller, name: Any, offset: Any, byte_size: Any) -> tuple:
        self._check(caller)
        if not isinstance(name, str):
            raise InvalidArgument("shared_memory_region must be a string", "shared_memory_region")
        offset = _uint(0 if offset is None else offset, "shared_memory_offset",
                       "shared_memory_offset")
        byte_size = _uint(byte_size, "shared_memory_byte_size", "shared_memory_byte_size")
        with self._lock:
            r = self._regions.get((caller.owner, name))
        if r is None:
            raise InvalidArgument(f"no shared memory region {name[:MAX_NAME_CHARS]!r} is "
                                  f"registered (register it first)", "shared_memory_region")
        return r, offset, byte_size

    def view(self, caller: Caller, name: Any, offset: Any, byte_size: Any) -> memoryview:
        """The bytes an input names: ``byte_size`` bytes at ``offset`` within the caller's
        region ``name``."""
        r, offset, byte_size = self._region(caller, name, offset, byte_size)
        return r.view(offset, byte_size)

    def write(self, caller: Caller, name: Any, offset: Any, byte_size: Any, data: Any) -> int:
        """Write an output's bytes into ``byte_size`` bytes at ``offset`` of the caller's region
        ``name`` (refused when they do not fit or the server may not write the region)."""
        r, offset, byte_size = self._region(caller, name, offset, byte_size)
        n = memoryview(data).nbytes
        if n > byte_size:
            raise InvalidArgument(f"the output is {n} bytes; shared memory region {name!r} was "
                                  f"given {byte_size} for it", "shared_memory_byte_size")
        if not r.writable:
            raise InvalidArgument(f"shared memory region {name!r} is read-only to the server",
                                  "shared_memory_region")
        r.view(offset, n)[:] = memoryview(data).cast("B")
        return n


def registry_for(runtime: RuntimeQueries) -> ShmRegistry:
    """The registry of the server running ``runtime`` (one per runtime, so the HTTP and gRPC
    front doors see the same regions); enabled by ``[server] system_shared_memory``."""
    with _LOCK:
        reg = _REGISTRIES.get(runtime)
        if reg is None:
            server = getattr(getattr(runtime, "config", None), "server", None)
            reg = _REGISTRIES[runtime] = ShmRegistry(
                bool(getattr(server, "system_shared_memory", False)),
                getattr(server, "shm_max_regions", DEFAULT_SHM_MAX_REGIONS))
        return reg


def _region_of(registry: Optional[ShmRegistry], params: dict,
               what: str) -> Optional[tuple[Any, Any, Any]]:
    """(region name, offset, byte size) that a tensor's parameters name, or None when they
    name no region; ``what`` ("an input", "an output") words the errors."""
    name = params.get("shared_memory_region")
    if name is None:
        return None
    if registry is None:
        raise InvalidArgument("system shared memory is not available here",
                              "shared_memory_region")
    size = params.get("shared_memory_byte_size")
    if size is None:
        raise InvalidArgument(f"{what} in shared memory needs shared_memory_byte_size",
                              "shared_memory_byte_size")
    return name, params.get("shared_memory_offset"), size


def output_write(registry: Optional[ShmRegistry], caller: Caller, params: dict,
                 data: Any) -> Optional[int]:
    """Write an output into the caller's region its requested parameters name (its byte
    count), or None when they name none."""
    region = _region_of(registry, params, "an output")
    if region is None:
        return None
    assert registry is not None  # _region_of refused a region without one
    return registry.write(caller, *region, data)


def input_view(registry: Optional[ShmRegistry], caller: Caller,
               params: dict) -> Optional[memoryview]:
    """The input's bytes when its parameters name one of the caller's regions, else None."""
    region = _region_of(registry, params, "an input")
    if region is None:
        return None
    assert registry is not None  # _region_of refused a region without one
    return registry.view(caller, *region)
