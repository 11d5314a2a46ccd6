"""``lumen infer``: one request (a file, a .npy tensor, a WAV as a sequence), in process
or against ``--url``, its JSON reply printed."""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional, Sequence

from .common import API_KEY_HELP, EXIT_OK, build_runtime, http

#: file extensions the stdlib's mimetypes does not map (or maps differently) for our tasks
EXTRA_MIMES = {".txt": "text/plain; charset=utf-8", ".pcm": "audio/L16;rate=16000",
               ".raw": "audio/L16;rate=16000", ".f32": "audio/pcm;format=f32le;rate=16000",
               ".webp": "image/webp", ".bin": "application/octet-stream"}
#: `lumen infer TASK FILE.wav`: the WAV is cut into chunks of this many samples, one request
#: each, sent in order as one sequence (Silero VAD's 32 ms at 16 kHz)
WAV_CHUNK_SAMPLES = 512
WAV_RATE = 16000
WAV_MIME = f"audio/L16;rate={WAV_RATE}"
#: a whole WAV file (a task with speech segments takes it at once, any PCM rate)
WAV_FILE_MIME = "audio/wav"


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
    layout); None for either where there are several choices or none.  The rule is the
    server's own (``contract.implied_signature``); the CLI applies it too, so a server that
    predates the rule still gets both keys."""
    from ..contract import implied_signature

    sigs = [(s.get("dtype"), s.get("layout"), len(s.get("shape") or ()),
             s.get("preprocess_ids") or ()) for s in (desc or {}).get("tensor_signatures") or ()]
    return implied_signature(sigs, dtype, ndim, layout)


def _tensor_request(args: argparse.Namespace, arr, meta: dict,
                    describe: Callable[[], Optional[dict]]) -> tuple:
    """``(payload, mime, meta)`` of the tensor route for ``arr``.  The layout (unless
    --layout) and the preprocess id (unless --meta gives one) come from the task's contract
    (``describe()``) when it leaves one choice for the array's dtype and rank; otherwise the
    layout is the rank's default and no preprocess id is sent (the server names what fits)."""
    from ..contract import DEFAULT_LAYOUT_FOR_RANK, DTYPE_NAMES, KEY_PREPROCESS_ID
    from ..request import new_infer_request

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

    from ..contract import KEY_SEQUENCE_END, KEY_SEQUENCE_ID, KEY_SEQUENCE_START

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
    from ..request import InferRequest
    from ..serve.codec import response_json

    rt = build_runtime(args.config, only_task=args.task)
    with rt:
        if mime is None:
            payload, mime, meta = _tensor_request(args, payload, meta,
                                                  lambda: rt.describe(args.task))
        resp = rt.infer_sync(InferRequest(args.task, payload, mime, meta))
    _print_json(response_json(resp))  # the JSON reply of POST /v1/infer/{task}
    return EXIT_OK


def _infer_wav(args: argparse.Namespace) -> int:
    """FILE.wav for a task that gives speech segments (``vad``): the whole file, one JSON
    reply ``{"segments", "duration_ms"}`` (what ``POST /v1/infer/{task}`` answers for it; any
    integer PCM rate and channel count, resampled whole; ``--meta probabilities=true`` adds
    the per-chunk probabilities).  For another stateful task: a 16 kHz mono PCM16 file
    streamed as one sequence, a chunk per request, one JSON reply a line (JSON Lines)."""
    meta = _parse_meta(args.meta)
    if args.url:
        desc = _remote_task(args)
        if isinstance(desc, dict) and isinstance(desc.get("segments"), dict):
            with open(args.file, "rb") as f:
                return _infer_http(args, f.read(), WAV_FILE_MIME, meta)
        chunks = read_wav_chunks(args.file)
        for chunk, m in zip(chunks, _sequence_metas(meta, len(chunks)), strict=True):
            _infer_http(args, chunk, WAV_MIME, m)
        return EXIT_OK
    from ..request import InferRequest
    from ..serve import audio
    from ..serve.codec import response_json

    rt = build_runtime(args.config, only_task=args.task)
    with rt:
        if audio.segment_task(rt, args.task) is not None:
            with open(args.file, "rb") as f:
                body = f.read()
            _print_json(rt.run_sync(audio.run_file(rt, args.task, body, WAV_FILE_MIME, meta)))
            return EXIT_OK
        chunks = read_wav_chunks(args.file)
        for chunk, m in zip(chunks, _sequence_metas(meta, len(chunks)), strict=True):
            _print_json(response_json(rt.infer_sync(InferRequest(args.task, chunk, WAV_MIME, m))))
    return EXIT_OK


def _remote_task(args: argparse.Namespace) -> Optional[dict]:
    """The description of ``args.task`` from the server's ``GET /v1/tasks`` (None when it
    does not serve it: the request itself then gets the server's 404)."""
    import json

    tasks = json.loads(http(args, "/v1/tasks")).get("tasks")
    return tasks.get(args.task) if isinstance(tasks, dict) else None


def _infer_http(args: argparse.Namespace, payload: bytes, mime: str, meta: dict) -> int:
    import urllib.parse

    path = f"/v1/infer/{urllib.parse.quote(args.task)}"
    if meta:
        path += "?" + urllib.parse.urlencode(meta)
    body = http(args, path, bytes(payload), {"Content-Type": mime})
    sys.stdout.write(body.decode("utf-8") + "\n")
    return EXIT_OK


def add_infer(sub: argparse._SubParsersAction) -> None:
    from ..contract import KEY_INPUT_KIND, KEY_PRIORITY

    p = sub.add_parser("infer", help="run one request (in process, or against --url) and print JSON",
                       description="Run FILE through TASK and print the JSON reply. The mime type "
                                   "comes from the extension (or --mime); a .npy file is sent as a "
                                   f"tensor ({KEY_INPUT_KIND}=tensor) with its own dtype and shape.")
    p.add_argument("task", metavar="TASK")
    p.add_argument("file", metavar="FILE",
                   help="the payload file ('-' reads stdin as text); a .wav for vad gives its "
                        "speech segments (any PCM rate and channels; --meta probabilities=true "
                        "adds per-chunk probabilities); for another stateful task a 16 kHz mono "
                        f"PCM16 .wav is streamed as one sequence of {WAV_CHUNK_SAMPLES}-sample "
                        "chunks (one JSON reply a line)")
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
