"""System shared memory against hostile clients (serve/shm.py, issue 25 rows 11-13): regions
belong to the API key that registered them, only loopback peers may use the extension (a
forwarding header never makes a peer local), and each region costs one file descriptor within
a budget the process's descriptor limit can hold."""
from __future__ import annotations

import os

import grpc
import httpx
import numpy as np
import pytest
import serve_support as S

from lumen_core.errors import InvalidArgument, PermissionDenied
from lumen_core.serve import shm

KEY_A, KEY_B = "shm-key-a", "shm-key-b"
A = {"Authorization": f"Bearer {KEY_A}"}
B = {"Authorization": f"Bearer {KEY_B}"}
BASE = "/v2/systemsharedmemory"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shm")
    cfg = S.onnx_config(tmp, slow=False, system_shared_memory=True, api_keys=[KEY_A, KEY_B])
    from lumen_core import Runtime

    srv = S.ServerThread(Runtime.from_dict(cfg))
    yield srv
    srv.stop()


@pytest.fixture()
def region(server):
    """A 64-byte POSIX shm object holding an mlp input; every region is unregistered after."""
    key = f"/lumen_shm_test_{os.getpid()}"
    path = "/dev/shm" + key
    x = S.mlp_input(3)
    with open(path, "wb") as fh:
        fh.write(x.tobytes())
    yield key, x
    for h in (A, B):
        httpx.post(f"{server.url}{BASE}/unregister", headers=h, timeout=10)
    os.unlink(path)


def _register(url: str, headers: dict, name: str, key: str, size: int, **kw) -> httpx.Response:
    return httpx.post(f"{url}{BASE}/region/{name}/register", headers=headers,
                      json={"key": key, "offset": 0, "byte_size": size}, timeout=10, **kw)


def _infer_from(url: str, headers: dict, name: str, nbytes: int) -> httpx.Response:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, S.D_IN],
                        "parameters": {"shared_memory_region": name,
                                       "shared_memory_byte_size": nbytes}}]}
    return httpx.post(f"{url}/v2/models/mlp/infer", json=body, headers=headers, timeout=10)


def test_regions_belong_to_the_key_that_registered_them(server, region):
    url = server.url
    key, x = region
    assert _register(url, A, "in", key, x.nbytes).status_code == 200
    assert _infer_from(url, A, "in", x.nbytes).status_code == 200
    # key B sees nothing of A's: not in the list, not by name, not for an input
    assert httpx.get(f"{url}{BASE}/status", headers=B, timeout=10).json() == []
    r = httpx.get(f"{url}{BASE}/region/in/status", headers=B, timeout=10)
    assert r.status_code == 400 and "no shared memory region" in r.json()["error"]
    r = _infer_from(url, B, "in", x.nbytes)
    assert r.status_code == 400 and "no shared memory region" in r.json()["error"]
    # nor can B unregister it, by name or all at once
    for path in (f"{BASE}/region/in/unregister", f"{BASE}/unregister"):
        assert httpx.post(url + path, headers=B, timeout=10).status_code == 200
    assert [r["name"] for r in httpx.get(f"{url}{BASE}/status", headers=A, timeout=10).json()] \
        == ["in"]
    # the same name is B's own region in B's namespace
    assert _register(url, B, "in", key, x.nbytes).status_code == 200
    assert _infer_from(url, B, "in", x.nbytes).status_code == 200
    httpx.post(f"{url}{BASE}/region/in/unregister", headers=B, timeout=10)
    assert _infer_from(url, A, "in", x.nbytes).status_code == 200


def test_grpc_regions_are_per_key_too(server, region):
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as rpc

    key, x = region
    with grpc.insecure_channel(server.grpc_target) as ch:
        stub = rpc.GRPCInferenceServiceStub(ch)
        md_a = (("authorization", A["Authorization"]),)
        md_b = (("authorization", B["Authorization"]),)
        stub.SystemSharedMemoryRegister(pb.SystemSharedMemoryRegisterRequest(
            name="g", key=key, byte_size=x.nbytes), metadata=md_a)
        # the same key sees it over HTTP too; the other key over neither
        assert [r["name"] for r in httpx.get(f"{server.url}{BASE}/status", headers=A,
                                             timeout=10).json()] == ["g"]
        assert not stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest(),
                                                 metadata=md_b).regions
        req = pb.ModelInferRequest(model_name="mlp")
        inp = req.inputs.add(name="x", datatype="FP32", shape=[1, S.D_IN])
        inp.parameters["shared_memory_region"].string_param = "g"
        inp.parameters["shared_memory_byte_size"].int64_param = x.nbytes
        assert stub.ModelInfer(req, metadata=md_a).outputs
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(req, metadata=md_b)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # a forwarding header: the peer is not trusted to be local
        with pytest.raises(grpc.RpcError) as e:
            stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest(),
                                          metadata=md_a + (("x-forwarded-for", "127.0.0.1"),))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_only_loopback_peers_and_never_through_a_forwarding_header(server, region):
    import asyncio

    key, x = region
    url = server.url
    # through uvicorn: a forwarded address (which uvicorn takes from 127.0.0.1) or any other
    # forwarding header is refused, whatever address it names
    for hdr in ({"X-Forwarded-For": "203.0.113.9"}, {"X-Forwarded-For": "127.0.0.1"},
                {"Forwarded": "for=127.0.0.1"}, {"X-Real-IP": "127.0.0.1"}):
        r = _register(url, {**A, **hdr}, "fwd", key, x.nbytes)
        assert r.status_code == 403, (hdr, r.text)
        assert "loopback" in r.json()["error"]
        r = httpx.get(f"{url}{BASE}/status", headers={**A, **hdr}, timeout=10)
        assert r.status_code == 403
        r = _infer_from(url, {**A, **hdr}, "fwd", x.nbytes)
        assert r.status_code == 403
    # a peer that is not on this machine (the app in process, as a remote address)
    app = server.server.http

    async def remote(peer: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=app, client=(peer, 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://lumen") as c:
            return await c.post(f"{BASE}/region/far/register", headers=A,
                                json={"key": key, "byte_size": x.nbytes})

    for peer in ("203.0.113.9", "10.0.0.1", "::ffff:203.0.113.9"):
        r = asyncio.run(remote(peer))
        assert r.status_code == 403, (peer, r.text)
    assert asyncio.run(remote("::1")).status_code == 200
    assert [r["name"] for r in httpx.get(f"{url}{BASE}/status", headers=A,
                                         timeout=10).json()] == ["far"]


@pytest.mark.parametrize("peer, local", [
    ("ipv4:127.0.0.1:5000", True), ("ipv6:[::1]:5000", True), ("unix:/tmp/s", True),
    ("ipv4:203.0.113.9:5000", False), ("ipv6:[2001:db8::1]:5000", False),
    ("ipv6:[::ffff:10.0.0.1]:80", False), ("ipv6:[::ffff:127.0.0.1]:80", True), ("", False),
    ("ipv4:garbage", False)])
def test_grpc_peer_strings(peer, local):
    assert shm.grpc_peer_is_local(peer) is local


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_region_costs_one_descriptor_and_the_budget_is_a_clean_400(tmp_path):
    key = f"/lumen_shm_fd_test_{os.getpid()}"
    path = "/dev/shm" + key
    with open(path, "wb") as fh:
        fh.write(bytes(4096))
    reg = shm.ShmRegistry(True, max_regions=40)
    me = shm.Caller(None, True)
    try:
        before = _fds()
        for i in range(40):
            reg.register(me, f"r{i}", key, 0, 4096)
        assert _fds() - before == 40  # one descriptor each (the mapping's own)
        with pytest.raises(InvalidArgument, match="shm_max_regions") as e:
            reg.register(me, "one_more", key, 0, 4096)
        assert e.value.field == "name"
        assert np.asarray(reg.view(me, "r3", 0, 16)).nbytes == 16
        os.truncate(path, 16)  # the truncation check still works without our own fd
        with pytest.raises(InvalidArgument, match="truncated"):
            reg.view(me, "r3", 0, 16)
        reg.unregister(me)
        assert _fds() == before
    finally:
        reg.unregister(me)
        os.unlink(path)


def test_the_region_budget_fits_the_descriptor_limit(monkeypatch):
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 4096))
    assert shm.region_budget(100_000) == 1024 // shm.FD_SHARE_DIVISOR
    assert shm.region_budget(10) == 10
    with pytest.raises(PermissionDenied):
        shm.ShmRegistry(True).register(shm.Caller(None, False), "x", "/k", 0, 1)
