"""Random-weight ChatTTS checkpoints in the real file layout, for offline tests and benchmarks.

``build_tiny_model(dir)`` writes ``asset/{Vocos,DVAE,Decoder,Embed}.safetensors``,
``asset/gpt/{config.json,model.safetensors}`` and ``asset/tokenizer/*`` exactly where
``Chat.load(source="custom")`` looks, plus ``manifest.json`` with the dimensions (ChatTTS
takes most of them from its own config dataclasses, not from the files) and the SHA-256 of
every file (``source="custom"`` refuses files whose hash is not in ``chat.sha256_map``).

Random weights speak noise, and a random GPT never samples its end token on purpose. So that a
smoke test behaves like speech (longer text, longer audio, ~0.3-0.5 s per word), three
residual channels of the GPT are wired by hand; every other weight is random:

- channel ``TXT`` is a constant ``A`` in text-token embeddings and 0 in audio-code embeddings;
- channel ``ONE`` is ``A`` in both (a bias carrier);
- one attention head of layer 0 has a zero query, so it attends uniformly to every position it
  may see; its value reads ``TXT``, so it writes ``n_text / n_positions`` into channel ``FRAC``;
- no other projection writes into these three channels;
- the end-of-speech row of the first code head is ``K * (tau * ONE - FRAC)``: strongly negative
  while text positions are more than ``tau`` of the sequence, strongly positive after.

The model therefore says about ``1/tau - 1`` audio tokens per text token (the tokenizer is
character level for Latin script, one token per CJK character). The "full" size applies the
same wiring to the published dimensions (~280M parameters): compute per token is the real
model's, which is what benchmarks need.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

MANIFEST_NAME = "manifest.json"
MANIFEST_KIND = "rtc-voice-agent/random-chattts"

# Residual channels reserved for the length mechanism (see module docstring).
_TXT, _ONE, _FRAC = 0, 1, 2
# Audio tokens per text token = 1/tau - 1; 4 per character is ~0.4 s per English word.
_TAU = 0.2
_SPECIAL_TOKENS = (
    ["[Stts]", "[Ptts]", "[spk_emb]", "[empty_spk]", "[Sbreak]", "[Pbreak]", "[Ebreak]"]
    + [f"[break_{i}]" for i in range(8)]
    + [f"[speed_{i}]" for i in range(10)]
    + [f"[oral_{i}]" for i in range(10)]
    + [f"[laugh_{i}]" for i in range(3)]
    + ["[uv_break]", "[v_break]", "[lbreak]", "[laugh]"]
)


@dataclass(frozen=True)
class ModelDims:
    """Every dimension ChatTTS needs, in the shape of its config dataclasses."""

    gpt_hidden: int
    gpt_intermediate: int
    gpt_heads: int
    gpt_layers: int
    num_text_tokens: int
    decoder: dict[str, int]
    dvae_encoder: dict[str, int]
    dvae_decoder: dict[str, int]
    vq_dim: int
    vocos_dim: int
    vocos_intermediate: int
    vocos_layers: int
    num_audio_tokens: int = 626
    num_vq: int = 4
    max_position_embeddings: int = 4096
    spk_emb_dim: int = 192
    vq_levels: tuple[int, ...] = (5, 5, 5, 5)
    extra: dict[str, Any] = field(default_factory=dict)


def dims_for(size: Literal["tiny", "full"], vocab_size: int) -> ModelDims:
    if size == "full":
        # The published ChatTTS dimensions (ChatTTS/config/config.py defaults).
        return ModelDims(
            gpt_hidden=768,
            gpt_intermediate=3072,
            gpt_heads=12,
            gpt_layers=20,
            num_text_tokens=21178,
            decoder={"idim": 384, "odim": 384, "hidden": 512, "n_layer": 12, "bn_dim": 128},
            dvae_encoder={"idim": 512, "odim": 1024, "hidden": 256, "n_layer": 12, "bn_dim": 128},
            dvae_decoder={"idim": 512, "odim": 512, "hidden": 256, "n_layer": 12, "bn_dim": 128},
            vq_dim=1024,
            vocos_dim=512,
            vocos_intermediate=1536,
            vocos_layers=8,
        )
    # Constraints (NOTES): gpt hidden == embed hidden == 2 * decoder.idim; decoder odim == idim;
    # vq dim == 2 * dvae decoder idim; 100 mel bins; 625 codes.
    return ModelDims(
        gpt_hidden=64,
        gpt_intermediate=128,
        gpt_heads=4,
        gpt_layers=2,
        num_text_tokens=vocab_size,
        decoder={"idim": 32, "odim": 32, "hidden": 32, "n_layer": 2, "bn_dim": 16},
        dvae_encoder={"idim": 16, "odim": 32, "hidden": 16, "n_layer": 1, "bn_dim": 8},
        dvae_decoder={"idim": 16, "odim": 16, "hidden": 16, "n_layer": 1, "bn_dim": 8},
        vq_dim=32,
        vocos_dim=32,
        vocos_intermediate=64,
        vocos_layers=2,
    )


def apply_dims(chat: Any, dims: ModelDims) -> None:
    """Point a ``ChatTTS.Chat``'s config at ``dims`` (before ``load``).

    The nested dataclass defaults are class-level instances shared by every ``Chat``, so each
    sub-config is replaced by a new object instead of having its fields assigned.
    """
    from ChatTTS.config import config as C

    chat.config.gpt = C.GPT(
        hidden_size=dims.gpt_hidden,
        intermediate_size=dims.gpt_intermediate,
        num_attention_heads=dims.gpt_heads,
        num_hidden_layers=dims.gpt_layers,
        max_position_embeddings=dims.max_position_embeddings,
        spk_emb_dim=dims.spk_emb_dim,
        num_audio_tokens=dims.num_audio_tokens,
        num_text_tokens=dims.num_text_tokens,
        num_vq=dims.num_vq,
    )
    chat.config.embed = C.Embed(
        hidden_size=dims.gpt_hidden,
        num_audio_tokens=dims.num_audio_tokens,
        num_text_tokens=dims.num_text_tokens,
        num_vq=dims.num_vq,
    )
    chat.config.decoder = C.Decoder(**dims.decoder)
    chat.config.dvae = C.DVAE(
        encoder=C.Decoder(**dims.dvae_encoder),
        decoder=C.Decoder(**dims.dvae_decoder),
        vq=C.VQ(dim=dims.vq_dim, levels=tuple(dims.vq_levels), G=2, R=2),
    )
    if dims.extra.get("spk_stat"):
        # Speaker statistics (std then mean, float16, base16384) sized for this GPT width.
        chat.config.spk_stat = dims.extra["spk_stat"]
    chat.config.vocos = C.Vocos(
        feature_extractor=C.FeatureExtractor(init_args=C.FeatureExtractorInitArgs()),
        backbone=C.Backbone(
            init_args=C.BackboneInitArgs(
                input_channels=100,
                dim=dims.vocos_dim,
                intermediate_dim=dims.vocos_intermediate,
                num_layers=dims.vocos_layers,
            )
        ),
        head=C.FourierHead(init_args=C.FourierHeadInitArgs(dim=dims.vocos_dim)),
    )


def read_manifest(model_dir: Path) -> dict[str, Any] | None:
    """The manifest of a random checkpoint built here, or None for any other directory."""
    path = Path(model_dir) / MANIFEST_NAME
    if not path.is_file():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    if data.get("kind") != MANIFEST_KIND:
        return None
    return data


def dims_from_manifest(manifest: dict[str, Any]) -> ModelDims:
    d = dict(manifest["dims"])
    d["vq_levels"] = tuple(d["vq_levels"])
    return ModelDims(**d)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _vocab() -> list[str]:
    """Character-level WordPiece vocabulary: ChatTTS specials, Latin letters, punctuation and
    the most common CJK characters (others become one [UNK] each, which still counts)."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    digits = [str(i) for i in range(10)]
    punct = list(",.!?;:'\"-()，。、！？；：")
    cjk = list(
        "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着"
        "去之过家学对可她里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主"
        "行方又如前所本见经头面公同三已老从动两长"
    )
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *_SPECIAL_TOKENS]
    vocab += letters + [f"##{c}" for c in letters] + digits + [f"##{d}" for d in digits]
    vocab += punct + cjk
    return vocab


def _write_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import WordPiece
    from transformers import BertTokenizerFast  # type: ignore[attr-defined]

    vocab = _vocab()
    tok = Tokenizer(WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True, handle_chinese_chars=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    fast = BertTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        additional_special_tokens=list(_SPECIAL_TOKENS),
    )
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    for extra in out.iterdir():  # ChatTTS checks exactly three files; vocab.txt is harmless
        if extra.name not in {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}:
            extra.unlink()
    if not (out / "special_tokens_map.json").exists():
        # transformers 5 folds this into tokenizer_config.json; ChatTTS still checks the file.
        (out / "special_tokens_map.json").write_text(
            json.dumps(
                {
                    "unk_token": "[UNK]",
                    "pad_token": "[PAD]",
                    "cls_token": "[CLS]",
                    "sep_token": "[SEP]",
                    "mask_token": "[MASK]",
                    "additional_special_tokens": list(_SPECIAL_TOKENS),
                },
                indent=2,
            )
        )
    return len(vocab)


def _speaker_stat(hidden: int, gen: Any) -> str:
    """std and mean of speaker embeddings, as ChatTTS stores them (float16, base16384)."""
    import numpy as np
    import pybase16384 as b14
    import torch

    std = torch.rand(hidden, generator=gen) * 0.5 + 0.5
    mean = torch.randn(hidden, generator=gen) * 0.2
    std[:3] = 0  # the length channels: a speaker position counts like an audio position
    mean[:3] = 0
    arr = torch.cat([std, mean]).numpy().astype(np.float16)
    return str(b14.encode_to_string(arr.tobytes()))


def _randomize_layer_scales(module: Any, gen: Any, lo: float, hi: float) -> None:
    """ConvNeXt blocks start with a layer scale of 1e-6 (almost the identity), which would make
    the decoder's real receptive field vanish; trained weights are far from that, so give every
    block a visible contribution. Seam measurements depend on it."""
    import torch

    for name, p in module.named_parameters():
        if re.search(r"decoder_block\.\d+\.weight$", name) and p.dim() == 1:
            with torch.no_grad():
                p.copy_(torch.empty_like(p).uniform_(lo, hi, generator=gen))


def _wire_length(embed: Any, gpt: Any, dims: ModelDims, gen: Any) -> None:
    """Hand-set the channels that make speech length follow text length (module docstring)."""
    import torch

    h = dims.gpt_hidden
    amp = 1.0  # value of TXT / ONE; rows are scaled so that their RMS is 1 as well
    with torch.no_grad():
        # Text rows: random direction, RMS exactly 1, TXT = ONE = amp, FRAC = 0.
        w = torch.randn(dims.num_text_tokens, h, generator=gen)
        w[:, :3] = 0
        w *= math.sqrt(h - 2 * amp**2) / w.norm(dim=1, keepdim=True)
        w[:, _TXT] = amp
        w[:, _ONE] = amp
        # Every text row has RMS exactly 1, so TXT after layer 0's RMSNorm is amp for all of them.
        embed.emb_text.weight.copy_(w)
        txt_after_norm = amp
        for e in embed.emb_code:
            c = torch.randn(dims.num_audio_tokens, h, generator=gen) * 0.5
            c[:, _TXT] = 0.0
            c[:, _FRAC] = 0.0
            c[:, _ONE] = txt_after_norm / dims.num_vq  # summed over 4 codebooks -> same as text
            e.weight.copy_(c)

        head_dim = h // dims.gpt_heads
        for li, layer in enumerate(gpt.layers):
            attn, mlp = layer.self_attn, layer.mlp
            attn.o_proj.weight[:3, :] = 0
            mlp.down_proj.weight[:3, :] = 0
            if li == 0:
                # Head 0: zero query -> uniform attention over the visible positions; value dim 0
                # reads TXT (post-norm, norm weight 1); o_proj copies it into FRAC.
                attn.q_proj.weight[:head_dim, :] = 0
                attn.v_proj.weight[:head_dim, :] = 0
                attn.v_proj.weight[0, _TXT] = 1.0
                attn.o_proj.weight[:, :head_dim] = 0
                attn.o_proj.weight[_FRAC, 0] = 1.0
                layer.input_layernorm.weight.fill_(1.0)
        gpt.norm.weight.fill_(1.0)

        # FRAC = frac_text * t, ONE = t with t = TXT after norm. EOS logit of codebook 0 is
        # K * (tau * ONE - FRAC) = K * t * (tau - frac_text); other codebooks never end.
        eos = dims.num_audio_tokens - 1
        big = 400.0
        for q, head in enumerate(embed.head_code):
            wq = torch.randn(dims.num_audio_tokens, h, generator=gen) / math.sqrt(h)
            wq[:, :3] = 0
            wq[eos] = 0
            if q == 0:
                wq[eos, _ONE] = big * _TAU
                wq[eos, _FRAC] = -big
            else:
                wq[eos, _ONE] = -big
            head.weight = wq  # weight_norm's right_inverse sets magnitude and direction


def build_tiny_model(
    out_dir: Path, *, size: Literal["tiny", "full"] = "tiny", seed: int = 0
) -> Path:
    """Write a random-weight ChatTTS checkpoint into ``out_dir`` and return ``out_dir``.

    ``tiny`` (~3 MB, seconds to build) is for tests and smoke runs; ``full`` has the published
    dimensions (~280M parameters, ~1.1 GB on disk) for benchmarks only.
    """
    out_dir = Path(out_dir)
    asset = out_dir / "asset"
    # First: a path that cannot take it (a file, no permission) fails at once with OSError,
    # not after seconds of imports.
    asset.mkdir(parents=True, exist_ok=True)

    import torch
    from ChatTTS.model.dvae import DVAE
    from ChatTTS.model.embed import Embed
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaModel
    from vocos import Vocos
    from vocos.pretrained import instantiate_class

    gen = torch.Generator().manual_seed(seed)
    torch_state = torch.random.get_rng_state()
    torch.manual_seed(seed)  # module initialisers use the global RNG; restored below
    try:
        vocab_size = _write_tokenizer(asset / "tokenizer")
        dims = dims_for(size, vocab_size)
        if size == "tiny":  # the published speaker statistics are 768 wide: make our own
            dims = replace(dims, extra={"spk_stat": _speaker_stat(dims.gpt_hidden, gen)})

        class _Cfg:  # a stand-in for Chat so apply_dims can fill the ChatTTS config objects
            def __init__(self) -> None:
                from ChatTTS.config import Config

                self.config = Config()

        holder = _Cfg()
        apply_dims(holder, dims)
        cfg = holder.config

        def save(module: torch.nn.Module, path: Path) -> None:
            state = {k: v.detach().contiguous().clone() for k, v in module.state_dict().items()}
            save_file(state, str(path))

        # Vocos: random backbone; the head's log-magnitude bias keeps the noise at speech level.
        vocos = Vocos(
            feature_extractor=instantiate_class(args=(), init=asdict(cfg.vocos.feature_extractor)),
            backbone=instantiate_class(args=(), init=asdict(cfg.vocos.backbone)),
            head=instantiate_class(args=(), init=asdict(cfg.vocos.head)),
        )
        with torch.no_grad():
            n_mag = vocos.head.out.weight.shape[0] // 2
            vocos.head.out.weight.mul_(0.5)
            vocos.head.out.bias[:n_mag] = 1.5
        save(vocos, asset / "Vocos.safetensors")

        dvae = DVAE(
            decoder_config=asdict(cfg.dvae.decoder),
            encoder_config=asdict(cfg.dvae.encoder),
            vq_config=asdict(cfg.dvae.vq),
            dim=cfg.dvae.decoder.idim,
        )
        _randomize_layer_scales(dvae, gen, 0.05, 0.2)
        save(dvae, asset / "DVAE.safetensors")

        decoder = DVAE(decoder_config=asdict(cfg.decoder), dim=cfg.decoder.idim)
        _randomize_layer_scales(decoder, gen, 0.05, 0.2)
        with torch.no_grad():
            decoder.coef.copy_(torch.rand(decoder.coef.shape, generator=gen) * 0.5 + 0.75)
        save(decoder, asset / "Decoder.safetensors")

        embed = Embed(dims.gpt_hidden, dims.num_audio_tokens, dims.num_text_tokens, dims.num_vq)
        llama_cfg = LlamaConfig(
            hidden_size=dims.gpt_hidden,
            intermediate_size=dims.gpt_intermediate,
            num_attention_heads=dims.gpt_heads,
            num_key_value_heads=dims.gpt_heads,
            num_hidden_layers=dims.gpt_layers,
            max_position_embeddings=dims.max_position_embeddings,
            vocab_size=dims.num_audio_tokens,  # embed_tokens is deleted by ChatTTS after loading
            use_cache=False,
        )
        llama = LlamaModel(llama_cfg)
        _wire_length(embed, llama, dims, gen)
        save(embed, asset / "Embed.safetensors")
        llama.save_pretrained(str(asset / "gpt"), safe_serialization=True)
        for extra in (asset / "gpt").iterdir():
            if extra.name not in {"config.json", "model.safetensors"}:
                extra.unlink()
    finally:
        torch.random.set_rng_state(torch_state)

    files = [
        "asset/Decoder.safetensors",
        "asset/DVAE.safetensors",
        "asset/Embed.safetensors",
        "asset/Vocos.safetensors",
        "asset/gpt/config.json",
        "asset/gpt/model.safetensors",
        "asset/tokenizer/special_tokens_map.json",
        "asset/tokenizer/tokenizer_config.json",
        "asset/tokenizer/tokenizer.json",
    ]
    # Keys as ChatTTS's check_all_assets spells them: sha256_asset_gpt_config_json etc.
    sha = {"sha256_" + f.replace("/", "_").replace(".", "_"): _sha256(out_dir / f) for f in files}
    dims_json = asdict(dims)
    dims_json["vq_levels"] = list(dims.vq_levels)
    manifest = {
        "kind": MANIFEST_KIND,
        "size": size,
        "seed": seed,
        "dims": dims_json,
        "sha256": sha,
        "audio_tokens_per_text_token": 1 / _TAU - 1,
        "note": "random weights: speaks noise; length follows text by construction",
    }
    (out_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2))
    return out_dir


def main(argv: list[str] | None = None) -> int:
    """``python -m agent.chattts.tiny DIR [--size full] [--seed N]`` (what ``voice-agent
    tiny-model`` runs)."""
    import argparse

    ap = argparse.ArgumentParser(description="Build a random-weight ChatTTS checkpoint.")
    ap.add_argument("dir", type=Path)
    ap.add_argument("--size", choices=("tiny", "full"), default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = build_tiny_model(args.dir, size=args.size, seed=args.seed)
    print(f"{args.size} random-weight ChatTTS checkpoint written to {out}")
    print(f"try: voice-agent serve --model-dir {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
