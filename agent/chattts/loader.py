"""Loading ChatTTS: the published model from Hugging Face, a local copy, or a random checkpoint.

Blocking (disk, maybe network, seconds to minutes): call it from a worker thread, never from
the event loop. The engine calls it once and shares the result between all sessions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agent.chattts.tiny import MANIFEST_NAME, apply_dims, dims_from_manifest, read_manifest
from agent.config import ChatTTSSettings
from agent.engine import EngineLoadError
from agent.threads import cores

log = logging.getLogger(__name__)


class ModelLoadError(EngineLoadError):
    """ChatTTS could not load (missing files, hash mismatch, download failed)."""


@dataclass
class LoadedModel:
    chat: Any  # ChatTTS.Chat
    device: torch.device
    source: str  # "huggingface" | "custom"
    random_weights: bool  # a checkpoint built by agent.chattts.tiny (speaks noise)
    manifest: dict[str, Any] | None


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present; anything else is passed to torch as is."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:  # "Expected one of cpu, cuda, ... device type at start of ..."
        raise ModelLoadError(f"device {name!r} is not a torch device: {e}") from None
    # Checked here: loaded on a device torch lacks, ChatTTS fails deep inside, and the
    # error would be blamed on the model.
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {name!r} requested but CUDA is not available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ModelLoadError(
                f"device {name!r} requested but this machine has "
                f"{torch.cuda.device_count()} CUDA device(s)"
            )
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError(f"device {name!r} requested but MPS is not available")
    return dev


def ensure_downloaded(settings: ChatTTSSettings) -> None:
    """Download ChatTTS from Hugging Face now, if it will be downloaded at all.

    For ``serve --workers N``: N processes loading at once would each start the download,
    and ChatTTS picks "the latest snapshot directory" of the cache, which may be another
    worker's half-written one. The front process fetches it once, first; the workers then
    load the finished snapshot. A local copy (``model_dir`` with ``asset/``) needs nothing.
    """
    model_dir = Path(settings.model_dir).expanduser() if settings.model_dir else None
    if model_dir is not None and (model_dir / "asset").is_dir():
        return
    if model_dir is not None:
        # As load_chat refuses it: the front created a mistyped directory and downloaded
        # 1.1 GB into it, where one process said it does not exist (found by review).
        if not model_dir.exists():
            raise ModelLoadError(f"model directory {model_dir} does not exist")
        _not_a_file(model_dir)
    import ChatTTS

    custom = str(model_dir) if model_dir is not None else None
    resume_interrupted_download(custom)
    log.info("fetching ChatTTS from Hugging Face (2Noise/ChatTTS) once for all workers")
    chat = ChatTTS.Chat(logging.getLogger("agent.chattts.ChatTTS"))
    if chat.download_models(source="huggingface", custom_path=custom) is None:
        raise ModelLoadError(_download_failed(model_dir))


def _download_failed(model_dir: Path | None) -> str:
    """What to do when the download failed: for a ``--model-dir`` with no copy in it, that
    directory named, and its parent when it is a copy's ``asset/`` folder itself (the
    common mistake: a message telling to pass the flag already passed named neither)."""
    what = "could not download ChatTTS from Hugging Face (2Noise/ChatTTS)"
    if model_dir is None:
        return (
            f"{what}: check the network, or pass --model-dir DIR with a local copy of the "
            "model (`voice-agent tiny-model DIR` builds an offline smoke-test model)"
        )
    copy_inside = (model_dir / "gpt").is_dir() or any(model_dir.glob("*.safetensors"))
    hint = (
        f"; it looks like a copy's asset/ folder itself: pass its parent, {model_dir.parent}"
        if copy_inside
        else ""
    )
    return (
        f"{what} into --model-dir {model_dir}, which holds no local copy (a copy has an "
        f"asset/ folder){hint}: check the network, or pass the directory of a local copy"
    )


def load_chat(settings: ChatTTSSettings) -> LoadedModel:
    """Load ChatTTS as ``settings`` says. Raises ``ModelLoadError`` when ChatTTS reports failure.

    - ``model_dir`` None: ChatTTS's own Hugging Face download (``2Noise/ChatTTS``, ~1.1 GB,
      progress bars from huggingface_hub) into the usual HF cache, or the cached snapshot.
    - ``model_dir`` with ``asset/``: a local copy in the published layout, hash-checked by
      ChatTTS against its own table; or a random checkpoint built by ``build_tiny_model``,
      whose manifest supplies the dimensions and hashes.
    - ``model_dir`` without ``asset/``: used as the Hugging Face cache directory (download
      into it on first use, reuse afterwards).
    """
    import ChatTTS

    device = resolve_device(settings.device)
    if settings.compile and device.type != "cuda":
        # ChatTTS compiles its GPT on CUDA only (core.py: compile and "cuda" in device):
        # elsewhere the flag changes nothing, and a user timing it should know.
        log.warning("--compile has no effect on %s: ChatTTS compiles on CUDA only", device)
    if settings.threads > 0:
        torch.set_num_threads(settings.threads)
    elif device.type == "cpu":
        # Leave a core to the event loop that paces the audio: inference on every core
        # would delay packets for every session in the process.
        torch.set_num_threads(max(1, cores() - 1))
    chat = ChatTTS.Chat(logging.getLogger("agent.chattts.ChatTTS"))
    manifest = None
    if settings.model_dir is None:
        source, custom_path = "huggingface", None
        log.info("loading ChatTTS from Hugging Face (2Noise/ChatTTS); first run downloads ~1.1 GB")
    else:
        model_dir = Path(settings.model_dir).expanduser()
        if not model_dir.exists():
            raise ModelLoadError(f"model directory {model_dir} does not exist")
        _not_a_file(model_dir)
        manifest = _apply_manifest(chat, model_dir)
        if manifest is not None:
            log.warning(
                "loading a RANDOM-WEIGHT ChatTTS checkpoint (%s, size=%s): it speaks noise",
                model_dir,
                manifest.get("size"),
            )
        if (model_dir / "asset").is_dir():
            source, custom_path = "custom", str(model_dir)
        else:
            source, custom_path = "huggingface", str(model_dir)
    if source == "huggingface":
        resume_interrupted_download(custom_path)
    try:
        ok = chat.load(
            source=source,
            custom_path=custom_path,
            device=device,
            compile=settings.compile,
        )
    except Exception as e:
        # Files that pass the hash check but do not fit the model ChatTTS builds (a manifest
        # whose dimensions were edited, a tensor of another shape) raise from deep inside
        # torch ("Error(s) in loading state_dict for Embed"): say which model and what to do.
        where = custom_path or "Hugging Face (2Noise/ChatTTS)"
        hint = (
            "rebuild it with `voice-agent tiny-model DIR`"
            if manifest is not None
            else "check that it is an unmodified copy of ChatTTS 0.2.5's model"
        )
        # torch lists every mismatched tensor, a line each: the start, on one line, says
        # what kind of fault it is.
        why = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        raise ModelLoadError(
            f"ChatTTS could not load the model from {where} ({why}): {hint}"
        ) from e
    if not ok:
        if source == "huggingface":
            raise ModelLoadError(_download_failed(Path(custom_path) if custom_path else None))
        problems = asset_problems(Path(custom_path or "."), chat.sha256_map)
        raise ModelLoadError(
            f"ChatTTS failed to load from {custom_path}: "
            + ("; ".join(problems) if problems else "see the log above")
        )
    log.info("ChatTTS loaded on %s (source=%s)", device, source)
    return LoadedModel(
        chat=chat,
        device=device,
        source=source,
        random_weights=manifest is not None,
        manifest=manifest,
    )


# ChatTTS 0.2.5's files under asset/ (ChatTTS/utils/dl.py check_all_assets): what a local
# copy and a finished download hold.
ASSET_FILES = (
    "Decoder.safetensors",
    "DVAE.safetensors",
    "Embed.safetensors",
    "Vocos.safetensors",
    "gpt/config.json",
    "gpt/model.safetensors",
    "tokenizer/special_tokens_map.json",
    "tokenizer/tokenizer_config.json",
    "tokenizer/tokenizer.json",
)
HF_REPO = "2Noise/ChatTTS"
HF_PATTERNS = ["*.yaml", "*.json", "*.safetensors"]  # what ChatTTS downloads of it


def missing_assets(base: Path) -> list[str]:
    return [name for name in ASSET_FILES if not (base / "asset" / name).is_file()]


def asset_problems(base: Path, sha256_map: dict[str, str]) -> list[str]:
    """Why ChatTTS refused the copy in ``base``, file by file: ChatTTS names a missing or
    altered file only in an INFO line of its own, which --log-level warning hides."""
    import hashlib

    problems = [f"asset/{name} is missing" for name in missing_assets(base)]
    if problems:
        return problems
    for name in ASSET_FILES:
        expected = sha256_map.get("sha256_asset_" + name.replace("/", "_").replace(".", "_"))
        with open(base / "asset" / name, "rb") as f:
            if expected is not None and hashlib.file_digest(f, "sha256").hexdigest() != expected:
                problems.append(f"asset/{name} is not the file ChatTTS expects (its hash differs)")
    return problems


def _latest_snapshot(custom_path: str | None) -> Path | None:
    """The snapshot ChatTTS would load from a Hugging Face cache: the latest modified one
    (its own rule, ChatTTS core.py download_models)."""
    import os

    if custom_path is None:
        root = Path(os.getenv("HF_HOME", os.path.expanduser("~/.cache/huggingface"))) / "hub"
    else:
        root = Path(custom_path)
    snapshots = root / "models--2Noise--ChatTTS" / "snapshots"
    try:
        return max(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, default=None)
    except OSError:
        return None


def resume_interrupted_download(custom_path: str | None) -> None:
    """Finish a Hugging Face download stopped part-way (Ctrl-C during the first start).
    ChatTTS loads the latest snapshot directory it finds without checking it and never
    downloads again: every later start failed, blamed on the model."""
    snapshot = _latest_snapshot(custom_path)
    if snapshot is None or not (missing := missing_assets(snapshot)):
        return
    log.warning(
        "the ChatTTS download in %s is incomplete (%d of %d files missing): resuming it",
        snapshot,
        len(missing),
        len(ASSET_FILES),
    )
    from huggingface_hub import snapshot_download

    try:
        # Into the cache ChatTTS reads (HF_HOME/hub, which HF_HUB_CACHE may not be); the
        # snapshot it returns is the one ChatTTS loads next (the repository may have moved
        # on since: a new snapshot beside the stale one).
        done = Path(
            snapshot_download(
                repo_id=HF_REPO, allow_patterns=HF_PATTERNS, cache_dir=str(snapshot.parents[2])
            )
        )
    except Exception as e:  # offline, refused, disk full: say what to do
        raise ModelLoadError(
            f"the ChatTTS download in {snapshot} is incomplete (missing "
            f"{', '.join('asset/' + m for m in missing[:3])}"
            f"{'...' if len(missing) > 3 else ''}) and could not be resumed "
            f"({type(e).__name__}: {str(e)[:200]}): check the network and start again, or "
            f"delete {snapshot.parent.parent} to download afresh"
        ) from e
    still = missing_assets(done)
    if still:
        raise ModelLoadError(
            f"the ChatTTS download in {done} is still incomplete after resuming it "
            f"(missing asset/{still[0]}): delete {done.parent.parent} to download afresh"
        )


def _not_a_file(model_dir: Path) -> None:
    # Otherwise a file would be taken for a Hugging Face cache directory, and the download
    # into it reported as a network problem.
    if model_dir.exists() and not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} is not a directory")


def _apply_manifest(chat: Any, model_dir: Path) -> dict[str, Any] | None:
    """If ``model_dir`` is a random checkpoint built here, point ``chat`` at its dimensions
    and hashes and return its manifest; None for any other directory. A damaged manifest is a
    ``ModelLoadError`` naming the file, not a JSONDecodeError or KeyError from deep inside."""
    path = model_dir / MANIFEST_NAME
    rebuild = "rebuild the model with `voice-agent tiny-model DIR`"
    try:
        manifest = read_manifest(model_dir)
        if manifest is not None:
            apply_dims(chat, dims_from_manifest(manifest))
            # Our files, our hashes: ChatTTS still verifies every file against this table.
            chat.sha256_map = dict(manifest["sha256"])
        return manifest
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ModelLoadError(f"{path} is not valid JSON ({e}): {rebuild}") from e
    # A field missing, or of the wrong kind (AttributeError: JSON that is not an object).
    except (KeyError, TypeError, AttributeError) as e:
        raise ModelLoadError(f"{path} is incomplete or damaged ({e!r}): {rebuild}") from e
