"""Who may call (issue 12 items 9, 10): API keys on HTTP and gRPC, sequences scoped to the key
that started them, keys never logged; HTTPS and gRPC over TLS with a generated self-signed
certificate (httpx, the openai client, a grpc secure channel)."""
from __future__ import annotations

import logging
import ssl

import grpc
import httpx
import numpy as np
import openai
import pytest
import serve_support as S

from lumen_core.config import parse_config
from lumen_core.serve.auth import ApiKeys, Unauthenticated
from lumen_core.serve.grpc import ERROR_CODE_KEY
from lumen_core.serve.proto import lumen_pb2 as pb
from lumen_core.serve.proto import lumen_pb2_grpc as pb_grpc

KEY_A = "sekrit-key-AAAA-1234"
KEY_B = "sekrit-key-BBBB-5678"
VAD_MIME = "audio/L16;rate=16000"
VAD_CHUNK = np.zeros(512, np.int16).tobytes()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return S.self_signed_cert(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, certs):
    cert, key = certs
    srv = S.default_server(S.prepared_home(tmp_path_factory),
                           server_kwargs={"tls_cert": str(cert), "tls_key": str(key),
                                          "api_keys": [KEY_B], "access_log": True},
                           api_keys=[KEY_A], open_endpoints=["/metrics"])
    yield srv
    srv.stop()


@pytest.fixture()
def client(server, certs):
    with httpx.Client(base_url=server.url, verify=ssl.create_default_context(cafile=str(certs[0])), timeout=30) as c:
        yield c


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


# -- 9. API keys --------------------------------------------------------------------------------
def test_http_needs_a_valid_key_except_on_open_endpoints(client):
    assert client.get("/healthz").status_code == 200
    assert client.get("/metrics").status_code == 200  # opened by [server] open_endpoints
    for headers in ({}, bearer("wrong"), {"Authorization": KEY_A}, {"Authorization": "Basic x"}):
        for path in ("/readyz", "/v1/tasks", "/v1/models"):
            r = client.get(path, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
            err = r.json()["error"]
            assert err["code"] == "unauthenticated" and err["field"] == "authorization"
            assert KEY_A not in r.text and "wrong" not in err["message"]
    for key in (KEY_A, KEY_B):  # from [server] api_keys and from --api-key
        assert client.get("/readyz", headers=bearer(key)).status_code == 200
    r = client.post("/v1/embeddings", json={"model": "text_embed", "input": "hi"})
    assert r.status_code == 401
    # the Open Inference Protocol keeps its own error shape, {"error": "<message>"}, for 401 too
    for path in ("/v2", "/v2/models/text_embed", "/v2/health/ready"):
        r = client.get(path)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert isinstance(r.json()["error"], str) and "API key" in r.json()["error"]
    assert client.get("/v2", headers=bearer(KEY_A)).json()["name"] == "lumen-core"


def test_sequences_are_scoped_to_the_key_that_started_them(client):
    def send(key: str, **meta: str) -> httpx.Response:
        params = {"lumen.sequence.id": "shared-id", **meta}
        return client.post("/v1/infer/vad", content=VAD_CHUNK, params=params,
                           headers={"Content-Type": VAD_MIME, **bearer(key)})

    assert send(KEY_A, **{"lumen.sequence.start": "true"}).status_code == 200
    # another key knowing the id can neither continue nor end it
    for meta in ({}, {"lumen.sequence.end": "true"}):
        r = send(KEY_B, **meta)
        assert r.status_code == 400, r.text
        assert "'shared-id'" in r.json()["error"]["message"]  # the client's own id, unscoped
    assert send(KEY_A).status_code == 200  # still open for its owner
    assert send(KEY_A, **{"lumen.sequence.end": "true"}).status_code == 200


def test_keys_are_never_logged(client, caplog):
    with caplog.at_level(logging.DEBUG):
        client.get("/readyz", headers=bearer(KEY_A))
        client.get("/readyz", headers=bearer("not-a-key-XYZ"))
    text = caplog.text
    assert "/readyz" in text  # the access log is on
    assert KEY_A not in text and "not-a-key-XYZ" not in text


def test_grpc_needs_a_key(server, certs):
    creds = grpc.ssl_channel_credentials(certs[0].read_bytes())
    req = pb.InferRequest(task="vad", payload=VAD_CHUNK, payload_mime=VAD_MIME,
                          meta={"lumen.sequence.id": "g1", "lumen.sequence.start": "true",
                                "lumen.sequence.end": "true"})
    with grpc.secure_channel(server.grpc_target, creds,
                             options=[("grpc.ssl_target_name_override", "localhost")]) as ch:
        stub = pb_grpc.InferenceStub(ch)
        for md in ((), (("authorization", "Bearer wrong"),)):
            with pytest.raises(grpc.RpcError) as ei:
                stub.Infer(req, metadata=md, timeout=30)
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert dict(ei.value.trailing_metadata())[ERROR_CODE_KEY] == "unauthenticated"
            with pytest.raises(grpc.RpcError) as ei:
                list(stub.InferStream(iter([req]), metadata=md, timeout=30))
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        resp = stub.Infer(req, metadata=(("authorization", f"Bearer {KEY_A}"),), timeout=30)
        assert resp.task == "vad"
        replies = list(stub.InferStream(iter([req]), timeout=30,
                                        metadata=(("authorization", f"Bearer {KEY_B}"),)))
        assert replies[0].HasField("response")


def test_key_file_and_config_checks(tmp_path):
    f = tmp_path / "keys.txt"
    f.write_text("# ops keys\nfile-key-1\n\n  file-key-2  \n")
    cfg = parse_config({"server": {"api_key_file": "keys.txt", "api_keys": ["inline"]}},
                       "lumen.toml", base_dir=str(tmp_path))
    assert "inline" not in repr(cfg.server)
    keys = ApiKeys.from_config(cfg.server)
    assert len(keys) == 3 and "file-key" not in repr(keys)
    assert keys.check("Bearer file-key-2") != keys.check("Bearer inline")
    with pytest.raises(Unauthenticated):
        keys.check("Bearer file-key")
    with pytest.raises(ValueError, match="open_endpoints"):
        parse_config({"server": {"open_endpoints": ["/v1/tasks"]}})
    with pytest.raises(ValueError, match="tls_key_file"):
        parse_config({"server": {"tls_cert_file": "c.pem"}})


# -- 10. TLS -------------------------------------------------------------------------------------
def test_https_with_httpx_and_the_openai_client(server, certs):
    assert server.url.startswith("https://")
    with pytest.raises(httpx.ConnectError):  # not trusted without the certificate
        httpx.get(f"{server.url}/healthz", timeout=10)
    with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port gets no HTTP answer
        httpx.get(server.url.replace("https://", "http://") + "/healthz", timeout=10)
    with httpx.Client(verify=ssl.create_default_context(cafile=str(certs[0])), timeout=30) as http_client:
        oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY_A, http_client=http_client,
                           max_retries=0)
        res = oa.embeddings.create(model="text_embed", input=["hello", "world"])
        assert [d.index for d in res.data] == [0, 1] and len(res.data[0].embedding) == 384
        bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong",
                            http_client=http_client, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.embeddings.create(model="text_embed", input="hello")


def test_grpc_over_tls_refuses_an_insecure_channel(server):
    req = pb.InferRequest(task="vad", payload=VAD_CHUNK, payload_mime=VAD_MIME)
    with grpc.insecure_channel(server.grpc_target) as ch:
        with pytest.raises(grpc.RpcError) as ei:
            pb_grpc.InferenceStub(ch).Infer(req, timeout=5)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
