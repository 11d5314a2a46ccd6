"""The front door's CPU per request against the floors (issue 37).

What a request costs the *server process* (every thread, from ``/proc/<pid>/stat`` utime +
stime over the run) divided by the requests it answered, under ``wrk`` with 64 connections, for
three servers on the same uvicorn (uvloop + httptools), alone on the machine while measured:

* **lumen**: ``lumen serve`` (a subprocess, with a config) serving a null model (a 16x16
  MatMul, one instance, batches of 32) and a tiny text encoder (the MiniLM tokenizer over a
  table lookup and a mean: the door, the tokenizer and JSON are what is measured);
* **starlette**: a Starlette app whose routes read the body, multiply it by the same 16x16
  matrix in numpy (or tokenize and embed the same way) and answer;
* **bare**: a bare ASGI callable doing the same.

Routes: the tensor route (64 bytes in and out, ``Accept: application/octet-stream``), the Open
Inference Protocol REST infer (JSON, 16 floats) and ``/v1/embeddings`` (one short text).  The
floors parse and write JSON with the server's own codec (``lumen_core.serve.codec``).  gRPC:
``lumen.v1.Inference/Infer`` of the same 64-byte tensor against a bare ``grpc.aio`` servicer
answering the same message, driven by a grpc.aio client process with 64 calls in flight.

Rounds interleave the servers (each round runs every route on every server, in turn); each
figure is printed per round with the ratios lumen/bare and lumen/starlette, then the median and
the spread (min-max) of every ratio, and the load average before and after (the box is shared:
ratios measured in one run are what compare).

    python bench/bench_door.py [--rounds 3] [--seconds 4] [--connections 64]
                               [--routes tensor,oip,embed] [--no-grpc]
    python bench/bench_door.py --serve bare|starlette|grpc --port P   # one floor (internal)

``wrk`` must be on PATH (``apt-get install wrk``).  Where the CPU goes:
``py-spy record --threads -r 500 -f raw -p <lumen pid>`` while a round runs.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_null  # noqa: E402 - bench/: the null model (a DxD MatMul)
import harness  # noqa: E402  (bench/: quick mode, rounds, the result format)

D = bench_null.D
BATCH = bench_null.BATCH
#: the tiny text encoder's embedding size
EMBED_DIM = 32
#: the MiniLM tokenizer's vocabulary size (the tiny model's table has a row per id)
VOCAB = 30522
SERVERS = ("lumen", "starlette", "bare")
ROUTES = ("tensor", "oip", "embed")
TEXT = "a short sentence for the door"
TENSOR_QUERY = ("lumen.input.kind=tensor&lumen.tensor.dtype=fp32&lumen.tensor.shape=[1,16]"
                "&lumen.tensor.layout=NC&lumen.preprocess.id=none")
START_TIMEOUT_S = 120.0


def weights() -> np.ndarray:
    """The null model's matrix (``bench_null.null_model``: seed 0, scaled by 1/sqrt(D)); the
    floors multiply by the same one."""
    return (np.random.default_rng(0).standard_normal((D, D)) / np.sqrt(D)).astype(np.float32)


def tokenizer_path() -> str:
    """The prepared MiniLM tokenizer (``lumen models prepare``; LUMEN_HOME picks the store)."""
    from lumen_core import models
    from lumen_core.models import minilm

    path = models.model_dir(models.MINILM) / minilm.TOKENIZER_FILE
    if not path.exists():
        harness.skip(f"{path} is missing: run `lumen models prepare` (or set LUMEN_HOME)")
    return str(path)


# ----------------------------------------------------------------------------- models
def tiny_text_model(path: str) -> str:
    """A text encoder with MiniLM's inputs whose ``embedding`` [N, EMBED_DIM] is the mean of
    a seeded embedding table's rows for the masked token ids: a lookup and a mean, nothing
    for ORT to do."""
    from onnx import TensorProto, helper, numpy_helper, save

    table = np.random.default_rng(2).standard_normal((VOCAB, EMBED_DIM)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["rows"]),
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["mask_f", "last"], ["mask3"]),
        helper.make_node("Mul", ["rows", "mask3"], ["kept"]),
        helper.make_node("ReduceMean", ["kept", "tokens"], ["embedding"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "tiny_text",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["N", "L"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["N", "L"])],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["N", EMBED_DIM])],
        [numpy_helper.from_array(table, "table"),
         numpy_helper.from_array(np.array([2], np.int64), "last"),
         numpy_helper.from_array(np.array([1], np.int64), "tokens")])
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def lumen_config(workdir: str, tokenizer: str) -> str:
    batching = f"max_batch_size = {BATCH}\nmax_queue_delay_us = 0\nmax_queue_size = 4096\n"
    text = f"""[server]
max_connections = 4096

[[tasks]]
name = "null"
backend = "onnx"
model = "{bench_null.null_model()}"
instances = 1
intra_op_threads = 1
[tasks.batching]
{batching}
[[tasks]]
name = "tiny_text"
backend = "text_embedding"
model = "{tiny_text_model(os.path.join(workdir, 'tiny_text.onnx'))}"
instances = 1
intra_op_threads = 1
[tasks.options]
tokenizer = "{tokenizer}"
[tasks.batching]
{batching}"""
    path = os.path.join(workdir, "lumen.toml")
    with open(path, "w") as fh:
        fh.write(text)
    return path


# ----------------------------------------------------------------------------- the floors
def floor_handlers(tokenizer: str) -> dict:
    """path -> fn(body) -> (content type, reply bytes): what every floor answers."""
    from tokenizers import Tokenizer

    from lumen_core.serve import codec

    w = weights()
    tok = Tokenizer.from_file(tokenizer)
    table = np.random.default_rng(2).standard_normal((VOCAB, EMBED_DIM)).astype(np.float32)

    def tensor(body: bytes) -> tuple:
        y = np.frombuffer(body, np.float32).reshape(1, D) @ w
        return b"application/octet-stream", y.tobytes()

    def oip(body: bytes) -> tuple:
        obj = codec.loads(body, "the body", "body")
        inp = obj["inputs"][0]
        y = np.asarray(inp["data"], np.float32).reshape(inp["shape"]) @ w
        return b"application/json", codec.dumps({
            "model_name": "null", "outputs": [{"name": "y", "datatype": "FP32",
                                               "shape": list(y.shape),
                                               "data": y.reshape(-1).tolist()}]})

    def embed(body: bytes) -> tuple:
        obj = codec.loads(body, "the body", "body")
        ids = np.array(tok.encode(obj["input"]).ids, np.int64)
        vec = table[ids].mean(axis=0)
        return b"application/json", codec.dumps({
            "object": "list", "data": [{"object": "embedding", "index": 0,
                                        "embedding": vec.tolist()}],
            "model": obj["model"], "usage": {"prompt_tokens": len(ids),
                                             "total_tokens": len(ids)}})

    return {"/v1/infer/null": tensor, "/v2/models/null/infer": oip, "/v1/embeddings": embed,
            "/healthz": lambda body: (b"application/json", b'{"status":"ok"}')}


def bare_app(tokenizer: str):
    handlers = floor_handlers(tokenizer)

    async def app(scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        more = True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        ctype, out = handlers[scope["path"]](body)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", ctype),
                                (b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})

    return app


def starlette_app(tokenizer: str):
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    handlers = floor_handlers(tokenizer)

    def route(path: str, method: str) -> Route:
        fn = handlers[path]

        async def endpoint(request) -> Response:
            ctype, out = fn(await request.body())
            return Response(out, media_type=ctype.decode())

        return Route(path, endpoint, methods=[method])

    return Starlette(routes=[route(p, "GET" if p == "/healthz" else "POST") for p in handlers])


def grpc_floor(port: int) -> None:
    """A bare grpc.aio ``lumen.v1.Inference`` servicer: ``Infer`` multiplies the tensor."""
    import grpc

    from lumen_core.serve.proto import lumen_pb2, lumen_pb2_grpc

    w = weights()

    class Floor(lumen_pb2_grpc.InferenceServicer):
        async def Infer(self, request, context):  # noqa: N802 - the proto's name
            y = np.frombuffer(request.payload, np.float32).reshape(1, D) @ w
            return lumen_pb2.InferResponse(
                correlation_id=request.correlation_id, task=request.task,
                outputs={"y": lumen_pb2.Tensor(dtype="fp32", shape=[1, D], data=y.tobytes())})

    async def main() -> None:
        server = grpc.aio.server()
        lumen_pb2_grpc.add_InferenceServicer_to_server(Floor(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    import uvloop
    uvloop.run(main())


def serve_floor(kind: str, port: int, tokenizer: str) -> None:
    if kind == "grpc":
        grpc_floor(port)
        return
    import uvicorn

    app = bare_app(tokenizer) if kind == "bare" else starlette_app(tokenizer)
    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools",
                log_level="warning", access_log=False, lifespan="off", backlog=2048,
                server_header=False, date_header=False)


# ----------------------------------------------------------------------------- measuring
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(port: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} during start-up")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"server on {port} did not start in {START_TIMEOUT_S:g} s")


def wait_port(port: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} during start-up")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise SystemExit(f"port {port} did not open in {START_TIMEOUT_S:g} s")


def lua_script(workdir: str, route: str) -> str:
    """A wrk script posting the route's body."""
    x = np.random.default_rng(1).standard_normal((1, D)).astype(np.float32)
    if route == "tensor":
        body = "".join(f"\\{b:03d}" for b in x.tobytes())
        headers = {"Content-Type": "application/octet-stream",
                   "Accept": "application/octet-stream"}
    elif route == "oip":
        from lumen_core.serve import codec
        body = codec.dumps({"inputs": [{"name": "x", "shape": [1, D], "datatype": "FP32",
                                        "data": x.reshape(-1).tolist()}]}).decode()
        headers = {"Content-Type": "application/json"}
    else:
        from lumen_core.serve import codec
        body = codec.dumps({"model": "tiny_text", "input": TEXT}).decode()
        headers = {"Content-Type": "application/json"}
    if route != "tensor":
        body = body.replace("\\", "\\\\").replace('"', '\\"')
    lines = ['wrk.method = "POST"', f'wrk.body = "{body}"']
    lines += [f'wrk.headers["{k}"] = "{v}"' for k, v in headers.items()]
    path = os.path.join(workdir, f"{route}.lua")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return path


def path_of(route: str) -> str:
    return {"tensor": "/v1/infer/null?" + TENSOR_QUERY, "oip": "/v2/models/null/infer",
            "embed": "/v1/embeddings"}[route]


def floor_path_of(route: str) -> str:
    return {"tensor": "/v1/infer/null", "oip": "/v2/models/null/infer",
            "embed": "/v1/embeddings"}[route]


def run_wrk(pid: int, url: str, script: str, seconds: float, conns: int) -> dict:
    """Server CPU per answered request (us) and requests/s of one wrk run."""
    c0 = harness.proc_cpu_seconds(pid)
    out = subprocess.run(["wrk", "-t", "2", "-c", str(conns), "-d", f"{seconds:g}s",
                          "--latency", "-s", script, url],
                         capture_output=True, text=True, check=True).stdout
    c1 = harness.proc_cpu_seconds(pid)
    m = re.search(r"(\d+) requests in ([\d.]+)(m?s)", out)
    if m is None:
        raise SystemExit(f"cannot read wrk's output:\n{out}")
    n = int(m.group(1))
    dur = float(m.group(2)) * (1e-3 if m.group(3) == "ms" else 1.0)
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errs = re.search(r"Socket errors: (.*)", out)
    ok = n - (int(bad.group(1)) if bad else 0)
    if ok <= 0:
        raise SystemExit(f"no request answered 2xx:\n{out}")
    return {"us": (c1 - c0) * 1e6 / ok, "rps": ok / dur, "bad": n - ok,
            "errors": errs.group(1) if errs else ""}


def grpc_client(port: int, seconds: float, conns: int) -> None:
    """Child: ``conns`` concurrent ``Infer`` calls for ``seconds``; prints the count."""
    import grpc

    from lumen_core.serve.proto import lumen_pb2, lumen_pb2_grpc

    x = np.random.default_rng(1).standard_normal((1, D)).astype(np.float32)
    req = lumen_pb2.InferRequest(task="null", payload=x.tobytes(),
                                 payload_mime="application/octet-stream",
                                 meta={"lumen.input.kind": "tensor", "lumen.tensor.dtype": "fp32",
                                       "lumen.tensor.shape": "[1,16]",
                                       "lumen.tensor.layout": "NC",
                                       "lumen.preprocess.id": "none"})

    async def main() -> int:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = lumen_pb2_grpc.InferenceStub(ch)
            await stub.Infer(req)
            done = 0
            end = time.monotonic() + seconds

            async def one() -> None:
                nonlocal done
                while time.monotonic() < end:
                    await stub.Infer(req)
                    done += 1

            await asyncio.gather(*(one() for _ in range(conns)))
            return done

    import uvloop
    print(uvloop.run(main()))


def run_grpc(pid: int, port: int, seconds: float, conns: int) -> dict:
    c0 = harness.proc_cpu_seconds(pid)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, "--grpc-client", "--port", str(port),
                          "--seconds", str(seconds), "--connections", str(conns)],
                         capture_output=True, text=True, check=True).stdout
    dt = time.perf_counter() - t0
    c1 = harness.proc_cpu_seconds(pid)
    n = int(out.split()[-1])
    return {"us": (c1 - c0) * 1e6 / n, "rps": n / dt, "bad": 0, "errors": ""}


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def spread(xs: list) -> str:
    return f"{statistics.median(xs):.2f}x (spread {min(xs):.2f}-{max(xs):.2f})"


def start_servers(a: argparse.Namespace, workdir: str, tokenizer: str) -> dict:
    procs: dict = {}
    env = dict(os.environ)
    cfg = lumen_config(workdir, tokenizer)
    port, gport = free_port(), free_port()
    cmd = [sys.executable, "-m", "lumen_core.cli", "serve", "--config", cfg, "--http-port",
           str(port), "--grpc-port", str(gport)]
    procs["lumen"] = (subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL), port, gport)
    for kind in ("starlette", "bare"):
        p = free_port()
        procs[kind] = (subprocess.Popen([sys.executable, __file__, "--serve", kind, "--port",
                                         str(p), "--tokenizer", tokenizer], env=env), p, None)
    if a.grpc:
        p = free_port()
        procs["grpc-floor"] = (subprocess.Popen([sys.executable, __file__, "--serve", "grpc",
                                                 "--port", str(p)], env=env), p, None)
    for name, (proc, p, _g) in procs.items():
        if name == "grpc-floor":
            wait_port(p, proc)
        else:
            wait_http(p, proc)
    return procs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0, help="wrk duration per measurement")
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--routes", default=",".join(ROUTES))
    ap.add_argument("--no-grpc", dest="grpc", action="store_false")
    ap.add_argument("--serve", choices=("bare", "starlette", "grpc"), help=argparse.SUPPRESS)
    ap.add_argument("--grpc-client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer", help=argparse.SUPPRESS)
    harness.add_quick(ap, seconds=1.0)
    a = harness.parse(ap)
    if a.serve:
        serve_floor(a.serve, a.port, a.tokenizer)
        return
    if a.grpc_client:
        grpc_client(a.port, a.seconds, a.connections)
        return
    if shutil.which("wrk") is None:
        harness.skip("wrk is not on PATH (apt-get install wrk)")
    routes = [r for r in a.routes.split(",") if r]
    unknown = set(routes) - set(ROUTES)
    if unknown:
        raise SystemExit(f"unknown route(s) {sorted(unknown)}; known: {', '.join(ROUTES)}")
    workdir = tempfile.mkdtemp(prefix="bench_door_")
    tokenizer = tokenizer_path()
    print(f"load average before: {load_avg()}  (cpus: {os.cpu_count()})")
    procs = start_servers(a, workdir, tokenizer)
    scripts = {r: lua_script(workdir, r) for r in routes}
    ratios: dict = {}
    try:
        for rnd in range(a.rounds):
            for route in routes:
                res = {}
                order = SERVERS if rnd % 2 == 0 else tuple(reversed(SERVERS))
                for name in order:
                    proc, port, _g = procs[name]
                    path = path_of(route) if name == "lumen" else floor_path_of(route)
                    res[name] = run_wrk(proc.pid, f"http://127.0.0.1:{port}{path}",
                                        scripts[route], a.seconds, a.connections)
                rb = res["lumen"]["us"] / res["bare"]["us"]
                rs = res["lumen"]["us"] / res["starlette"]["us"]
                ratios.setdefault((route, "bare"), []).append(rb)
                ratios.setdefault((route, "starlette"), []).append(rs)
                figs = "  ".join(f"{n} {r['us']:.0f} us ({r['rps'] / 1000:.1f}k/s"
                                 f"{', %d non-2xx' % r['bad'] if r['bad'] else ''})"
                                 for n, r in res.items())
                print(f"round {rnd + 1} {route:6s}: {figs}  lumen/bare {rb:.2f}x  "
                      f"lumen/starlette {rs:.2f}x  load {load_avg()}", flush=True)
            if a.grpc:
                lp, _p, gport = procs["lumen"]
                fp, fport, _ = procs["grpc-floor"]
                pair = [("lumen", lp.pid, gport), ("floor", fp.pid, fport)]
                if rnd % 2:
                    pair.reverse()
                g = {n: run_grpc(pid, p, a.seconds, a.connections) for n, pid, p in pair}
                r = g["lumen"]["us"] / g["floor"]["us"]
                ratios.setdefault(("grpc", "grpc.aio"), []).append(r)
                print(f"round {rnd + 1} grpc  : lumen {g['lumen']['us']:.0f} us "
                      f"({g['lumen']['rps'] / 1000:.1f}k/s)  grpc.aio floor "
                      f"{g['floor']['us']:.0f} us ({g['floor']['rps'] / 1000:.1f}k/s)  "
                      f"lumen/floor {r:.2f}x  load {load_avg()}", flush=True)
    finally:
        for proc, _p, _g in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc, _p, _g in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(f"\nmedian of {a.rounds} interleaved rounds (server CPU per answered request):")
    for (route, floor), xs in ratios.items():
        print(f"  {route:6s} lumen/{floor:9s} {spread(xs)}")
    print(f"load average after: {load_avg()}")
    harness.emit({f"{route} lumen / {floor} (server CPU per request)": harness.stat(xs, "x")
                  for (route, floor), xs in ratios.items()}, args=a)


if __name__ == "__main__":
    main()
