// Shared by both pages (app.js, room.js): a server that vanishes, or a media path that
// breaks while HTTP still works, shows first as the audio stopping (the server sends a
// packet every 20 ms, silence included). A page whose audio stopped for MEDIA_STALL_MS asks
// the server about its session, and each page decides what the answer means for its call.

export const MEDIA_STALL_MS = 2000;
const SESSION_CHECK_TIMEOUT_MS = 2000;

// The audio RTP packets a peer connection has received, all its tracks together, from a
// getStats() report.
export function audioPackets(report) {
  let packets = 0;
  report.forEach((s) => {
    if (s.type === "inbound-rtp" && (s.kind ?? s.mediaType) === "audio") {
      packets += s.packetsReceived || 0;
    }
  });
  return packets;
}

// GET /sessions/{id}: the HTTP status, or null for no answer within the timeout (the server
// is gone, or the network is).
export async function sessionStatus(id, headers) {
  try {
    const res = await fetch(`/sessions/${encodeURIComponent(id)}`, {
      headers,
      cache: "no-store",
      signal: AbortSignal.timeout(SESSION_CHECK_TIMEOUT_MS),
    });
    return res.status;
  } catch {
    return null;
  }
}
