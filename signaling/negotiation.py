"""What the offer says about Opus and feedback, and the answer aiortc should give to it.

aiortc answers Opus with no fmtp at all and drops ``transport-cc``; this module reads the
browser's Opus parameters (RFC 7587) and its transport-cc offer, and adjusts the negotiated
transceiver between ``setRemoteDescription`` and ``createAnswer`` so that the answer says
what the agent really does (mono, 20 ms) and transport-cc is on when the browser offered it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from aiortc import RTCPeerConnection
from aiortc.rtcrtpparameters import RTCRtcpFeedback, RTCRtpHeaderExtensionParameters

from agent.opus import FRAME_SAMPLES, SAMPLE_RATE
from signaling.errors import ApiError

TWCC_URI = "http://www.ietf.org/id/draft-holmer-rmcat-transport-wide-cc-extensions-01"
FRAME_MS = FRAME_SAMPLES * 1000 // SAMPLE_RATE
_NUMBER = re.compile(r"[0-9]{1,9}")  # ASCII digits only: str.isdigit() also accepts "²"


@dataclass(frozen=True)
class OpusOffer:
    """The receiver's Opus parameters (RFC 7587 section 6.1) and feedback it offered."""

    payload_type: int | None = None
    useinbandfec: bool = False  # absent means 0: it will not decode FEC, so don't send it
    maxaveragebitrate: int | None = None
    stereo: bool = False
    maxplaybackrate: int | None = None
    minptime: int | None = None
    maxptime: int | None = None
    transport_cc_ext_id: int | None = None  # the extmap id, when transport-cc was offered
    transport_cc_feedback: bool = False  # a=rtcp-fb:<opus> transport-cc
    # (mid, Opus payload type) of every audio section offering Opus: the answer keeps the
    # offer's (aiortc keeps it only in 96-127, and 35-63 are dynamic too with rtcp-mux).
    section_payload_types: tuple[tuple[str, int], ...] = ()

    @property
    def transport_cc(self) -> bool:
        return self.transport_cc_ext_id is not None and self.transport_cc_feedback


def read_opus_offer(sdp: str) -> OpusOffer:
    """The first audio section's Opus parameters; ApiError if 20 ms is ruled out."""
    section = _first_audio_section(sdp)
    opus_pt = _opus_payload_type(section)
    params: dict[str, str] = {}
    feedback = False
    ext_id: int | None = None
    # RFC 7587 section 7.1: SDP carries maxptime as this media-level attribute, not in the
    # fmtp line (read there too: some offers put it there).
    maxptime_attribute: dict[str, str] = {}
    for line in section:
        if line.startswith("a=maxptime:"):
            maxptime_attribute["maxptime"] = line[len("a=maxptime:") :].strip()
        elif opus_pt is not None and line.startswith(f"a=fmtp:{opus_pt} "):
            for item in line.split(" ", 1)[1].split(";"):
                key, _, value = item.strip().partition("=")
                params[key.strip().lower()] = value.strip()
        elif opus_pt is not None and line.startswith((f"a=rtcp-fb:{opus_pt} ", "a=rtcp-fb:* ")):
            feedback = feedback or line.split(" ", 1)[1].strip() == "transport-cc"
        elif line.startswith("a=extmap:"):
            head, _, rest = line[len("a=extmap:") :].partition(" ")
            ident = head.split("/")[0]
            if rest.split(" ")[0] == TWCC_URI and _NUMBER.fullmatch(ident):
                ext_id = int(ident)
    offer = OpusOffer(
        payload_type=opus_pt,
        useinbandfec=params.get("useinbandfec") == "1",
        maxaveragebitrate=_positive_int(params, "maxaveragebitrate"),
        stereo=params.get("stereo") == "1",
        maxplaybackrate=_positive_int(params, "maxplaybackrate"),
        minptime=_positive_int(params, "minptime"),
        maxptime=_smallest(
            _positive_int(params, "maxptime"), _positive_int(maxptime_attribute, "maxptime")
        ),
        transport_cc_ext_id=ext_id,
        transport_cc_feedback=feedback,
        section_payload_types=_opus_payload_types(sdp),
    )
    if (offer.minptime and offer.minptime > FRAME_MS) or (
        offer.maxptime and offer.maxptime < FRAME_MS
    ):
        raise ApiError(
            400,
            "unsupported_ptime",
            f"the agent sends {FRAME_MS} ms Opus packets; the offer asks for "
            f"minptime={offer.minptime} maxptime={offer.maxptime}",
        )
    return offer


def tune_answer(pc: RTCPeerConnection, offer: OpusOffer) -> None:
    """Adjust the negotiated audio transceivers; call after setRemoteDescription."""
    payload_types = dict(offer.section_payload_types)
    for transceiver in pc.getTransceivers():
        if transceiver.kind != "audio":
            continue
        for codec in transceiver._codecs:
            if codec.mimeType.lower() != "audio/opus":
                continue
            # The offer's payload type, in the answer and on every packet: aiortc keeps it
            # only in 96-127, and answered Opus offered on 63 (a dynamic type too, RFC 5761
            # section 4) on 96, which the client cannot decode (found by review).
            codec.payloadType = payload_types.get(transceiver.mid or "", codec.payloadType)
            # What we receive (minptime=10 and no FEC: aiortc's decoder does not use it) and
            # what we send: mono (sprop-stereo=0) whatever the receiver would prefer.
            codec.parameters = {"minptime": 10, "useinbandfec": 0, "stereo": 0, "sprop-stereo": 0}
            if offer.transport_cc and not any(
                fb.type == "transport-cc" for fb in codec.rtcpFeedback
            ):
                codec.rtcpFeedback.append(RTCRtcpFeedback(type="transport-cc"))
        if (
            offer.transport_cc_ext_id is not None
            and offer.transport_cc
            and not any(ext.uri == TWCC_URI for ext in transceiver._headerExtensions)
        ):
            transceiver._headerExtensions.append(
                RTCRtpHeaderExtensionParameters(id=offer.transport_cc_ext_id, uri=TWCC_URI)
            )


def _opus_payload_types(sdp: str) -> tuple[tuple[str, int], ...]:
    """(mid, payload type) of each audio section's first Opus rtpmap."""
    found: list[tuple[str, int]] = []
    for section in _sections(sdp):
        if not section[0].startswith("m=audio"):
            continue
        mid = next((line[len("a=mid:") :] for line in section if line.startswith("a=mid:")), None)
        opus_pt = _opus_payload_type(section)
        if mid is not None and opus_pt is not None:
            found.append((mid, opus_pt))
    return tuple(found)


def _opus_payload_type(section: list[str]) -> int | None:
    """The payload type of a section's first Opus rtpmap."""
    for line in section:
        if line.startswith("a=rtpmap:"):
            pt, _, encoding = line[len("a=rtpmap:") :].partition(" ")
            if encoding.lower().startswith("opus/48000") and _NUMBER.fullmatch(pt):
                return int(pt)
    return None


def _sections(sdp: str) -> list[list[str]]:
    """The media sections' lines (stripped), each starting with its m-line."""
    sections: list[list[str]] = []
    for raw in sdp.splitlines():
        line = raw.strip()
        if line.startswith("m="):
            sections.append([])
        if sections:
            sections[-1].append(line)
    return sections


def _first_audio_section(sdp: str) -> list[str]:
    """The first audio section: the one aiortc sends our track on (addTrack takes the first
    audio transceiver; signaling/sdp.py check_offer_sdp makes sure that one receives)."""
    audio = [sec for sec in _sections(sdp) if sec[0].startswith("m=audio")]
    return audio[0] if audio else []


def _smallest(*values: int | None) -> int | None:
    given = [value for value in values if value is not None]
    return min(given) if given else None


def _positive_int(params: dict[str, str], key: str) -> int | None:
    value = params.get(key, "")
    return int(value) if _NUMBER.fullmatch(value) and int(value) > 0 else None
