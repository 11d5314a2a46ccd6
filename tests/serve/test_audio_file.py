"""Whole audio files on ``POST /v1/infer/{task}`` (serve/audio.py): speech segments equal to
silero-vad's own on committed espeak-ng speech (tests/fixtures/vad_speech_*, made by
tests/fixtures/make_vad_speech.py), formats, limits and options."""
from __future__ import annotations

import asyncio
import io
import json
import pathlib
import struct
import wave

import httpx
import numpy as np
import pytest
from serve_support import ServerThread

import lumen_core as lc
from lumen_core import models
from lumen_core.serve import audio

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"
REFERENCE = json.loads((FIXTURES / "vad_speech_reference.json").read_text())
#: one chunk: probabilities of a batched run may differ from the reference in the last bits
TOLERANCE_MS = 32.0
#: the server's max_payload_bytes: above every fixture, far below MAX_FILE_SECONDS of audio
MAX_PAYLOAD = 4 << 20


def vad_task(home) -> dict:
    path = str(models.model_dir(models.SILERO_VAD, home) / models.MODEL_FILE)
    return {"name": "vad", "backend": "vad", "model": path, "intra_op_threads": 1,
            "batching": {"max_batch_size": 64, "max_queue_size": 4096},
            "sequence": {"strategy": "direct"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("lumen_home")
    models.prepare(names=[models.SILERO_VAD], home=home)
    srv = ServerThread(lc.Runtime.from_dict({"server": {"max_payload_bytes": MAX_PAYLOAD},
                                             "tasks": [vad_task(home)]}), grpc=False)
    yield srv
    srv.stop()


def wav_bytes(pcm: np.ndarray, rate: int = 16000, channels: int = 1, width: int = 2) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def expected_ms(name: str) -> list:
    return [(s / 16, e / 16) for s, e in REFERENCE[name]["segments"]]


def assert_segments(got: list, want: list) -> None:
    assert len(got) == len(want), (got, want)
    for g, (s, e) in zip(got, want, strict=True):
        assert abs(g["start_ms"] - s) <= TOLERANCE_MS and abs(g["end_ms"] - e) <= TOLERANCE_MS


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_wav_segments_equal_silero(server, name):
    body = (FIXTURES / name).read_bytes()
    r = httpx.post(f"{server.url}/v1/infer/vad", content=body,
                   headers={"content-type": "audio/wav"}, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["duration_ms"] == REFERENCE[name]["samples"] / 16
    assert_segments(out["segments"], expected_ms(name))
    assert "probabilities" not in out


def test_l16_of_any_length_and_probabilities(server):
    name = "vad_speech_2.wav"
    with wave.open(str(FIXTURES / name)) as w:
        pcm = w.readframes(w.getnframes())
    r = httpx.post(f"{server.url}/v1/infer/vad?probabilities=true", content=pcm,
                   headers={"content-type": "audio/L16;rate=16000"}, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert_segments(out["segments"], expected_ms(name))
    assert len(out["probabilities"]) == -(-REFERENCE[name]["samples"] // 512)
    # short and empty bodies are whole files too
    for n in (0, 100, 1024):
        r = httpx.post(f"{server.url}/v1/infer/vad", content=bytes(n),
                       headers={"content-type": "audio/L16;rate=16000"})
        assert r.status_code == 200 and r.json() == {"segments": [], "duration_ms": n / 32}


def test_many_files_at_once_batch_together_and_agree(server):
    body = (FIXTURES / "vad_speech_1.wav").read_bytes()

    async def go():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*[
                c.post(f"{server.url}/v1/infer/vad", content=body,
                       headers={"content-type": "audio/wav"}) for _ in range(12)])

    for r in asyncio.run(go()):
        assert r.status_code == 200
        assert_segments(r.json()["segments"], expected_ms("vad_speech_1.wav"))
    assert server.runtime.load()["vad"]["active_sequences"] == 0


def test_request_options(server):
    body = (FIXTURES / "vad_speech_2.wav").read_bytes()
    url = f"{server.url}/v1/infer/vad"
    base = httpx.post(url, content=body, headers={"content-type": "audio/wav"}).json()
    merged = httpx.post(url, params={"lumen.vad.min_silence_duration_ms": "2000"}, content=body,
                        headers={"content-type": "audio/wav"}).json()
    assert len(merged["segments"]) < len(base["segments"])
    nopad = httpx.post(url, params={"lumen.vad.speech_pad_ms": "0"}, content=body,
                       headers={"content-type": "audio/wav"}).json()
    assert nopad["segments"][0]["start_ms"] == base["segments"][0]["start_ms"] + 30
    r = httpx.post(url, params={"lumen.vad.threshold": "2"}, content=body,
                   headers={"content-type": "audio/wav"})
    assert r.status_code == 400 and r.json()["error"]["field"] == "lumen.vad.threshold"
    r = httpx.post(url, params={"lumen.vad.treshold": "0.5"}, content=body,
                   headers={"content-type": "audio/wav"})
    assert r.status_code == 400


def _pcm(x: np.ndarray, width: int) -> np.ndarray:
    """float samples in [-1, 1] as the integer PCM of ``width`` bytes ``wave`` writes."""
    if width == 1:
        return np.clip(np.round(x * 128 + 128), 0, 255).astype(np.uint8)
    if width == 2:
        return np.clip(np.round(x * 32768), -32768, 32767).astype(np.int16)
    v = np.clip(np.round(x * 2.0 ** (8 * width - 1)), -2 ** (8 * width - 1),
                2 ** (8 * width - 1) - 1).astype(np.int64)
    if width == 4:
        return v.astype("<i4")
    return (v.astype("<i4").view(np.uint8).reshape(-1, 4)[:, :3]).copy()  # 24-bit


def _speech(name: str) -> np.ndarray:
    return np.frombuffer(_speech_pcm(name), np.int16).astype(np.float32) / 32768


@pytest.mark.parametrize("rate,channels,width", [(44100, 2, 2), (48000, 1, 2), (16000, 2, 2),
                                                 (22050, 4, 3), (32000, 1, 4)])
def test_other_wav_formats_give_the_same_segments(server, rate, channels, width):
    """Issue 38 row 12: a whole WAV file at another rate, channel count or width is resampled
    and downmixed (soxr), and its segments are the 16 kHz mono file's, within a chunk."""
    import soxr

    name = "vad_speech_1.wav"
    x = _speech(name)
    if rate != 16000:
        x = soxr.resample(x, 16000, rate, quality="VHQ")
    # the channels differ a little (each a slightly different gain, so their mean is x)
    gains = 1 + 0.1 * (np.arange(channels) - (channels - 1) / 2)
    frames = np.stack([x * g for g in gains], axis=1).reshape(-1)
    body = wav_bytes(_pcm(frames, width), rate, channels, width)
    r = httpx.post(f"{server.url}/v1/infer/vad", content=body,
                   headers={"content-type": "audio/wav"}, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert abs(out["duration_ms"] - REFERENCE[name]["samples"] / 16) <= TOLERANCE_MS
    assert_segments(out["segments"], expected_ms(name))


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_integer_pcm_of_every_width_decodes_to_the_same_floats(width):
    """8-bit unsigned, 16, 24 and 32-bit signed PCM: the same signal, to its quantization
    step (an 8-bit file's step is too coarse for the same segments: 1/128 of full scale)."""
    from lumen_core.serve import resample

    x = _speech("vad_speech_2.wav")
    data = _pcm(x, width).tobytes()
    got = resample.to_mono_16k(data, 1, width, 16000)
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_allclose(got, x, atol=1.0 / 2 ** (8 * width - 1) + 1e-7)
    # interleaved channels are averaged; 8 kHz files are taken (and upsampled) too
    two = resample.to_mono_16k(np.stack([_pcm(x, width), _pcm(x, width)], 1).tobytes(), 2,
                               width, 16000)
    np.testing.assert_array_equal(two, got)
    assert resample.to_mono_16k(data, 1, width, 8000).shape == (2 * x.size,)


def test_wav_formats_that_cannot_be_made_16k_mono_are_415(server):
    url = f"{server.url}/v1/infer/vad"
    for rate, channels, why in ((4000, 1, "4000 Hz"), (400000, 1, "400000 Hz"),
                                (16000, 40, "40 channels")):
        body = wav_bytes(np.zeros(160 * channels, np.int16), rate, channels)
        r = httpx.post(url, content=body, headers={"content-type": "audio/wav"})
        assert r.status_code == 415, r.text
        assert why in r.json()["error"]["message"]
    # float WAV (format tag 3): not integer PCM
    fmt = b"fmt " + struct.pack("<IHHIIHH", 16, 3, 1, 16000, 64000, 4, 32)
    body = _wav(fmt + b"data" + struct.pack("<I", 64) + bytes(64))
    r = httpx.post(url, content=body, headers={"content-type": "audio/wav"})
    assert r.status_code == 415 and "not PCM" in r.json()["error"]["message"]
    # a header's low rate cannot turn a short body into a long file: checked before any work
    with pytest.raises(lc.PayloadTooLarge, match="MAX_FILE_SECONDS"):
        audio.decode_file(wav_bytes(np.zeros(audio.MAX_FILE_SECONDS * 8000 + 8000, np.int16),
                                    8000), "audio/wav")
    # raw PCM (and every live stream) stays 16 kHz mono: nothing says where a chunk's
    # resampler filter would begin
    r = httpx.post(url, content=bytes(3200), headers={"content-type": "audio/L16;rate=44100"})
    assert r.status_code == 415
    assert "not resampled" in r.json()["error"]["message"]


def test_bad_and_too_long_files(server):
    url = f"{server.url}/v1/infer/vad"
    r = httpx.post(url, content=b"RIFF....junk", headers={"content-type": "audio/wav"})
    assert r.status_code == 400
    r = httpx.post(url, content=bytes(3), headers={"content-type": "audio/L16;rate=16000"})
    assert r.status_code == 400
    r = httpx.post(url, content=bytes(8), headers={"content-type": "audio/L16;rate=8000"})
    assert r.status_code == 415 and "audio/L16;rate=16000" in r.json()["error"]["message"]
    # audio longer than MAX_FILE_SECONDS: refused before anything runs (a body that long is
    # over max_payload_bytes here, so the decoder is asked directly)
    with pytest.raises(lc.PayloadTooLarge, match="MAX_FILE_SECONDS"):
        audio.decode_file(bytes(2 * audio.MAX_FILE_SAMPLES + 2), "audio/L16;rate=16000")
    with pytest.raises(lc.PayloadTooLarge, match="MAX_FILE_SECONDS"):
        audio.decode_file(wav_bytes(np.zeros(audio.MAX_FILE_SAMPLES + 1, np.int16)), "audio/wav")


def _wav(chunks: bytes) -> bytes:
    return b"RIFF" + struct.pack("<I", len(chunks) + 4) + b"WAVE" + chunks


FMT = b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, 16000, 32000, 2, 16)


def _speech_pcm(name: str = "vad_speech_2.wav") -> bytes:
    with wave.open(str(FIXTURES / name)) as w:
        return w.readframes(w.getnframes())


def test_whole_files_are_bounded_by_max_payload_bytes(server):
    url = f"{server.url}/v1/infer/vad"
    for mime, body in (("audio/L16;rate=16000", bytes(2 * MAX_PAYLOAD)),
                       ("audio/wav", wav_bytes(np.zeros(MAX_PAYLOAD, np.int16)))):
        r = httpx.post(url, content=body, headers={"content-type": mime}, timeout=30)
        assert r.status_code == 413, (mime, r.text)
        assert "max_payload_bytes" in r.json()["error"]["message"]

    def streamed():  # no Content-Length: counted as it arrives
        for _ in range(3):
            yield bytes(MAX_PAYLOAD // 2)

    r = httpx.post(url, content=streamed(), headers={"content-type": "audio/L16;rate=16000"},
                   timeout=30)
    assert r.status_code == 413 and "max_payload_bytes" in r.json()["error"]["message"]


def test_riff_chunks_past_the_end_of_the_file_are_400(server):
    url = f"{server.url}/v1/infer/vad"
    data = b"data" + struct.pack("<I", 3200) + bytes(3200)
    for body in (_wav(FMT + b"LIST" + struct.pack("<I", 0x7FFFFFFF) + bytes(10) + data),
                 _wav(b"fmt " + struct.pack("<I", 1 << 30) + bytes(16)),
                 _wav(b"fmt " + struct.pack("<I", 4) + bytes(4) + data),
                 _wav(data + FMT)):
        r = httpx.post(url, content=body, headers={"content-type": "audio/wav"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["field"] == "payload" and "WAV" in err["message"]


def test_wav_header_sizes_are_checked_against_the_body(server):
    """A data size past the end (0xFFFFFFFF, as streaming writers leave it, or a cut file)
    decodes the samples present; an empty data size with audio behind it is a 400."""
    url = f"{server.url}/v1/infer/vad"
    pcm = _speech_pcm()
    want = httpx.post(url, content=_wav(FMT + b"data" + struct.pack("<I", len(pcm)) + pcm),
                      headers={"content-type": "audio/wav"}, timeout=60).json()
    assert want["segments"]
    for size in (0xFFFFFFFF, len(pcm) + 32000):
        r = httpx.post(url, content=_wav(FMT + b"data" + struct.pack("<I", size) + pcm),
                       headers={"content-type": "audio/wav"}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json() == want
    r = httpx.post(url, content=_wav(FMT + b"data" + struct.pack("<I", 0) + pcm),
                   headers={"content-type": "audio/wav"}, timeout=60)
    assert r.status_code == 400 and "empty data chunk" in r.json()["error"]["message"]
    # a really empty data chunk, other chunks after it: no speech, rightly
    empty = _wav(FMT + b"data" + struct.pack("<I", 0) + b"LIST" + struct.pack("<I", 4) + b"INFO")
    r = httpx.post(url, content=empty, headers={"content-type": "audio/wav"})
    assert r.status_code == 200 and r.json() == {"segments": [], "duration_ms": 0.0}
    # WAVE_FORMAT_EXTENSIBLE with the PCM sub-format is PCM
    ext = b"fmt " + struct.pack("<IHHIIHHHHI", 40, 0xFFFE, 1, 16000, 32000, 2, 16, 22, 16, 4) \
        + struct.pack("<H", 1) + bytes(14)
    r = httpx.post(url, content=_wav(ext + b"data" + struct.pack("<I", len(pcm)) + pcm),
                   headers={"content-type": "audio/wav"}, timeout=60)
    assert r.status_code == 200 and r.json() == want


def test_a_chunk_with_a_sequence_id_is_still_one_chunk(server):
    r = httpx.post(f"{server.url}/v1/infer/vad",
                   params={"lumen.sequence.id": "s1", "lumen.sequence.start": "true",
                           "lumen.sequence.end": "true", "lumen.vad.threshold": "0.4"},
                   content=bytes(1024), headers={"content-type": "audio/L16;rate=16000"})
    assert r.status_code == 200 and "speech_prob" in r.json()["outputs"]
    r = httpx.post(f"{server.url}/v1/infer/vad",
                   params={"lumen.sequence.id": "s2", "lumen.sequence.start": "true",
                           "lumen.vad.threshold": "x"},
                   content=bytes(1024), headers={"content-type": "audio/L16;rate=16000"})
    assert r.status_code == 400 and r.json()["error"]["field"] == "lumen.vad.threshold"
