"""Audio streams over a stateful VAD task: whole files (HTTP) and live streams (WebSocket).

Both run the audio as *one sequence* of 512-sample chunk requests through the runtime's
public API (``Runtime.infer_many``, a window of chunks at a time: the sequence batcher keeps
their order and runs one per batch, so many files and live streams batch together), and turn
the per-chunk probabilities into speech segments with silero-vad's semantics
(:mod:`lumen_core.tasks.vad_segments`).

A task qualifies when its description carries ``"segments"`` (the task's segment defaults,
which ``lumen.vad.*`` keys override per request).  Input formats:

- ``audio/wav`` (``audio/x-wav``, ``audio/wave``): integer PCM (``WAVE_FORMAT_PCM`` or
  ``WAVE_FORMAT_EXTENSIBLE`` with the PCM sub-format), its RIFF chunks walked by
  :func:`read_wav`: the header's sizes are checked against the body, never trusted over it;
  PCM16 mono 16 kHz is run as it is, any other rate, channel count or width is made 16 kHz
  mono float32 whole first (:mod:`.resample`: soxr, channels averaged);
- ``audio/L16;rate=16000`` (mono): raw PCM16 little-endian, any length;
- ``audio/pcm;format=f32le;rate=16000``: raw float32 little-endian (streams).

A trailing partial chunk is zero-padded (as silero's ``get_speech_timestamps`` pads it); the
segments use the true length.  A file longer than :data:`MAX_FILE_SECONDS`, or a body over
``[server] max_payload_bytes``, is refused (413) before any of it runs.
"""
from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from ..contract import (
    KEY_SEQUENCE_END,
    KEY_SEQUENCE_ID,
    KEY_SEQUENCE_START,
    KEY_VAD_EVENTS,
    RESERVED_PREFIX,
    VAD_KEYS,
)
from ..errors import InvalidArgument, LumenError, PayloadTooLarge, UnsupportedMediaType
from ..request import InferRequest
from ..tasks.base import mime_type
from ..tasks.vad_segments import (
    DEFAULTS,
    Segmenter,
    SegmentOptions,
    samples_to_ms,
    segment_options,
    segments_json,
)
from . import resample
from .body import read_body

if TYPE_CHECKING:  # typing only: the runtime as the doors use it
    from .http import HttpApp
    from .runtime_api import RuntimeQueries

SAMPLE_RATE = 16000
CHUNK_SAMPLES = 512
#: the longest whole file ``POST /v1/infer/{task}`` takes (refused with 413 up front)
MAX_FILE_SECONDS = 600
MAX_FILE_SAMPLES = MAX_FILE_SECONDS * SAMPLE_RATE
#: header room allowed above the samples of a WAV file of the longest length
WAV_HEADER_SLACK = 64 * 1024
#: bytes a second of the largest common WAV format the body limit allows for (48 kHz stereo
#: PCM16); ``[server] max_payload_bytes`` (16 MiB by default) is usually the tighter bound
WAV_MAX_BYTES_PER_S = 48000 * 2 * 2
#: chunk requests of one stream queued at once (bounds its share of the task's queue)
WINDOW_CHUNKS = 64
#: WAVE format tags: PCM, and WAVE_FORMAT_EXTENSIBLE (its sub-format GUID starts with the tag)
WAVE_FORMAT_PCM = 0x0001
WAVE_FORMAT_EXTENSIBLE = 0xFFFE
#: the smallest ``fmt `` chunk (PCM), and the extensible one that names its sub-format
FMT_MIN_BYTES = 16
FMT_EXTENSIBLE_BYTES = 40
RIFF_HEADER_BYTES = 12
CHUNK_HEADER_BYTES = 8
WAV_MIMES = frozenset({"audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave"})
MIME_L16 = "audio/l16"
MIME_PCM = "audio/pcm"
L16_MIME = f"audio/L16;rate={SAMPLE_RATE}"
F32_MIME = f"audio/pcm;format=f32le;rate={SAMPLE_RATE}"
ACCEPTED = ("audio/wav (integer PCM, any rate from 8 to 384 kHz and channel count: whole files "
            "are resampled to 16 kHz mono), audio/L16;rate=16000 (mono PCM16 little-endian) or "
            "audio/pcm;format=f32le;rate=16000")
#: what a live stream (or a raw PCM body) takes: it is never resampled
STREAM_ACCEPTED = ("audio/L16;rate=16000 (mono PCM16 little-endian) or "
                   "audio/pcm;format=f32le;rate=16000; a live stream is not resampled: convert "
                   "it to 16 kHz mono first (or send a whole WAV file to POST /v1/infer/{task})")
OUTPUT = "speech_prob"
#: query / first-message flag asking for per-chunk probabilities
PROBS_PARAM = "probabilities"
#: the plain query options of the whole-file route, beside the task's own (``lumen.vad.*``)
FILE_OPTIONS = {PROBS_PARAM: "true: the reply adds one speech probability per chunk"}


def is_audio_mime(mime: str) -> bool:
    base = mime_type(mime)[0]
    return base in WAV_MIMES or base in (MIME_L16, MIME_PCM)


def segment_task(runtime: RuntimeQueries, task: str) -> Optional[dict]:
    """The task's description when it produces speech segments, else None."""
    if not runtime.has_task(task):
        return None
    try:
        desc = runtime.describe(task)
    except LumenError:
        return None
    return desc if isinstance(desc.get("segments"), dict) else None


def task_options(desc: dict) -> SegmentOptions:
    try:
        return SegmentOptions(**desc["segments"])
    except (TypeError, KeyError):
        return DEFAULTS


def flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in ("1", "true", "yes")


def stream_format(mime: str, field: str = "Content-Type") -> int:
    """Sample width in bytes (2: PCM16, 4: float32) of a raw stream mime; 415 otherwise."""
    base, params = mime_type(mime)
    if params.get("rate") != str(SAMPLE_RATE) or params.get("channels", "1") != "1":
        raise UnsupportedMediaType(f"unsupported audio {mime[:80]!r}; accepted: "
                                   f"{STREAM_ACCEPTED}", field)
    if base == MIME_L16:
        return 2
    if base == MIME_PCM and params.get("format") == "f32le":
        return 4
    raise UnsupportedMediaType(f"unsupported audio {mime[:80]!r}; accepted: {STREAM_ACCEPTED}",
                               field)


def max_file_bytes(mime: str) -> int:
    """The largest body of a file of the longest length (``MAX_FILE_SECONDS``; a WAV file at
    up to 48 kHz stereo PCM16, which is resampled; its true length is checked once decoded)."""
    base = mime_type(mime)[0]
    if base in WAV_MIMES:
        return MAX_FILE_SECONDS * WAV_MAX_BYTES_PER_S + WAV_HEADER_SLACK
    width = 4 if base == MIME_PCM else 2
    return MAX_FILE_SAMPLES * width


def file_limit(mime: str, max_payload: int) -> tuple:
    """(bytes, what sets it): a whole file is bounded by ``MAX_FILE_SECONDS`` and by
    ``[server] max_payload_bytes``, whichever is smaller."""
    longest = max_file_bytes(mime)
    if max_payload < longest:
        return max_payload, "server.max_payload_bytes"
    return longest, f"{MAX_FILE_SECONDS} s, MAX_FILE_SECONDS"


def too_long(samples: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"the audio is {samples / SAMPLE_RATE:.1f} s long; the limit is "
                           f"{MAX_FILE_SECONDS} s (MAX_FILE_SECONDS)", "payload")


def _bad_wav(problem: str) -> InvalidArgument:
    return InvalidArgument(f"not a readable WAV file: {problem}", "payload")


def _chunks(mv: memoryview, pos: int):
    """``(id, start, declared size)`` of each RIFF chunk from ``pos`` on; a chunk header cut
    short ends the walk (trailing padding)."""
    while pos + CHUNK_HEADER_BYTES <= len(mv):
        cid = bytes(mv[pos:pos + 4])
        size = int.from_bytes(mv[pos + 4:pos + 8], "little")
        yield cid, pos + CHUNK_HEADER_BYTES, size
        pos += CHUNK_HEADER_BYTES + size + (size & 1)  # chunks are word aligned


def _tiles(mv: memoryview, pos: int) -> bool:
    """Whether the bytes from ``pos`` are whole chunks with printable ids (what may follow an
    empty data chunk), not audio behind a header that says there is none."""
    for cid, start, size in _chunks(mv, pos):
        if not (cid.isascii() and cid.decode().isprintable()) or start + size > len(mv):
            return False
    return True


def _wav_format(fmt: memoryview) -> tuple:
    """(channels, sample width in bytes, rate) of a ``fmt `` chunk; 415 for a format that is
    not integer PCM."""
    if len(fmt) < FMT_MIN_BYTES:
        raise _bad_wav(f"its fmt chunk is {len(fmt)} bytes (at least {FMT_MIN_BYTES})")
    tag = int.from_bytes(fmt[0:2], "little")
    if tag == WAVE_FORMAT_EXTENSIBLE and len(fmt) >= FMT_EXTENSIBLE_BYTES:
        tag = int.from_bytes(fmt[24:26], "little")  # the sub-format GUID's first field
    if tag != WAVE_FORMAT_PCM:
        raise UnsupportedMediaType(f"the WAV file is not PCM (format tag 0x{tag:04x}); "
                                   f"accepted: {ACCEPTED}", "Content-Type")
    channels = int.from_bytes(fmt[2:4], "little")
    rate = int.from_bytes(fmt[4:8], "little")
    bits = int.from_bytes(fmt[14:16], "little")
    return channels, (bits + 7) // 8, rate


def read_wav(body: Any) -> tuple:
    """``(channels, sample width, rate, samples)`` of a RIFF/WAVE file, its chunk sizes checked
    against the body (``samples`` a memoryview of whole frames):

    - a chunk before the data that runs past the end of the body: 400 (a corrupt file);
    - a data chunk that runs past the end (``0xFFFFFFFF``, the size a streaming writer leaves,
      or a cut file): the samples present are the audio;
    - a data chunk declared empty with audio behind it: 400 (the header lies; trusting it would
      answer "no speech" for speech)."""
    mv = memoryview(body).cast("B")
    if len(mv) < RIFF_HEADER_BYTES or mv[0:4] != b"RIFF" or mv[8:12] != b"WAVE":
        raise _bad_wav("it does not begin with a RIFF/WAVE header")
    fmt = None
    for cid, start, size in _chunks(mv, RIFF_HEADER_BYTES):
        left = len(mv) - start
        if cid == b"data":
            if fmt is None:
                raise _bad_wav("its data chunk comes before the fmt chunk")
            if size == 0 and left and not _tiles(mv, start):
                raise _bad_wav(f"its header declares an empty data chunk, but {left} bytes of "
                               f"audio follow it; write the data size into the header")
            data = mv[start:start + min(size, left)]
            frame = max(1, fmt[0] * fmt[1])
            return fmt + (data[:len(data) - len(data) % frame],)
        if size > left:
            raise _bad_wav(f"its {cid.decode('latin-1')!r} chunk declares {size} bytes, but "
                           f"only {left} follow (a corrupt or cut file)")
        if cid == b"fmt ":
            fmt = _wav_format(mv[start:start + size])
    raise _bad_wav("it has no data chunk" if fmt is not None else "it has no fmt chunk")


def decode_file(body: bytes, mime: str) -> tuple:
    """``(samples as bytes-like, sample width)`` of a whole file; 415 / 400 / 413."""
    base = mime_type(mime)[0]
    if base in WAV_MIMES:
        ch, width, rate, data = read_wav(body)
        if (ch, width, rate) == (1, 2, SAMPLE_RATE):
            if len(data) // 2 > MAX_FILE_SAMPLES:
                raise too_long(len(data) // 2)
            return data, 2
        # another rate, channel count or width: made 16 kHz mono float32 whole (resample.py)
        resample.check_format(ch, width, rate, ACCEPTED)
        n = resample.out_samples(len(data) // (ch * width), rate)
        if n > MAX_FILE_SAMPLES:
            raise too_long(n)
        return resample.to_mono_16k(data, ch, width, rate).data.cast("B"), 4
    width = stream_format(mime)
    if len(body) % width:
        raise InvalidArgument(f"{len(body)} bytes is not a whole number of {width}-byte samples",
                              "payload")
    if len(body) // width > MAX_FILE_SAMPLES:
        raise too_long(len(body) // width)
    return body, width


def _idled_out(res: Any) -> bool:
    return (isinstance(res, InvalidArgument) and res.field == KEY_SEQUENCE_ID
            and "max_sequence_idle_us" in res.message)


class SegmentStream:
    """One audio stream run as one sequence of a segment task.

    :meth:`feed` takes samples in the stream's wire format (any number of bytes) and returns
    the events they settle; :meth:`close` ends the sequence (the zero-padded rest, or a silent
    end-only chunk) and returns the last events; :meth:`abort` ends it, ignoring the result.
    Events are dicts: ``{"event": "start"|"end", "ms"}`` and, when asked,
    ``{"event": "prob", "ms", "p"}`` per chunk.
    """

    def __init__(self, runtime: RuntimeQueries, task: str, options: SegmentOptions, width: int = 2,
                 probabilities: bool = False, prefix: str = "lumen-audio"):
        self.rt = runtime
        self.task = task
        self.width = width
        self.mime = L16_MIME if width == 2 else F32_MIME
        self.chunk_bytes = CHUNK_SAMPLES * width
        self.sid = f"{prefix}-{uuid.uuid4().hex}"
        self.segmenter = Segmenter(options)
        self.want_probs = probabilities
        self.probs: list = []
        self.pending = bytearray()
        self.samples = 0
        self.nbytes = 0
        self.started = False
        self.closed = False
        #: times the sequence was begun again after idling out (a paused live stream)
        self.restarts = 0

    @property
    def duration_ms(self) -> float:
        return samples_to_ms(self.samples)

    def _request(self, payload: Any, end: bool) -> InferRequest:
        meta = {KEY_SEQUENCE_ID: self.sid}
        if not self.started:
            meta[KEY_SEQUENCE_START] = "true"
            self.started = True
        if end:
            meta[KEY_SEQUENCE_END] = "true"
        return InferRequest(self.task, payload, self.mime, meta)

    def _events(self, raw: list) -> list:
        return [{"event": kind, "ms": samples_to_ms(s)} for kind, s in raw]

    async def _run(self, payloads: list, end: bool, count: int) -> list:
        """Run chunk payloads in order (the last one ends the sequence when ``end``); the
        first ``count`` of them are audio whose probabilities feed the segmenter."""
        events: list = []
        for lo in range(0, len(payloads), WINDOW_CHUNKS):
            group = payloads[lo:lo + WINDOW_CHUNKS]
            last = lo + len(group) >= len(payloads)
            flags = [end and last and i == len(group) - 1 for i in range(len(group))]
            results = await self.rt.infer_many(
                [self._request(p, f) for p, f in zip(group, flags, strict=True)])
            if results and _idled_out(results[0]):
                # a live stream paused past the task's max_sequence_idle_us: its slot was
                # released, so it begins again (fresh model state; the segmenter goes on)
                self.started = False
                self.restarts += 1
                results = await self.rt.infer_many(
                    [self._request(p, f) for p, f in zip(group, flags, strict=True)])
            for i, res in enumerate(results):
                if isinstance(res, LumenError):
                    raise res
                if lo + i >= count:
                    continue
                p = float(np.asarray(res.outputs[OUTPUT]).reshape(-1)[0])
                if self.want_probs:
                    self.probs.append(p)
                    events.append({"event": "prob",
                                   "ms": samples_to_ms((self.segmenter.n) * CHUNK_SAMPLES),
                                   "p": p})
                events += self._events(self.segmenter.push(p))
        return events

    async def feed(self, data: Any) -> list:
        if self.closed:
            raise InvalidArgument("the stream is closed", "payload")
        mv = memoryview(data).cast("B")
        if not mv.nbytes:
            return []
        total = len(self.pending) + mv.nbytes
        self.nbytes += mv.nbytes
        self.samples = self.nbytes // self.width
        n_full = total // self.chunk_bytes
        if n_full == 0:
            self.pending += mv
            return []
        buf = bytes(self.pending) + mv.tobytes() if self.pending else mv
        cb = self.chunk_bytes
        payloads = [buf[i * cb:(i + 1) * cb] for i in range(n_full)]
        self.pending = bytearray(buf[n_full * cb:])
        return await self._run(payloads, False, n_full)

    async def close(self) -> list:
        """End of stream: run the rest, end the sequence, settle every segment."""
        if self.closed:
            return []
        self.closed = True
        events: list = []
        rest = len(self.pending) - len(self.pending) % self.width
        if rest:
            chunk = bytes(self.pending[:rest]) + bytes(self.chunk_bytes - rest)
            events += await self._run([chunk], True, 1)
        elif self.started:
            await self._run([bytes(self.chunk_bytes)], True, 0)
        events += self._events(self.segmenter.finish(self.samples))
        return events

    async def abort(self) -> None:
        """End the sequence now (frees its slot); errors are ignored."""
        if self.closed:
            return
        self.closed = True
        if self.started:
            try:
                await self._run([bytes(self.chunk_bytes)], True, 0)
            except LumenError:
                pass

    def result(self) -> dict:
        out = {"segments": segments_json(self.segmenter.segments),
               "duration_ms": self.duration_ms}
        if self.want_probs:
            out["probabilities"] = self.probs
        return out


def check_keys(meta: dict) -> None:
    """A whole file or a live stream takes only the ``lumen.vad.*`` keys (the server names
    and runs its sequence); any other ``lumen.*`` key, or a misspelt one, is refused."""
    for k in sorted(meta):
        if k.startswith(RESERVED_PREFIX) and k not in VAD_KEYS:
            raise InvalidArgument(f"{k} is not taken by an audio stream or file (it runs as a "
                                  f"sequence the server names); the keys it takes are "
                                  f"{', '.join(sorted(VAD_KEYS))}", k)


async def run_file(runtime: RuntimeQueries, task: str, body: bytes, mime: str, meta: dict) -> dict:
    """A whole file as one sequence: ``{"segments", "duration_ms"[, "probabilities"]}``."""
    desc = segment_task(runtime, task)
    options = segment_options(meta, task_options(desc or {}))
    check_keys(meta)
    data, width = decode_file(body, mime)
    stream = SegmentStream(runtime, task, options, width, flag(meta.get(PROBS_PARAM, "")),
                           prefix="lumen-file")
    try:
        await stream.feed(data)
        await stream.close()
    except BaseException:
        await stream.abort()
        raise
    return stream.result()


# --------------------------------------------------------------------------- HTTP whole files
def wants_file(runtime: RuntimeQueries, task: str, mime: str, query: Any) -> bool:
    """``POST /v1/infer/{task}`` is a whole file: audio for a segment task, no sequence id
    (a request naming ``lumen.sequence.id`` is one chunk of the caller's own stream)."""
    return (KEY_SEQUENCE_ID not in query and is_audio_mime(mime)
            and segment_task(runtime, task) is not None)


async def file_reply(app: HttpApp, request: Any, task: str) -> Any:
    """The whole-file route of the HTTP app ``app``: ``{"segments", "duration_ms"}``."""
    from starlette.responses import Response

    from . import codec

    mime = request.headers.get("content-type", "")
    limit, setting = file_limit(mime, app.max_body)
    body = await read_body(request, limit, "payload", "the audio file", setting)
    meta = dict(request.query_params)
    result = await app.until_done_or_gone(request, run_file(app.runtime, task, body, mime, meta))
    return Response(codec.dumps(result), media_type="application/json")


# --------------------------------------------------------------------------- client sequences
class _Track:
    __slots__ = ("segmenter", "admitted", "next", "done", "end_at")

    def __init__(self, segmenter: Segmenter):
        self.segmenter = segmenter
        self.admitted = 0  # chunk requests admitted
        self.next = 0  # the next chunk whose probability feeds the segmenter
        self.done: dict = {}  # chunk index -> probability (None: the chunk failed)
        self.end_at: Optional[int] = None


class SequenceEvents:
    """Segment events for chunk requests of *client-named* sequences (gRPC ``InferStream``).

    A sequence opts in with ``lumen.vad.events=true`` (and any ``lumen.vad.*`` options) on its
    start request.  :meth:`admit` is called for each request in arrival order, before it runs;
    :meth:`settle` with its answer, in any order: probabilities feed the sequence's segmenter
    in chunk order, and the events they settle are returned (JSON text) for the reply at hand.
    The end request finishes the segmenter (every chunk counts 512 samples).  State is per
    call: a stream that goes away takes its trackers with it.
    """

    MAX_TRACKED = 4096

    def __init__(self, runtime: RuntimeQueries):
        self.runtime = runtime
        self.tracks: dict = {}

    def admit(self, task: str, meta: Any) -> Optional[tuple]:
        sid = meta.get(KEY_SEQUENCE_ID) if meta else None
        if not sid:
            return None
        if meta.get(KEY_SEQUENCE_START) == "true":
            self.tracks.pop(sid, None)
            if meta.get(KEY_VAD_EVENTS) != "true" or len(self.tracks) >= self.MAX_TRACKED:
                return None
            desc = segment_task(self.runtime, task)
            if desc is None:
                return None
            try:
                options = segment_options(meta, task_options(desc))
            except LumenError:
                return None  # the runtime refuses the request with the same error
            self.tracks[sid] = _Track(Segmenter(options))
        track = self.tracks.get(sid)
        if track is None:
            return None
        idx = track.admitted
        track.admitted += 1
        if meta.get(KEY_SEQUENCE_END) == "true":
            track.end_at = idx
            del self.tracks[sid]  # a later start begins a new tracker
        return track, idx

    def settle(self, ticket: tuple, resp: Any) -> str:
        """The events (JSON text, "" when none) settled once chunk ``ticket`` is answered
        (``resp`` None: it failed, and the sequence's state did not advance)."""
        track, idx = ticket
        p = None
        if resp is not None:
            try:
                p = float(np.asarray(resp.outputs[OUTPUT]).reshape(-1)[0])
            except (KeyError, IndexError, TypeError, ValueError):
                p = None
        track.done[idx] = p
        raw: list = []
        seg = track.segmenter
        while track.next in track.done:
            prob = track.done.pop(track.next)
            if prob is not None and not seg.finished:
                raw += seg.push(prob)
            if track.next == track.end_at:
                raw += seg.finish()
            track.next += 1
        if not raw:
            return ""
        return codec_dumps([{"event": kind, "ms": samples_to_ms(s)} for kind, s in raw])


def codec_dumps(obj: Any) -> str:
    from . import codec

    out = codec.dumps(obj)
    return out.decode() if isinstance(out, bytes) else out
