"""The admin API (SPEC section 6, model lifecycle): versions, reloads and traffic over HTTP.

Routes (behind an admin key, ``[server] admin_api_keys``, whenever any key is configured:
inference keys get 403; with no key at all they are open, as every route is)::

    GET  /v1/admin/tasks                                   every task: versions (state
                                                           loading|ready|draining|failed, model,
                                                           revision, error), traffic split,
                                                           load failures, recent events
    GET  /v1/admin/tasks/{task}                            one task
    POST /v1/admin/tasks/{task}/reload                     re-read config + model files
    POST /v1/admin/tasks/{task}/versions/{version}/load    optional JSON {"model": path}: a
                                                           file under [server] model_root
                                                           (default: the config's folder)
    POST /v1/admin/tasks/{task}/versions/{version}/unload
    PUT  /v1/admin/tasks/{task}/traffic                    JSON {version: weight}

Each call answers the task's (or all tasks') state after the operation, as
``Runtime.lifecycle`` reports it.  The work itself is the runtime's (``lumen_core/versions.py``);
this module only translates HTTP.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..config import model_root
from ..errors import InvalidArgument
from ..watch import confine_model
from . import codec

if TYPE_CHECKING:  # typing only: the runtime as the doors use it
    from .http import HttpApp

PREFIX = "/v1/admin/tasks"
JSON = codec.JSON


class AdminRoutes:
    """The ``/v1/admin`` endpoints of one :class:`~lumen_core.serve.http.HttpApp` (its API
    keys, error shape, body limit and metrics are reused)."""

    def __init__(self, app: HttpApp):
        self.app = app
        self.rt = app.runtime

    def routes(self) -> list[Any]:
        def ep(name: str, fn: Any) -> Any:
            return self.app.endpoint(name, fn, admin=True)

        task = PREFIX + "/{task}"
        version = task + "/versions/{version}"
        return [Route(PREFIX, ep(PREFIX, self.list_tasks), methods=["GET"]),
                Route(task, ep(task, self.show_task), methods=["GET"]),
                Route(task + "/reload", ep(task + "/reload", self.reload), methods=["POST"]),
                Route(version + "/load", ep(version + "/load", self.load), methods=["POST"]),
                Route(version + "/unload", ep(version + "/unload", self.unload),
                      methods=["POST"]),
                Route(task + "/traffic", ep(task + "/traffic", self.traffic), methods=["PUT"])]

    @staticmethod
    def _reply(obj: Any) -> Response:
        return Response(codec.dumps(obj), media_type=JSON)

    async def list_tasks(self, request: Request) -> Response:
        return self._reply({"tasks": self.rt.lifecycle()})

    async def show_task(self, request: Request) -> Response:
        return self._reply(self.rt.lifecycle(request.path_params["task"]))

    async def reload(self, request: Request) -> Response:
        return self._reply(await self.rt.reload(request.path_params["task"]))

    async def load(self, request: Request) -> Response:
        p = request.path_params
        model = None
        if int(request.headers.get("content-length") or 0) or \
                request.headers.get("transfer-encoding"):
            obj = await self.app.json_body(request, "load")
            if not isinstance(obj, dict) or set(obj) - {"model"}:
                raise InvalidArgument("the body of a version load is {\"model\": path} or empty",
                                      "body")
            model = obj.get("model")
            if model is not None and (not isinstance(model, str) or not model):
                raise InvalidArgument("'model' must be the path of the version's model file",
                                      "model")
            if model is not None:  # confined to the model root, checked before any read
                cfg = self.rt.config
                model = confine_model(model, model_root(cfg), cfg.server.admin_max_model_bytes)
        return self._reply(await self.rt.load_version(p["task"], p["version"], model))

    async def unload(self, request: Request) -> Response:
        p = request.path_params
        return self._reply(await self.rt.unload_version(p["task"], p["version"]))

    async def traffic(self, request: Request) -> Response:
        obj = await self.app.json_body(request, "traffic")
        return self._reply(self.rt.set_traffic(request.path_params["task"], obj))
