"""What the front doors need of the runtime, as types: :class:`RuntimeQueries` (route, ask,
infer), :class:`RuntimeAdmin` (versions, traffic, reloads) and :class:`ServedRuntime` (both,
plus the start and stop the server drives).

Why Protocols and not :class:`~lumen_core.runtime.Runtime` itself: a transport depends on
this narrow contract only (it never reaches into tasks, batchers or backends), the type checker
proves :class:`~lumen_core.runtime.Runtime` satisfies it wherever one is passed, and a test may
hand a door anything that has these members.  Typing only: the modules that use these names
import this one under ``if TYPE_CHECKING``, so nothing here runs on a request.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Mapping, Optional, Protocol, Sequence

if TYPE_CHECKING:
    from ..config import LumenConfig
    from ..contract import TensorContract
    from ..loading import Observer
    from ..request import InferRequest, InferResponse
    from ..tracing import Tracing

__all__ = ["AdmittingRuntime", "RuntimeAdmin", "RuntimeQueries", "ServedRuntime"]


class RuntimeQueries(Protocol):
    """The runtime's query API and its request path, as every transport uses them."""

    config: LumenConfig
    #: where the runtime reports requests and batches (the server sets its metrics here)
    observer: Observer

    @property
    def ready(self) -> bool: ...

    @property
    def tasks(self) -> Mapping[str, Any]:
        """Task name -> its head version; the hot door compares identities only (a memo
        stays valid while the head it was checked against still serves)."""
        ...

    @property
    def tracing(self) -> Optional[Tracing]: ...

    async def infer(self, req: InferRequest) -> InferResponse: ...

    async def infer_many(self, requests: Sequence[InferRequest]) -> list[Any]: ...

    def task_names(self) -> list[str]: ...

    def has_task(self, name: str) -> bool: ...

    def room(self, task: str, sequence_id: Optional[str] = None) -> int: ...

    def versions(self, task: str) -> list[str]: ...

    def request_options(self, task: str) -> Mapping[str, Any]: ...

    def contract(self, task: str) -> TensorContract: ...

    def describe(self, task: Optional[str] = None) -> dict[str, Any]: ...

    def load(self) -> dict[str, Any]: ...

    def cache_stats(self) -> dict[str, Any]: ...

    def extensions(self) -> dict[str, bool]: ...

    def token_ids_request(self, task: str, ids: Any, correlation_id: str = "",
                          field: str = "payload", truncate: bool = True) -> InferRequest: ...

    async def tokenize(self, task: str, texts: Sequence[str],
                       truncate: bool = True) -> list[Any]: ...

    def text_request(self, task: str, text: str, correlation_id: str = "") -> InferRequest: ...


class AdmittingRuntime(RuntimeQueries, Protocol):
    """A runtime that also admits a request without an await (:meth:`Runtime.admit`,
    ``settle``, ``cancelled``): what the HTTP door on Lumen's own connections needs to
    serve a request with no task of its own."""

    def admit(self, req: InferRequest) -> Any: ...

    def settle(self, req: InferRequest, entry: Any) -> InferResponse: ...

    def cancelled(self, entry: Any) -> None: ...


class RuntimeAdmin(Protocol):
    """The runtime's version management, as the admin API and ``--watch`` use it."""

    async def reload(self, task: Optional[str] = None) -> dict[str, Any]: ...

    def set_traffic(self, task: str, weights: Mapping[str, Any]) -> dict[str, Any]: ...

    async def load_version(self, task: str, version: str,
                           model: Optional[str] = None) -> dict[str, Any]: ...

    async def unload_version(self, task: str, version: str) -> dict[str, Any]: ...

    def lifecycle(self, task: Optional[str] = None) -> dict[str, Any]: ...

    def watch(self, interval_s: float = 1.0) -> asyncio.Task[Any]: ...

    def stop_loading(self) -> None: ...


class ServedRuntime(RuntimeQueries, RuntimeAdmin, Protocol):
    """A runtime a server owns: the queries, the admin side, and its start and stop."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...
