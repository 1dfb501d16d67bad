"""Under the engine, on the tiny checkpoint: batched GPT loop, streaming decode, loader."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from agent.chattts import loader
from agent.chattts.decode import SAMPLES_PER_TOKEN, StreamingDecoder, StreamParams, chat_decode_fn
from agent.chattts.gpt import BatchedGPT, Sampling
from agent.chattts.loader import LoadedModel, ModelLoadError, load_chat, resolve_device
from agent.config import ChatTTSSettings

# Session fixtures (tiny checkpoint, loaded Chat, started engine), shared by both modules.
pytest_plugins = ["tests.conftest_chattts"]
REPO = Path(__file__).resolve().parents[1]


def generate(chat: object, text: str, n: int, seed: int = 1) -> list[torch.Tensor]:
    gpt = BatchedGPT(chat)
    row = gpt.make_row(
        text, prompt="[speed_5]", spk_emb=None, sampling=Sampling(max_new_tokens=n), seed=seed
    )
    gpt.add(row)
    while gpt.rows:
        gpt.step()
    return row.hiddens


def test_batched_loop_matches_chattts_generate(tiny_chat: LoadedModel) -> None:
    """Teacher-forced on ChatTTS's own tokens, our loop reproduces ChatTTS's hidden states, even
    while another row joins, is parked and resumes in the same batch."""
    import ChatTTS

    chat = tiny_chat.chat
    text = chat.normalizer("hello world how are you", True, True, None)
    params = ChatTTS.Chat.InferCodeParams(manual_seed=1, max_new_token=40, show_tqdm=False)
    ref = next(chat._infer_code([text], False, chat.device, True, params))
    ref_ids, ref_hidden = list(ref.ids[0]), ref.hiddens[0]

    gpt = BatchedGPT(chat)
    row = gpt.make_row(
        text, prompt="[speed_5]", spk_emb=None, sampling=Sampling(max_new_tokens=40), seed=0
    )
    forced = iter(ref_ids)
    real_sample = gpt._sample
    gpt._sample = lambda r, logits: next(forced) if r is row else real_sample(r, logits)  # type: ignore[method-assign]
    other = gpt.make_row(
        "another sentence",
        prompt="[speed_5]",
        spk_emb=None,
        sampling=Sampling(max_new_tokens=40),
        seed=2,
    )
    gpt.add(row)
    for step in range(len(ref_ids) - 1):
        if step == 3:
            gpt.add(other)
        if step == 9 and other in gpt.rows:
            gpt.park(other)
        if step == 15 and other.parked_kv is not None:
            gpt.add(other)
        gpt.step()
    ours = torch.stack(row.hiddens[: len(ref_ids)])
    assert ours.shape == ref_hidden.shape
    assert torch.allclose(ours, ref_hidden, atol=1e-4)


def snr_db(x: np.ndarray, ref: np.ndarray) -> float:
    n = min(len(x), len(ref))
    err = np.sum((x[:n] - ref[:n]) ** 2)
    return float(10 * np.log10(np.sum(ref[:n] ** 2) / max(err, 1e-20)))


def test_streamed_audio_matches_full_decode_over_seams(tiny_chat: LoadedModel) -> None:
    chat = tiny_chat.chat
    hiddens = generate(
        chat, "a sentence long enough to produce a good number of seams in the audio", 400
    )
    assert len(hiddens) > 120
    decode = chat_decode_fn(chat)
    full = decode(torch.stack(hiddens))
    dec = StreamingDecoder(decode, StreamParams())
    parts, seams = [], []
    first_at = None
    for n in range(1, len(hiddens) + 1):
        if dec.due(n):
            parts.append(dec.push(hiddens[:n], final=False))
            seams.append(dec.emitted_samples)
            first_at = first_at or n
    parts.append(dec.push(hiddens, final=True))
    streamed = np.concatenate(parts)
    assert first_at == 24 and len(parts[0]) > 0
    assert len(streamed) == len(full)
    around = [slice(max(0, s - 1024), s + 1024) for s in seams]
    seam_snr = snr_db(
        np.concatenate([streamed[w] for w in around]), np.concatenate([full[w] for w in around])
    )
    assert seam_snr >= 30.0, seam_snr
    assert snr_db(streamed, full) >= 30.0
    # Linear work: every token once, plus left context and lookahead per chunk.
    assert dec.decoded_tokens <= 1.6 * len(hiddens)


def test_decoder_slices_only_settled_audio() -> None:
    """With a decoder whose output depends on the right context, no emitted sample changes."""

    def decode(h: torch.Tensor) -> np.ndarray:
        v = h[:, 0].numpy().astype(np.float32)
        nxt = np.concatenate([v[1:], np.zeros(1, np.float32)])  # one token of look-ahead
        return np.repeat(v + nxt, SAMPLES_PER_TOKEN)[: len(v) * SAMPLES_PER_TOKEN - 256]

    hiddens = [torch.full((2,), float(i)) for i in range(100)]
    dec = StreamingDecoder(decode, StreamParams(lookahead=2, crossfade=512))
    out = [dec.push(hiddens[:n], False) for n in range(1, 101) if dec.due(n)]
    out.append(dec.push(hiddens, True))
    np.testing.assert_allclose(np.concatenate(out), decode(torch.stack(hiddens)), atol=1e-5)


def test_threads_0_on_a_cpu_leaves_one_of_the_cores_this_process_may_run_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--threads 0 ("all cores but one") sized torch by os.cpu_count(): 63 threads in a
    container pinned to 3 CPUs of a 64-core host. It counts the CPU affinity now, as
    --workers 0 does."""
    import ChatTTS

    class Stop(Exception):
        pass

    def stop(*args: object) -> None:
        raise Stop  # the thread count is set before ChatTTS is built: no need to go on

    threads: list[int] = []
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setattr(ChatTTS, "Chat", stop)
    with pytest.raises(Stop):
        load_chat(ChatTTSSettings(device="cpu", threads=0))
    assert threads == [2]


def test_loader_rejects_missing_and_tampered_models(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert resolve_device("auto").type in {"cpu", "cuda"}
    with pytest.raises(ModelLoadError):
        load_chat(ChatTTSSettings(model_dir=tmp_path / "absent", device="cpu"))
    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_dir, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["sha256"]["sha256_asset_Vocos_safetensors"] = "0" * 64
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelLoadError, match=r"asset/Vocos\.safetensors is not the file"):
        load_chat(ChatTTSSettings(model_dir=bad, device="cpu"))
    # Without our manifest a directory is taken for a copy of the published model and checked
    # against ChatTTS's own hash table, which random weights fail.
    (bad / "manifest.json").unlink()
    with pytest.raises(ModelLoadError):
        load_chat(ChatTTSSettings(model_dir=bad, device="cpu"))


def test_loader_says_what_is_wrong_with_a_bad_model_dir(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A --model-dir that was a file was taken for a Hugging Face cache and reported as a
    network problem; a manifest.json that was not JSON, or lacked "dims", escaped as a raw
    JSONDecodeError / KeyError. Each is now a ModelLoadError saying what is wrong."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    with pytest.raises(ModelLoadError, match="is not a directory"):
        load_chat(ChatTTSSettings(model_dir=a_file, device="cpu"))
    not_json = tmp_path / "not-json"
    shutil.copytree(tiny_model_dir, not_json)
    (not_json / "manifest.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"manifest\.json is not valid JSON"):
        load_chat(ChatTTSSettings(model_dir=not_json, device="cpu"))
    no_dims = tmp_path / "no-dims"
    shutil.copytree(tiny_model_dir, no_dims)
    manifest = json.loads((no_dims / "manifest.json").read_text())
    del manifest["dims"]
    (no_dims / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelLoadError, match=r"manifest\.json is incomplete.*'dims'"):
        load_chat(ChatTTSSettings(model_dir=no_dims, device="cpu"))


def test_tiny_model_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from agent.chattts.tiny import main, read_manifest

    assert main([str(tmp_path / "m"), "--seed", "3"]) == 0
    manifest = read_manifest(tmp_path / "m")
    assert manifest is not None and manifest["seed"] == 3
    assert "random-weight" in capsys.readouterr().out


def test_a_slow_model_load_does_not_hold_up_shutdown() -> None:
    """Ctrl-C during the first download must not wait for the download to finish."""
    import asyncio
    import time

    from agent.chattts.engine import _in_daemon_thread
    from agent.config import ChatTTSSettings

    def slow_load(settings: ChatTTSSettings) -> Any:
        time.sleep(5)

    async def main() -> None:
        task = asyncio.ensure_future(_in_daemon_thread(slow_load, ChatTTSSettings()))
        await asyncio.sleep(0.1)
        task.cancel()

    started = time.monotonic()
    asyncio.run(main())  # asyncio.to_thread would make this wait ~5 s in executor shutdown
    assert time.monotonic() - started < 1.5


def test_a_damaged_manifest_or_a_model_of_other_shapes_is_a_model_load_error(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A manifest.json that was JSON but not an object escaped as AttributeError ("'list'
    object has no attribute 'get'"); dimensions that do not fit the files (edited, or a
    tensor of another shape) as a RuntimeError from torch's load_state_dict, naming neither
    the model nor what to do. Both are ModelLoadErrors now (503 engine_failed with that
    message)."""
    a_list = tmp_path / "a-list"
    shutil.copytree(tiny_model_dir, a_list)
    (a_list / "manifest.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match=r"manifest\.json is incomplete or damaged"):
        load_chat(ChatTTSSettings(model_dir=a_list, device="cpu"))
    resized = tmp_path / "resized"
    shutil.copytree(tiny_model_dir, resized)
    manifest = json.loads((resized / "manifest.json").read_text())
    manifest["dims"]["gpt_hidden"] *= 2
    (resized / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        ModelLoadError, match=r"could not load the model from .*resized.*tiny-model"
    ):
        load_chat(ChatTTSSettings(model_dir=resized, device="cpu"))


def test_a_file_missing_from_a_model_dir_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The error (/readyz's engine_failed) said "see the log above"; ChatTTS named the file
    only in an INFO line, which --log-level warning hides."""
    partial = tmp_path / "partial"
    shutil.copytree(tiny_model_dir, partial)
    (partial / "asset" / "Vocos.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"asset/Vocos\.safetensors is missing"):
        load_chat(ChatTTSSettings(model_dir=partial, device="cpu", threads=1))


def test_a_device_torch_lacks_is_said_to_be_missing_not_blamed_on_the_model(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--device mps without MPS, or cuda:3 on a one-GPU machine, failed inside ChatTTS, with
    advice to rebuild or replace the model."""
    with pytest.raises(ModelLoadError, match="MPS is not available"):
        load_chat(ChatTTSSettings(model_dir=tiny_model_dir, device="mps", threads=1))
    with pytest.raises(ModelLoadError, match="not a torch device"):
        resolve_device("gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(ModelLoadError, match="1 CUDA device"):
        resolve_device("cuda:3")


def _interrupted_download(tiny_model_dir: Path, cache: Path) -> Path:
    """A Hugging Face cache whose first download was stopped after two files."""
    snapshot = cache / "models--2Noise--ChatTTS" / "snapshots" / "0123abcd"
    (snapshot / "asset" / "gpt").mkdir(parents=True)
    shutil.copy(tiny_model_dir / "asset" / "gpt" / "config.json", snapshot / "asset" / "gpt")
    shutil.copy(tiny_model_dir / "asset" / "Decoder.safetensors", snapshot / "asset")
    return snapshot


def test_an_interrupted_download_is_resumed(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ChatTTS loads the latest snapshot without checking it and never downloads again: a
    first start stopped mid-download failed every later start, telling the user to check
    that the model was "an unmodified copy". The download is now resumed first."""
    import huggingface_hub

    snapshot = _interrupted_download(tiny_model_dir, tmp_path)
    resumed: list[dict[str, Any]] = []

    def snapshot_download(**kwargs: Any) -> str:
        resumed.append(kwargs)
        for name in loader.ASSET_FILES:  # what the real one would fetch
            (snapshot / "asset" / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(tiny_model_dir / "asset" / name, snapshot / "asset" / name)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    loader.resume_interrupted_download(str(tmp_path))
    assert [r["cache_dir"] for r in resumed] == [str(tmp_path)]
    assert loader.missing_assets(snapshot) == []
    loader.resume_interrupted_download(str(tmp_path))  # complete: nothing to do
    assert len(resumed) == 1


def test_an_interrupted_download_that_cannot_resume_says_so(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    snapshot = _interrupted_download(tiny_model_dir, tmp_path)

    def offline(**kwargs: Any) -> str:
        raise OSError("network is unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelLoadError) as caught:
        load_chat(ChatTTSSettings(model_dir=tmp_path, device="cpu", threads=1))
    message = str(caught.value)
    assert "is incomplete" in message and "unmodified copy" not in message, message
    assert str(snapshot.parent.parent) in message  # what to delete to start afresh


def test_the_fronts_download_check_expands_a_tilde(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--model-dir=~/chattts (bash leaves a tilde after "=", as does an env file): the load
    expanded it, the front's one download did not, found no asset/ and downloaded 1.1 GB
    from Hugging Face into a directory literally named "~"."""
    import ChatTTS

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "chattts" / "asset").mkdir(parents=True)
    downloads: list[Any] = []
    monkeypatch.setattr(
        ChatTTS.Chat, "download_models", lambda self, **kwargs: downloads.append(kwargs)
    )
    loader.ensure_downloaded(ChatTTSSettings(model_dir=Path("~/chattts")))
    assert downloads == []


def test_compile_off_cuda_says_it_does_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """ChatTTS drops --compile unless the device is CUDA, without a word: a user timing
    --compile on CPU measured nothing and was not told."""
    import ChatTTS

    class Stop(Exception):
        pass

    def stop(*args: object) -> None:
        raise Stop

    monkeypatch.setattr(ChatTTS, "Chat", stop)
    with caplog.at_level(logging.WARNING, logger="agent.chattts.loader"), pytest.raises(Stop):
        load_chat(ChatTTSSettings(device="cpu", threads=1, compile=True))
    assert "--compile has no effect on cpu" in caplog.text


def test_a_download_resumed_onto_a_newer_revision_is_complete(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The repository moved on since the interrupted download: the resume fetches the new
    revision into a snapshot of its own (the one ChatTTS then loads), and the stale one
    stays as it was. The check looked at the stale one: "still incomplete"."""
    import huggingface_hub

    _interrupted_download(tiny_model_dir, tmp_path)
    asked: list[str] = []

    def snapshot_download(**kwargs: Any) -> str:
        asked.append(kwargs["cache_dir"])
        newer = Path(kwargs["cache_dir"]) / "models--2Noise--ChatTTS" / "snapshots" / "newer"
        shutil.copytree(tiny_model_dir / "asset", newer / "asset")
        return str(newer)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    loader.resume_interrupted_download(str(tmp_path))
    assert asked == [str(tmp_path)]


def test_a_model_dir_one_level_too_deep_is_named_not_blamed_on_the_network(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--model-dir ~/ChatTTS/asset`` (the folder that holds the .safetensors files, one level
    too deep): a local copy, as README says --model-dir is. Offline, the error on /readyz is
    "could not download or load ChatTTS from Hugging Face: check the network, or pass
    --model-dir DIR with a local copy": it never names the directory the user gave, nor that
    it lacks asset/, and tells them to pass the flag they passed (found by review)."""
    import ChatTTS.core

    copy = tmp_path / "ChatTTS"
    shutil.copytree(tiny_model_dir, copy)
    deep = copy / "asset"

    def offline(**kwargs: Any) -> str:
        raise OSError("network is unreachable")

    monkeypatch.setattr(ChatTTS.core, "snapshot_download", offline)
    with pytest.raises(ModelLoadError) as caught:
        load_chat(ChatTTSSettings(model_dir=deep, device="cpu", threads=1))
    message = str(caught.value)
    assert str(deep) in message, message
    assert f"pass its parent, {copy}" in message, message


def test_the_fronts_download_refuses_a_model_dir_that_does_not_exist_as_the_load_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--model-dir /typo`` with one process: ModelLoadError "model directory /typo does not
    exist". The same flag with ``--workers 2``: the front's ensure_downloaded creates /typo and
    downloaded 1.1 GB from Hugging Face into it (the workers then loaded it happily), so the
    same command line meant two different things depending on --workers (found by review)."""
    import ChatTTS

    absent = tmp_path / "typo"
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_chat(ChatTTSSettings(model_dir=absent, device="cpu", threads=1))
    downloads: list[Any] = []
    monkeypatch.setattr(
        ChatTTS.Chat, "download_models", lambda self, **kwargs: downloads.append(kwargs) or "x"
    )
    with pytest.raises(ModelLoadError, match="does not exist"):
        loader.ensure_downloaded(ChatTTSSettings(model_dir=absent))
    assert downloads == []


def test_a_crafted_voice_string_does_not_corrupt_the_servers_memory() -> None:
    """A client's ``{"type": "config", "voice": "\\u3d7f"}`` passes the protocol check (any
    string up to 4096 characters) and reaches ``VoiceBank.check`` -> ``decode_speaker`` on the
    event loop, which hands it to pybase16384's C decoder. That decoder trusts the byte after
    a trailing '=' (U+3D00 + n) as the tail length and writes up to 127 bytes into a ~39-byte
    heap buffer: one message corrupted the heap of the process that holds every session, and
    the process died with SIGSEGV (found by review). It must be an ``unknown_voice`` refusal
    and nothing else."""
    script = textwrap.dedent(
        """
        import json
        from agent.protocol import parse_message
        from agent.chattts.voices import decode_speaker
        from agent.engine import UnknownVoice

        msg = parse_message(json.dumps({"type": "config", "voice": "\\u3d7f"}), 65536)
        try:
            decode_speaker(msg.fields["voice"], 768)  # what VoiceBank.check runs
        except UnknownVoice:
            pass
        junk = [bytes(100) for _ in range(100_000)]  # the server goes on allocating
        print("still alive")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "still alive" in proc.stdout


def _held_bytes(hiddens: list[torch.Tensor]) -> int:
    storages = {h.untyped_storage().data_ptr(): h.untyped_storage().nbytes() for h in hiddens}
    return sum(storages.values())


def test_a_rows_hidden_states_do_not_pin_the_whole_batchs_step_outputs(
    tiny_chat: LoadedModel,
) -> None:
    """Bug: each step's hidden state was kept as a view of the batch-wide (B, H) output, so a
    row that outlived its batch-mates kept B times its own decoder input alive (on the GPU,
    where the model runs) until it ended. add() cloned for this reason; step() did not."""
    gpt = BatchedGPT(tiny_chat.chat)

    def row(text: str, seed: int) -> Any:
        return gpt.make_row(
            text, prompt="[speed_5]", spk_emb=None, sampling=Sampling(max_new_tokens=400), seed=seed
        )

    long = row("a long sentence that keeps going for quite a while longer than the others", 1)
    gpt.add(long)
    short = [row("hi", 10 + k) for k in range(7)]  # a full batch of 8, as max_batch allows
    for r in short:
        gpt.add(r)
    for _ in range(30):
        gpt.step()
    assert all(r.finished for r in short) and long in gpt.rows  # the others have left
    for r in short:  # what the scheduler's _retire does with a finished row
        r.hiddens.clear()
    needed = sum(h.numel() * h.element_size() for h in long.hiddens)
    held = _held_bytes(long.hiddens)
    assert held <= 1.5 * needed, f"{held} bytes held for {needed} bytes of hidden states"


def test_the_check_without_the_model_refuses_what_the_voice_bank_refuses(
    tiny_chat: LoadedModel,
) -> None:
    """A media process speaking through Ray checks a client's voice without torch or the
    model (agent/chattts/speakers.py): it must refuse what the replica's VoiceBank refuses
    (but the float16 scaling's edge), and accept what it accepts."""
    import lzma

    import numpy as np
    import pybase16384 as b14

    from agent.chattts.speakers import check_voice_without_model
    from agent.chattts.voices import SPEAKER_FILTERS, VoiceBank
    from agent.engine import RequestError, VoiceOptions

    bank = VoiceBank(tiny_chat.chat, "seed:2", 2048)
    dim = bank.speaker_dim

    def speaker(values: np.ndarray) -> str:
        packed = lzma.compress(
            values.astype(np.float16).tobytes(), format=lzma.FORMAT_RAW, filters=SPEAKER_FILTERS
        )
        return str(b14.encode_to_string(packed))

    good = speaker(np.random.default_rng(1).standard_normal(dim))
    cases = [
        VoiceOptions(),
        VoiceOptions(voice="seed:9", speed=0, temperature=0.5, top_p=1.0, top_k=1),
        VoiceOptions(voice="none"),
        VoiceOptions(voice=good),
        VoiceOptions(voice="not-a-voice"),
        VoiceOptions(voice="seed:"),
        VoiceOptions(voice=speaker(np.ones(dim + 3))),
        VoiceOptions(voice=speaker(np.full(dim, np.inf))),
        VoiceOptions(voice=speaker(np.zeros(dim))),
        VoiceOptions(speed=10),
        VoiceOptions(temperature=0),
        VoiceOptions(top_p=1.5),
        VoiceOptions(top_k=0),
    ]
    for voice in cases:
        try:
            bank.check(voice)
        except RequestError:
            with pytest.raises(RequestError):
                check_voice_without_model(voice, "seed:2", dim)
        else:
            check_voice_without_model(voice, "seed:2", dim)
