// Browser client for the voice agent: one WebRTC call, a data channel `agent` for text and
// events, and live getStats() plots. Plain ES module, no build step, no external resources.
// Wire contract: shared DESIGN.md ("Wire contract, version 1").

import { MEDIA_STALL_MS, audioPackets, sessionStatus } from "./audiowatch.js";

const OFFER_URL = "/offer";
const SESSION_URL = (id) => `/sessions/${encodeURIComponent(id)}`;
const ICE_GATHER_TIMEOUT_MS = 2000; // non-trickle: send the offer after gathering or this long
const CONNECT_TIMEOUT_MS = 15000; // offer posted -> data channel open
const HANGUP_WAIT_MS = 1000; // how long Hang up waits for DELETE /sessions/{id}
const ICE_SERVERS_TIMEOUT_MS = 5000; // GET /ice-servers; then the call goes on with none
const STATS_INTERVAL_MS = 1000;
// Reconnect: a lost connection is resumed with the session token (same session, queued
// speech kept); "disconnected" for this long counts as lost.
const RESUME_ATTEMPTS = 3;
const RESUME_AFTER_DISCONNECTED_MS = 4000;
const PLOT_POINTS = 60; // one per second: the last minute
const MAX_STATS_SAMPLES = 3600; // what window.voiceAgent.stats keeps (an hour)
// A long call must not grow the page without bound: the transcript keeps its newest items
// (across Hang up + Connect too), window.voiceAgent.events its newest events.
const MAX_TRANSCRIPT_ITEMS = 500;
const MAX_EVENTS = 1000;
// An access token from the page URL (?token=...), for a server started with an auth secret.
// It goes in the Authorization header (not the URL) so it stays out of logs.
const TOKEN = new URLSearchParams(location.search).get("token");

// ---------------------------------------------------------------------------------------
// Elements

const $ = (id) => document.getElementById(id);
// The access token goes along to the rooms page (README: open /?token=...): without it
// that page's Join was refused 401.
if (TOKEN) $("rooms-link").search = `?token=${encodeURIComponent(TOKEN)}`;
const ui = {
  connect: $("connect"),
  hangup: $("hangup"),
  state: $("state"),
  session: $("session"),
  alert: $("alert"),
  form: $("say-form"),
  text: $("text"),
  say: $("say"),
  ask: $("ask"),
  interrupt: $("interrupt"),
  mic: $("mic"),
  bargeIn: $("barge-in"),
  listening: $("listening"),
  caption: $("caption"),
  audio: $("remote-audio"),
  transcript: $("transcript"),
  transcriptEmpty: $("transcript-empty"),
  stats: $("stats"),
};

// ---------------------------------------------------------------------------------------
// Session state (one call at a time)

const session = {
  pc: null,
  channel: null,
  id: null,
  generation: 0, // bumped on every connect/teardown so stale async work can tell
  // Bumped when a call starts or ends for good (Connect, Hang up, giving up), not by the
  // teardowns and connects of a resume: a pending resume stops when it changes.
  call: 0,
  statsTimer: null,
  statsBusy: false,
  prevInbound: null,
  // The audio packets received, and since when that count stands (see MEDIA_STALL_MS).
  media: { pc: null, packets: null, since: 0, checking: false },
  seq: 0,
  captionFor: null,
  hangingUp: false,
  token: null, // session token from the last answer: what a resume shows the server
  disconnectTimer: null,
  micStream: null, // the microphone, while a call uses it
  inRoom: false, // the call is a room seat (its answer named a participant): no barge-in setting
  // A call being set up with no peer connection yet (fetching /ice-servers): Connect is
  // pending and Hang up cancels it.
  opening: false,
  established: false, // this connection's data channel opened: losing it now is a lost call
  noStt: false, // the server said it has no speech-to-text: turns will get no transcript
};
const texts = new Map(); // client id -> text we asked the agent to say
const items = new Map(); // utterance id -> transcript <li>
const captionTimers = new Map(); // caption key -> Set of its captions' pending timers
// Utterance id -> the caption key of its current run (`id#n`, n counting speech.started):
// an id said again right after itself is another run, whose captions the first run's
// delayed end must not cancel or clear. Deleted at the run's end.
const captionRuns = new Map();
let captionRunCount = 0;
const events = []; // the data-channel events received, in order (not `stats`), bounded
const serverStats = []; // the server's `stats` events (its view of the network), bounded
const stats = []; // every stats sample (what the plots draw)

// ---------------------------------------------------------------------------------------
// Small helpers

// Headers for an API request: `extra` plus the bearer token when the page has one.
function apiHeaders(extra = {}) {
  return TOKEN ? { ...extra, Authorization: `Bearer ${TOKEN}` } : extra;
}

class ServerError extends Error {
  constructor(code, message, status) {
    super(message);
    this.code = code;
    this.status = status;
  }
}

// A refusal with Retry-After (server_full, not_ready, tts_unavailable...) says when to try
// again, as rate_limited's message does itself.
function withRetryHint(message, res) {
  const after = Number(res.headers.get("Retry-After"));
  return after > 0 && !/retry in/i.test(message) ? `${message}; retry in ${after} s` : message;
}

function describeError(err) {
  if (err instanceof ServerError) return `${err.code}: ${err.message}`;
  if (err && err.name === "TypeError" && /fetch/i.test(err.message)) {
    return `Could not reach the server (${err.message})`;
  }
  return (err && err.message) || String(err);
}

function showAlert(text, kind = "error") {
  ui.alert.textContent = text;
  ui.alert.dataset.kind = kind;
  ui.alert.hidden = false;
}

function clearAlert() {
  ui.alert.hidden = true;
  ui.alert.textContent = "";
}

function withTimeout(promise, ms, what) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`Timed out ${what}`)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

function newClientId() {
  session.seq += 1;
  const rand = Math.random().toString(36).slice(2, 8);
  return `c-${Date.now().toString(36)}-${session.seq}-${rand}`;
}

// ---------------------------------------------------------------------------------------
// Connection state shown in the header: idle | connecting | connected | disconnected |
// failed | closed. "connected" means the peer connection is up AND the channel is open.

function setState(name, detail = "") {
  ui.state.textContent = name;
  ui.state.dataset.state = name;
  ui.state.title = detail;
  const live = session.pc !== null || session.opening;
  const open = name === "connected";
  ui.connect.disabled = live;
  ui.mic.disabled = live; // the microphone is chosen per call
  ui.hangup.disabled = !live && !session.token; // between two resume tries too
  ui.text.disabled = !open;
  ui.say.disabled = !open;
  ui.ask.disabled = !open;
  ui.interrupt.disabled = !open;
  ui.bargeIn.disabled = session.inRoom; // a room's agent listens to no one: nothing to set
  ui.session.textContent = session.id ? `session ${session.id}` : "";
}

function refreshState() {
  const { pc, channel } = session;
  if (!pc) return;
  const pcState = pc.connectionState ?? pc.iceConnectionState;
  if (pcState !== "disconnected") {
    clearTimeout(session.disconnectTimer);
    session.disconnectTimer = null;
  }
  if (pcState === "failed") {
    // Failing while Hang up waits for its DELETE is no news: Hang up ends the call
    // ("closed"); tearing down as "failed" here also made it lose the call for its own.
    if (session.hangingUp) return;
    if (!session.established) return; // the try waiting for its channel fails (doConnect)
    if (lostConnection()) return;
    teardown("failed");
    showAlert("The connection failed (ICE could not reach the server).");
    return;
  }
  if (pcState === "closed") {
    teardown("closed");
    return;
  }
  if (pcState === "disconnected") {
    session.disconnectTimer ??= setTimeout(lostConnection, RESUME_AFTER_DISCONNECTED_MS);
    setState("disconnected", "media path interrupted; waiting for it to recover");
    return;
  }
  const connected = (pcState === "connected" || pcState === "completed") &&
    channel && channel.readyState === "open";
  setState(connected ? "connected" : "connecting", `peer: ${pcState}, channel: ${channel?.readyState}`);
}

// ---------------------------------------------------------------------------------------
// Media: today the page only listens (recvonly). A microphone becomes
// addAudio(pc, micTrack) -> a sendrecv transceiver carrying the track; nothing else changes.

// The microphone, with the user's consent: echo cancellation keeps the agent's own voice
// out of it (the server would otherwise hear itself and barge in on itself). Refused or
// missing: the call goes on listen-only.
// `stale()` says whether the call asking for it was torn down meanwhile.
async function openMic(stale) {
  if (!ui.mic.checked || !navigator.mediaDevices?.getUserMedia) return null;
  try {
    const stream = await navigator.mediaDevices.getUserMedia({
      audio: { echoCancellation: true, noiseSuppression: true, autoGainControl: true },
      video: false,
    });
    if (stale()) {
      // Hung up while the browser asked for permission: teardown already ran and would
      // never stop this stream, leaving the microphone on.
      stopStream(stream);
      return null;
    }
    session.micStream = stream;
    const track = stream.getAudioTracks()[0] ?? null;
    // The device unplugged or its permission withdrawn mid-call: the call goes on without
    // it, which the user must know (else they talk to no one).
    track?.addEventListener("ended", () => {
      if (session.micStream !== stream) return; // Hang up's own stop, or an earlier call's
      showAlert("The microphone stopped (unplugged, or its permission withdrawn): listening only; type to talk.", "info");
    });
    return track;
  } catch (err) {
    if (!stale()) {
      showAlert(`Microphone unavailable (${err.name || err}): listening only; type to talk.`, "info");
    }
    return null;
  }
}

function stopStream(stream) {
  for (const track of stream.getTracks()) track.stop();
}

function closeMic() {
  if (session.micStream) stopStream(session.micStream);
  session.micStream = null;
}

function addAudio(pc, micTrack = null) {
  if (micTrack) {
    return pc.addTransceiver(micTrack, { direction: "sendrecv" });
  }
  return pc.addTransceiver("audio", { direction: "recvonly" });
}

function playRemote(event) {
  const stream = event.streams && event.streams[0] ? event.streams[0] : new MediaStream([event.track]);
  ui.audio.srcObject = stream;
  const started = ui.audio.play();
  if (started && typeof started.catch === "function") {
    started.catch(() => {
      showAlert("The browser blocked audio playback: click anywhere on the page to hear the agent.", "info");
      const resume = () => {
        ui.audio.play().then(clearAlert, () => {});
      };
      document.addEventListener("click", resume, { once: true });
    });
  }
}

async function iceServers() {
  // The server's own STUN/TURN list (empty by default, which works on localhost and a LAN),
  // so both ends gather the same kinds of candidates.
  try {
    const request = fetch("/ice-servers", { headers: apiHeaders() });
    const resp = await withTimeout(request, ICE_SERVERS_TIMEOUT_MS, "fetching /ice-servers");
    if (resp.ok) {
      const body = await resp.json();
      if (Array.isArray(body.iceServers)) return body.iceServers;
    }
  } catch (err) {
    console.warn("could not fetch /ice-servers, using none", err);
  }
  return [];
}

function waitForIceGathering(pc, timeoutMs) {
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => {
      clearTimeout(timer);
      pc.removeEventListener("icegatheringstatechange", onChange);
      resolve();
    };
    const onChange = () => {
      if (pc.iceGatheringState === "complete") done();
    };
    const timer = setTimeout(done, timeoutMs); // send what we have
    pc.addEventListener("icegatheringstatechange", onChange);
  });
}

function waitForChannelOpen(channel, pc) {
  if (channel.readyState === "open") return Promise.resolve();
  return new Promise((resolve, reject) => {
    const cleanup = () => {
      channel.removeEventListener("open", onOpen);
      channel.removeEventListener("close", onClose);
      pc.removeEventListener("connectionstatechange", onPc);
      pc.removeEventListener("iceconnectionstatechange", onPc);
    };
    const onOpen = () => { cleanup(); resolve(); };
    const onClose = () => { cleanup(); reject(new Error("The data channel closed before it opened")); };
    // connectionState where the browser has it (refreshState's fallback otherwise).
    const onPc = () => {
      const state = pc.connectionState ?? pc.iceConnectionState;
      if (state === "failed" || state === "closed") {
        cleanup();
        reject(new Error(`The connection ${state} before the data channel opened`));
      }
    };
    channel.addEventListener("open", onOpen);
    channel.addEventListener("close", onClose);
    pc.addEventListener("connectionstatechange", onPc);
    pc.addEventListener("iceconnectionstatechange", onPc);
  });
}

async function postOffer(description, resume = null) {
  const body = { sdp: description.sdp, type: description.type };
  if (resume) body.resume = resume;
  const room = new URLSearchParams(location.search).get("room");
  if (room) body.room = room;
  const res = await fetch(OFFER_URL, {
    method: "POST",
    headers: apiHeaders({ "Content-Type": "application/json", Accept: "application/json" }),
    body: JSON.stringify(body),
  });
  let data = null;
  try {
    data = await res.json();
  } catch {
    data = null;
  }
  if (!res.ok) {
    const err = data && data.error;
    if (err && err.code) {
      throw new ServerError(err.code, withRetryHint(err.message || "", res), res.status);
    }
    throw new ServerError(`http_${res.status}`, res.statusText || "request failed", res.status);
  }
  if (!data || typeof data.sdp !== "string" || data.type !== "answer") {
    throw new ServerError("bad_answer", "The server's answer is not an SDP answer", res.status);
  }
  return data;
}

// ---------------------------------------------------------------------------------------
// Connect / hang up

let connecting = null;

function connect() {
  if (connecting) return connecting;
  if (session.pc) return Promise.resolve();
  // A new call while the last one waits between resume tries: that one ends on the server
  // too, or its session would sit there detached until its grace period ran out.
  if (session.id && session.token) endOnServer(session.id);
  endCall(); // a new call: a resume of the last one, if pending, stops
  return track(doConnect());
}

// The connect in progress: a later Connect click waits for it rather than starting another.
// A teardown forgets it: a try stuck on a server that never answers (its offer, say) must
// not make every later Connect wait for it.
function track(promise) {
  const tracked = promise.finally(() => {
    if (connecting === tracked) connecting = null;
  });
  connecting = tracked;
  return tracked;
}

async function doConnect(resume = null) {
  clearAlert();
  const generation = ++session.generation;
  session.hangingUp = false;
  if (!resume) {
    events.length = 0;
    stats.length = 0;
    serverStats.length = 0;
    resetPlots();
  }
  session.prevInbound = null;
  // Until this connection's data channel opens, its failure fails this try (doConnect's
  // catch: a new call ends, a resume try counts against its tries), not a lost call.
  session.established = false;

  const stale = () => session.generation !== generation;
  const call = session.call;
  session.opening = true; // shown at once: /ice-servers may be slow to answer
  setState("connecting");

  try {
    // A failure from here on tears the call down, which also stops the microphone. The
    // constructor is in it too: it throws on an ICE list it refuses (a TURN URL without
    // credentials), which left the page "idle" with nothing said.
    const servers = await iceServers();
    if (stale()) return;
    const pc = new RTCPeerConnection({ iceServers: servers });
    session.pc = pc;
    session.opening = false;
    const micTrack = await openMic(stale);
    if (stale()) return;
    addAudio(pc, micTrack);
    const channel = pc.createDataChannel("agent");
    session.channel = channel;
    channel.binaryType = "arraybuffer";
    channel.addEventListener("message", onChannelMessage);
    channel.addEventListener("open", refreshState);
    channel.addEventListener("close", () => {
      // Before it opened: the try waiting for it fails (doConnect), as when ICE fails.
      if (session.channel === channel && session.pc && session.established) {
        const expected = session.hangingUp;
        if (!expected && lostConnection()) return;
        teardown("closed");
        if (!expected) showAlert("The agent closed the session.", "info");
      }
    });
    pc.addEventListener("track", playRemote);
    pc.addEventListener("connectionstatechange", refreshState);
    pc.addEventListener("iceconnectionstatechange", refreshState);

    await pc.setLocalDescription(await pc.createOffer());
    await waitForIceGathering(pc, ICE_GATHER_TIMEOUT_MS);
    if (stale()) return;
    const answer = await postOffer(pc.localDescription, resume);
    if (stale()) {
      // The call ended (Hang up, a new Connect) while the offer was being answered: the
      // server made a session that nothing else will delete (a new call's id was never
      // learnt), holding a seat until the server's connect timeout. (A stale try of a call
      // that lives on, i.e. a resume, keeps its session.)
      if (session.call !== call && answer.session_id) endOnServer(answer.session_id);
      return;
    }
    session.id = answer.session_id ?? null;
    session.token = answer.session_token ?? null;
    session.inRoom = Boolean(answer.participant_id);
    await pc.setRemoteDescription({ type: "answer", sdp: answer.sdp });
    startStats();
    refreshState();
    await withTimeout(waitForChannelOpen(channel, pc), CONNECT_TIMEOUT_MS, "waiting for the connection");
    if (stale()) return;
    session.established = true;
    refreshState();
    // The box, whichever way it is ticked, is the session's setting: the server's default
    // may differ (--no-barge-in), and a change made while the channel was down (during a
    // resume) was not sent. A room seat has no such setting (the server refuses it).
    if (!session.inRoom) send({ type: "config", barge_in: ui.bargeIn.checked });
    ui.text.focus();
  } catch (err) {
    // A resume try refused because the user hung up meanwhile (404/410: the DELETE ended
    // the session) is no error of the call: Hang up ends it itself.
    if (!stale() && !session.hangingUp) {
      // A failed resume try keeps the token: resumeSession decides whether to try again.
      // A failed new call ends its session on the server if it got one (e.g. the data
      // channel never opened): else it would hold a seat until the server's connect timeout.
      teardown(resume ? "reconnecting" : "failed", { keepToken: Boolean(resume), notifyServer: !resume });
      showAlert(describeError(err));
    }
    throw err;
  }
}

// The call is over for good: nothing may resume it any more. What it was still saying was
// cut off (a speech.ended will never come for it), whichever way the call ended: Hang up,
// a new Connect, or giving up on a resume.
function endCall() {
  session.token = null;
  session.id = null;
  session.inRoom = false;
  session.call += 1;
  session.noStt = false;
  for (const li of items.values()) {
    const user = li.dataset.role === "user";
    if (li.dataset.status === "speaking") setItemStatus(li, "interrupted", "cut off");
    // The user's turn under way, or waiting for its transcript: none will come now.
    else if (user && ["listening", "transcribing"].includes(li.dataset.status)) setItemStatus(li, "empty", "cut off");
  }
  // An id the next call uses again (a greeting's, said over HTTP) is a new item there. The
  // items stay on show; the maps keep nothing of them (the oldest item's removal, which
  // drops its text, no longer finds it here).
  items.clear();
  texts.clear();
}

// keepToken: the connection goes but the call lives on (a resume follows): the token and
// the session id stay.
function teardown(finalState, { notifyServer = false, keepToken = false } = {}) {
  const { pc, channel, id } = session;
  if (!keepToken) endCall();
  clearTimeout(session.disconnectTimer);
  session.disconnectTimer = null;
  session.generation += 1;
  session.hangingUp = false;
  session.pc = null;
  session.opening = false;
  session.channel = null;
  connecting = null; // its try is stale now, whenever it returns
  stopStats();
  drawPlots(); // the figures shown stop reading as live
  closeMic();
  ui.listening.hidden = true;
  if (channel) {
    try { channel.close(); } catch { /* already closed */ }
  }
  if (pc) {
    try { pc.close(); } catch { /* already closed */ }
  }
  ui.audio.srcObject = null;
  cancelAllCaptions();
  captionRuns.clear();
  setCaption(null, "");
  if (notifyServer && id) endOnServer(id);
  setState(finalState);
}

// DELETE /sessions/{id} without waiting for it (keepalive: it outlives an unloading page).
function endOnServer(id) {
  fetch(SESSION_URL(id), { method: "DELETE", keepalive: true, headers: apiHeaders() }).catch(() => {});
}

// Hang up: tell the server first (DELETE /sessions/{id}, at most HANGUP_WAIT_MS), then
// close locally; closing first would let the server drop the session and answer 404.
// Also while a lost connection is being resumed: that resume stops.
async function hangup() {
  if (!session.pc && !session.token && !session.opening) return; // no call, none being resumed
  const { id } = session;
  ui.hangup.disabled = true;
  session.hangingUp = true; // the channel closing now is expected, not news
  endCall(); // first: a resume try failing while we wait must not try again
  // This call, not this connection: a resume try that fails while the DELETE is on its
  // way tears its connection down itself ("reconnecting"), and the call must still end.
  const call = session.call;
  if (id) {
    try {
      const request = fetch(SESSION_URL(id), { method: "DELETE", headers: apiHeaders() });
      await withTimeout(request, HANGUP_WAIT_MS, "hanging up");
    } catch {
      // The server may already be gone; closing locally is enough.
    }
  }
  if (session.call === call) teardown("closed"); // unless Connect started a new call
}

// The connection was lost (ICE failed, stayed disconnected, or the channel closed without a
// hang-up): resume the same session on a new connection; queued speech plays once back.
function lostConnection() {
  const token = session.token;
  if (!token || session.hangingUp || !session.pc || !session.established) return false;
  if (session.inRoom) {
    // A room seat is not resumed (the server refuses it: not_resumable), as on the room page.
    teardown("closed", { notifyServer: true });
    showAlert("The connection to the room was lost: Connect to join it again.");
    return true;
  }
  teardown("reconnecting", { keepToken: true });
  resumeSession(token, session.call);
  return true;
}

// Up to RESUME_ATTEMPTS tries. After every wait and every failed try it checks that the
// call is still the same one: once the user hung up (or connected anew) it stops, and
// never brings the hung-up call back.
async function resumeSession(token, call) {
  const current = () => session.call === call;
  for (let attempt = 1; attempt <= RESUME_ATTEMPTS; attempt++) {
    await new Promise((resolve) => setTimeout(resolve, 500 * attempt));
    if (!current() || session.pc || connecting) return;
    try {
      await track(doConnect(token));
      return;
    } catch (err) {
      if (!current()) return;
      // 404/410: the session is gone (grace period over); 400 (not_resumable...), 401/403:
      // this token will not do (expired during the call, or not for this room), whatever
      // the try; anything else: try again.
      if (err instanceof ServerError && [400, 401, 403, 404, 410].includes(err.status)) break;
    }
  }
  if (!current()) return;
  // Given up: the last try's error stays on show, and the server is told (else the session
  // waited out its connect timeout and resume grace, holding a seat).
  const id = session.id;
  endCall();
  if (id) endOnServer(id);
  setState("failed");
}

// The server ended the session on purpose (e.g. idle_timeout) and closes the connection
// next: that is not a lost connection, so tear down now, without a resume (which could
// only fail), and say why.
function closedByServer(reason) {
  if (!session.pc) return;
  teardown("closed");
  showAlert(`The agent closed the session${reason ? ` (${reason})` : ""}.`, "info");
}

// The page is going away (a closed tab, another site): the server is told, and nothing
// else is done. Firefox cuts a closing page's pagehide handler off part-way: running the
// whole teardown first (plots redrawn...), it never reached the DELETE, and the session
// waited out its resume grace on the server, holding a seat.
function hangupOnUnload() {
  if (!session.pc && !session.token) return;
  if (session.id) endOnServer(session.id);
  session.hangingUp = true; // a page kept in the back/forward cache: its close is expected
}

// ---------------------------------------------------------------------------------------
// Data channel: client -> server

function send(message) {
  const ch = session.channel;
  if (!ch || ch.readyState !== "open") throw new Error("Not connected");
  ch.send(JSON.stringify(message));
}

function say(text) {
  const clean = String(text ?? "").trim();
  if (!clean) return null;
  const id = newClientId();
  texts.set(id, clean);
  // A say the server refused gets no transcript item (whose removal drops its text): the
  // oldest texts go once there are more than the transcript keeps.
  if (texts.size > MAX_TRANSCRIPT_ITEMS) texts.delete(texts.keys().next().value);
  send({ type: "say", text: clean, id });
  return id;
}

// Ask the agent's brain (`chat`; an LLM when the server has one): the question shows as
// the user's own item, the answer as the agent's (built from its captions, id "reply-...").
function ask(text) {
  const clean = String(text ?? "").trim();
  if (!clean) return null;
  // The id comes back on an error refusing the question (rate_limited, queue_full...),
  // which then marks the question's item.
  const id = `asked-${newClientId()}`;
  send({ type: "chat", text: clean, id });
  const li = ensureUserItem(id);
  li.querySelector(".text").textContent = clean;
  setItemStatus(li, "heard", "you (typed)");
  return id;
}

function interrupt() {
  send({ type: "interrupt" });
}

// ---------------------------------------------------------------------------------------
// Data channel: server -> client events

function onChannelMessage(ev) {
  // Hang up ended the call (its items are cut off and forgotten) while its DELETE is on its
  // way: what the server still says of it would make items anew. So would a message an
  // earlier connection's channel delivers after it was torn down (queued as it closed).
  if (session.hangingUp || ev.target !== session.channel) return;
  let msg;
  const raw = typeof ev.data === "string" ? ev.data : new TextDecoder().decode(ev.data);
  try {
    msg = JSON.parse(raw);
  } catch {
    msg = { type: "invalid", raw };
  }
  if (msg === null || typeof msg !== "object") msg = { type: "invalid", raw };
  if (msg.type === "stats") {
    // Once a second for the whole call: kept apart, bounded, and drawn beside getStats().
    serverStats.push({ t: Date.now(), ...msg });
    if (serverStats.length > MAX_STATS_SAMPLES) serverStats.splice(0, serverStats.length - MAX_STATS_SAMPLES);
    return;
  }
  events.push(msg);
  if (events.length > MAX_EVENTS) events.splice(0, events.length - MAX_EVENTS);
  try {
    handleEvent(msg);
  } finally {
    window.dispatchEvent(new CustomEvent("voiceagent:event", { detail: msg }));
  }
}

function handleEvent(msg) {
  switch (msg.type) {
    case "speech.started": {
      // An id said again in this call (a repeated HTTP say) once its item ended: a new item.
      const old = items.get(String(msg.id ?? ""));
      if (old && ["done", "interrupted", "error"].includes(old.dataset.status)) items.delete(String(msg.id));
      const li = ensureItem(msg.id);
      if (li.dataset.status !== "error") setItemStatus(li, "speaking", "speaking");
      captionRuns.set(String(msg.id ?? ""), `${msg.id}#${++captionRunCount}`);
      break;
    }
    case "speech.segment": {
      const li = ensureItem(msg.id);
      if (!texts.has(msg.id) && msg.text) {
        // Not our text (e.g. said through HTTP): build it from the captions.
        const textEl = li.querySelector(".text");
        textEl.textContent = `${textEl.textContent} ${msg.text}`.trim();
      }
      // The event leaves the server with the segment's first packet; the browser's jitter
      // buffer holds that audio a little longer: show the caption when it is heard.
      const delay = captionDelayMs();
      const key = captionKey(msg.id);
      if (delay > 0) setCaptionLater(key, msg.text ?? "", delay);
      else setCaption(key, msg.text ?? "");
      break;
    }
    case "speech.ended": {
      const li = ensureItem(msg.id);
      // An engine failure (tts_failed, sent just before this end) keeps its mark.
      if (li.dataset.status === "error") { /* kept */ }
      else if (msg.interrupted) setItemStatus(li, "interrupted", "interrupted");
      else setItemStatus(li, "done", "done");
      endCaptions(captionKey(msg.id), captionDelayMs());
      captionRuns.delete(String(msg.id ?? ""));
      break;
    }
    case "user.speech.started": {
      ui.listening.hidden = false;
      const li = ensureUserItem(msg.id);
      setItemStatus(li, "listening", "speaking");
      break;
    }
    case "user.speech.ended": {
      ui.listening.hidden = true;
      // Without speech-to-text (said once, on the first turn) no transcript will come.
      if (session.noStt) setItemStatus(ensureUserItem(msg.id), "empty", "not transcribed");
      else setItemStatus(ensureUserItem(msg.id), "transcribing", "transcribing");
      break;
    }
    case "user.transcript": {
      const li = ensureUserItem(msg.id);
      li.querySelector(".text").textContent = msg.text ?? "";
      if (msg.text) setItemStatus(li, "heard", "you");
      else setItemStatus(li, "empty", "not understood");
      break;
    }
    case "error": {
      if (msg.code === "stt_unavailable") session.noStt = true;
      const id = msg.id === undefined || msg.id === null ? null : String(msg.id);
      const item = id === null ? undefined : items.get(id);
      const turn = item && item.dataset.role === "user" ? item : null;
      if (turn) setItemStatus(turn, "error", msg.code ?? "error");
      const code = msg.code ?? "error";
      // A reply that failed (llm_failed, llm_empty...) names the question it answers: the
      // Ask's item (or the voice turn's) is marked, as no answer will follow it.
      const question = msg.reply_to === undefined || msg.reply_to === null ? null : items.get(String(msg.reply_to));
      if (question && question.dataset.role === "user") setItemStatus(question, "error", code);
      const text = `${code}: ${msg.message ?? ""}`;
      showAlert(`The agent reported an error. ${text}`);
      if (turn) {
        // An Ask or a voice turn refused or failed (rate_limited, stt_failed): its own item
        // is marked, with the message in its title; no second item for the same refusal.
        turn.dataset.code = code;
        turn.title = msg.message ?? "";
      } else if (id !== null && (item || texts.has(id))) {
        // A say of ours refused (rate_limited, empty_text, queue_full...): the box emptied
        // as it went out, so its item shows what was typed, marked with the refusal. An
        // utterance the engine failed on (tts_failed, sent as it ends) is marked so too.
        const li = ensureItem(id);
        setItemStatus(li, "error", code);
        li.dataset.code = code;
        li.title = msg.message ?? "";
      } else {
        appendErrorItem(code, msg.message ?? "");
      }
      break;
    }
    case "session.closed":
      closedByServer(msg.reason);
      break;
    case "invalid":
      appendErrorItem("invalid_event", `Unreadable message from the server: ${String(msg.raw).slice(0, 200)}`);
      break;
    default:
      // Unknown event types are kept in window.voiceAgent.events and otherwise ignored
      // (the contract may grow).
      break;
  }
}

// ---------------------------------------------------------------------------------------
// Transcript

function ensureItem(id) {
  const key = String(id ?? "");
  let li = items.get(key);
  if (li) return li;
  li = document.createElement("li");
  li.className = "utterance";
  li.dataset.id = key;
  const text = document.createElement("span");
  text.className = "text";
  text.textContent = texts.get(key) ?? "";
  const badge = document.createElement("span");
  badge.className = "badge";
  li.append(text, badge);
  items.set(key, li);
  appendTranscript(li);
  return li;
}

// The user's own turn (what the server heard), shown beside the agent's replies.
function ensureUserItem(id) {
  const li = ensureItem(id);
  li.dataset.role = "user";
  return li;
}

function captionDelayMs() {
  for (let i = stats.length - 1; i >= Math.max(0, stats.length - 3); i--) {
    const ms = stats[i].jitterBufferMs;
    if (typeof ms === "number" && Number.isFinite(ms)) return Math.min(Math.max(ms, 0), 300);
  }
  return 0;
}

function setItemStatus(li, status, label) {
  li.dataset.status = status;
  li.querySelector(".badge").textContent = label;
}

function appendErrorItem(code, message) {
  const li = document.createElement("li");
  li.className = "error-item";
  li.dataset.status = "error";
  li.dataset.code = code;
  const text = document.createElement("span");
  text.className = "text";
  text.textContent = message;
  const badge = document.createElement("span");
  badge.className = "badge";
  badge.textContent = code;
  li.append(text, badge);
  appendTranscript(li);
}

function appendTranscript(li) {
  const nearBottom = ui.transcript.scrollHeight - ui.transcript.scrollTop - ui.transcript.clientHeight < 40;
  ui.transcript.append(li);
  ui.transcriptEmpty.hidden = true;
  while (ui.transcript.childElementCount > MAX_TRANSCRIPT_ITEMS) {
    removeTranscriptItem(ui.transcript.firstElementChild);
  }
  if (nearBottom) ui.transcript.scrollTop = ui.transcript.scrollHeight;
}

// The oldest item goes with what the maps keep for it.
function removeTranscriptItem(li) {
  const id = li.dataset.id;
  if (id !== undefined && items.get(id) === li) {
    items.delete(id);
    texts.delete(id);
  }
  li.remove();
}

function captionKey(id) {
  return captionRuns.get(String(id ?? "")) ?? String(id ?? "");
}

function setCaption(id, text) {
  session.captionFor = id;
  ui.caption.textContent = text;
}

// A caption shown after `delay` ms (when its audio leaves the jitter buffer). The timer is
// kept so that the utterance's end or a teardown can cancel it: otherwise a caption could
// appear after its speech ended or the call was hung up, and stay.
function setCaptionLater(id, text, delay) {
  captionTimer(id, () => setCaption(id, text), delay);
}

// `run` after `delay` ms, kept with the utterance's other caption timers until then, so
// that cancelCaptions (its end, a teardown) can stop it.
function captionTimer(id, run, delay) {
  let timers = captionTimers.get(id);
  if (!timers) captionTimers.set(id, (timers = new Set()));
  const timer = setTimeout(() => {
    timers.delete(timer);
    if (!timers.size) captionTimers.delete(id);
    run();
  }, delay);
  timers.add(timer);
}

// The end leaves the server with the utterance's last packet, whose audio the jitter buffer
// still holds: its caption stays until then (cleared at once, the last caption went before
// its sound, and a sentence shorter than the buffer's delay was never shown at all).
function endCaptions(id, delay) {
  const clear = () => {
    cancelCaptions(id);
    if (session.captionFor === id) setCaption(null, "");
  };
  if (delay > 0) captionTimer(id, clear, delay);
  else clear();
}

function cancelCaptions(id) {
  for (const timer of captionTimers.get(id) ?? []) clearTimeout(timer);
  captionTimers.delete(id);
}

function cancelAllCaptions() {
  for (const id of [...captionTimers.keys()]) cancelCaptions(id);
}

// ---------------------------------------------------------------------------------------
// Stats: one sample a second from pc.getStats()

const METRICS = [
  { key: "bitrateKbps", label: "Bitrate", unit: "kbps", digits: 1, scale: 40 },
  { key: "packetsPerSecond", label: "Packets", unit: "/s", digits: 0, scale: 60 },
  { key: "packetsLost", label: "Packets lost", unit: "", digits: 0, scale: 5 },
  { key: "jitterMs", label: "Jitter", unit: "ms", digits: 1, scale: 10 },
  { key: "jitterBufferMs", label: "Jitter buffer", unit: "ms", digits: 0, scale: 60 },
  { key: "rttMs", label: "Round trip", unit: "ms", digits: 1, scale: 10 },
  { key: "audioLevel", label: "Audio level", unit: "", digits: 3, scale: 1, fixed: true },
  { key: "concealedSamples", label: "Concealed samples", unit: "", digits: 0, scale: 100 },
  // The server's side (its `stats` events): what its bitrate controller sees and does.
  { key: "serverBitrateKbps", label: "Server Opus target", unit: "kbps", digits: 1, scale: 40 },
  { key: "serverLossPct", label: "Loss seen by server", unit: "%", digits: 1, scale: 5 },
  { key: "serverFecPct", label: "Server FEC (expected loss)", unit: "%", digits: 0, scale: 10 },
  { key: "serverRttMs", label: "Server round trip", unit: "ms", digits: 1, scale: 10 },
];

function pickStats(report) {
  const byId = new Map();
  let inbound = null;
  let remoteOutbound = null;
  let transport = null;
  const pairs = [];
  report.forEach((s) => {
    byId.set(s.id, s);
    const kind = s.kind ?? s.mediaType;
    if (s.type === "inbound-rtp" && kind === "audio" && !inbound) inbound = s;
    else if (s.type === "remote-outbound-rtp" && kind === "audio" && !remoteOutbound) remoteOutbound = s;
    else if (s.type === "transport" && !transport) transport = s;
    else if (s.type === "candidate-pair") pairs.push(s);
  });
  let pair = transport && transport.selectedCandidatePairId ? byId.get(transport.selectedCandidatePairId) : null;
  if (!pair) pair = pairs.find((p) => p.selected) ?? pairs.find((p) => p.nominated && p.state === "succeeded") ?? null;
  return { inbound, remoteOutbound, pair };
}

function num(v) {
  return typeof v === "number" && Number.isFinite(v) ? v : null;
}

function makeSample({ inbound, remoteOutbound, pair }, prev) {
  const sample = {
    t: Date.now(),
    bitrateKbps: null,
    packetsPerSecond: null,
    packetsReceived: null,
    packetsLost: null,
    jitterMs: null,
    jitterBufferMs: null,
    rttMs: null,
    audioLevel: null,
    concealedSamples: null,
    totalSamplesReceived: null,
  };
  let rtt = remoteOutbound && num(remoteOutbound.roundTripTime) !== null &&
    (remoteOutbound.roundTripTimeMeasurements ?? 1) > 0 ? remoteOutbound.roundTripTime : null;
  if (rtt === null && pair) rtt = num(pair.currentRoundTripTime);
  sample.rttMs = rtt === null ? null : rtt * 1000;
  if (!inbound) return sample;

  sample.packetsReceived = num(inbound.packetsReceived);
  sample.packetsLost = num(inbound.packetsLost);
  sample.jitterMs = num(inbound.jitter) === null ? null : inbound.jitter * 1000;
  sample.audioLevel = num(inbound.audioLevel);
  sample.concealedSamples = num(inbound.concealedSamples);
  sample.totalSamplesReceived = num(inbound.totalSamplesReceived);
  if (prev) {
    const dt = (inbound.timestamp - prev.timestamp) / 1000;
    if (dt > 0) {
      if (num(inbound.bytesReceived) !== null && num(prev.bytesReceived) !== null) {
        sample.bitrateKbps = ((inbound.bytesReceived - prev.bytesReceived) * 8) / dt / 1000;
      }
      if (sample.packetsReceived !== null && num(prev.packetsReceived) !== null) {
        sample.packetsPerSecond = (inbound.packetsReceived - prev.packetsReceived) / dt;
      }
    }
    const dCount = (inbound.jitterBufferEmittedCount ?? 0) - (prev.jitterBufferEmittedCount ?? 0);
    const dDelay = (inbound.jitterBufferDelay ?? 0) - (prev.jitterBufferDelay ?? 0);
    if (dCount > 0) sample.jitterBufferMs = (dDelay / dCount) * 1000;
  }
  return sample;
}

function addServerSide(sample) {
  // The newest server `stats` event, if it is fresh (the server sends one a second).
  const last = serverStats.length ? serverStats[serverStats.length - 1] : null;
  if (!last || sample.t - last.t > 3 * STATS_INTERVAL_MS) return;
  sample.serverBitrateKbps = num(last.bitrate) === null ? null : last.bitrate / 1000;
  sample.serverLossPct = num(last.loss) === null ? null : last.loss * 100;
  sample.serverFecPct = last.fec ? num(last.expected_loss_pct) : 0;
  sample.serverRttMs = num(last.rtt_ms);
}

async function sampleStats() {
  const pc = session.pc;
  if (!pc || session.statsBusy) return;
  session.statsBusy = true;
  try {
    const report = await pc.getStats();
    const picked = pickStats(report);
    if (pc !== session.pc) return;
    const sample = makeSample(picked, session.prevInbound);
    addServerSide(sample);
    if (picked.inbound) session.prevInbound = picked.inbound;
    watchMedia(pc, audioPackets(report));
    stats.push(sample);
    if (stats.length > MAX_STATS_SAMPLES) stats.splice(0, stats.length - MAX_STATS_SAMPLES);
    drawPlots();
  } catch (err) {
    console.warn("getStats failed", err);
  } finally {
    session.statsBusy = false;
  }
}

// Audio stopped for MEDIA_STALL_MS on a connected call (ICE says "disconnected" only after
// ~7 s, "failed" after ~18 s, and never if only the media path broke): ask the server. The
// session gone (404: it was closed, or the server restarted) ends the call; the session
// still there means the media path broke (a network switch, a NAT rebinding): resume it on a
// new connection now, unless the audio came back meanwhile (a stall on the server's side).
// No answer (a network blip, or the server gone) leaves it to ICE: "disconnected", then the
// resume tries, which say so.
function watchMedia(pc, packets) {
  const media = session.media;
  const now = performance.now();
  if (media.pc !== pc || packets !== media.packets) {
    Object.assign(media, { pc, packets, since: now });
    return;
  }
  const state = pc.connectionState ?? pc.iceConnectionState;
  const up = state === "connected" || state === "completed" || state === "disconnected";
  if (!up || media.checking || !session.id || now - media.since < MEDIA_STALL_MS) return;
  media.checking = true;
  checkSession(pc, session.id).finally(() => { media.checking = false; });
}

async function checkSession(pc, id) {
  const status = await sessionStatus(id, apiHeaders());
  if (status === null || pc !== session.pc || session.hangingUp) return; // Hang up's 404
  if (status === 404) {
    teardown("closed");
    showAlert("The session is gone on the server (it was closed, or the server restarted).");
    return;
  }
  if (status !== 200) return;
  let packets = null;
  try {
    packets = audioPackets(await pc.getStats());
  } catch {
    return; // closed meanwhile
  }
  if (pc !== session.pc || packets !== session.media.packets) return;
  // A room seat is not resumed (the server would close it): wait, as the room page does.
  if (session.inRoom) return;
  console.info("no audio for 2 s while the server has the session: resuming it");
  lostConnection();
}

function startStats() {
  stopStats();
  session.statsTimer = setInterval(sampleStats, STATS_INTERVAL_MS);
}

function stopStats() {
  if (session.statsTimer !== null) clearInterval(session.statsTimer);
  session.statsTimer = null;
}

// ---------------------------------------------------------------------------------------
// Sparklines

const plots = [];

function buildPlots() {
  for (const metric of METRICS) {
    const box = document.createElement("figure");
    box.className = "metric";
    box.dataset.metric = metric.key;
    const head = document.createElement("figcaption");
    const label = document.createElement("span");
    label.className = "label";
    label.textContent = metric.label;
    const value = document.createElement("output");
    value.className = "value";
    value.id = `stat-${metric.key}`;
    // An <output> is a polite live region (role status): each figure, updated once a
    // second, would be read out every second. Screen readers read them when asked.
    value.setAttribute("aria-live", "off");
    value.textContent = "—";
    head.append(label, value);
    const canvas = document.createElement("canvas");
    canvas.setAttribute("aria-hidden", "true");
    canvas.height = 48;
    box.append(head, canvas);
    ui.stats.append(box);
    plots.push({ metric, canvas, value });
  }
}

function formatValue(metric, v) {
  if (v === null || v === undefined) return "—";
  const text = v.toFixed(metric.digits);
  return metric.unit ? `${text} ${metric.unit}` : text;
}

function drawPlot({ metric, canvas, value }, points, live) {
  // Between calls (and resume tries) the last figures are history, not the present.
  const current = live && points.length ? points[points.length - 1] : null;
  value.textContent = formatValue(metric, current);

  const dpr = window.devicePixelRatio || 1;
  const cssW = canvas.clientWidth || 200;
  const cssH = canvas.clientHeight || 48;
  if (canvas.width !== Math.round(cssW * dpr) || canvas.height !== Math.round(cssH * dpr)) {
    canvas.width = Math.round(cssW * dpr);
    canvas.height = Math.round(cssH * dpr);
  }
  const ctx = canvas.getContext("2d");
  if (!ctx) return;
  const w = canvas.width;
  const h = canvas.height;
  ctx.clearRect(0, 0, w, h);

  const style = getComputedStyle(canvas);
  const color = style.color || "#4a9";
  const present = points.filter((p) => p !== null);
  let max = metric.scale;
  if (!metric.fixed) for (const p of present) max = Math.max(max, p * 1.15);
  const pad = 2 * dpr;
  const step = (w - 2 * pad) / (PLOT_POINTS - 1);
  const x = (i) => w - pad - (points.length - 1 - i) * step;
  const y = (v) => h - pad - (Math.max(0, Math.min(v, max)) / max) * (h - 2 * pad);

  // Baseline.
  ctx.globalAlpha = 0.25;
  ctx.fillStyle = color;
  ctx.fillRect(0, h - dpr, w, dpr);

  // Area and line, broken where a value is missing.
  ctx.lineWidth = 1.5 * dpr;
  ctx.strokeStyle = color;
  let run = [];
  const flush = () => {
    if (!run.length) return;
    ctx.globalAlpha = 0.18;
    ctx.beginPath();
    ctx.moveTo(x(run[0][0]), h);
    for (const [i, v] of run) ctx.lineTo(x(i), y(v));
    ctx.lineTo(x(run[run.length - 1][0]), h);
    ctx.closePath();
    ctx.fill();
    ctx.globalAlpha = 1;
    ctx.beginPath();
    run.forEach(([i, v], k) => (k ? ctx.lineTo(x(i), y(v)) : ctx.moveTo(x(i), y(v))));
    if (run.length === 1) ctx.arc(x(run[0][0]), y(run[0][1]), dpr, 0, 2 * Math.PI);
    ctx.stroke();
    run = [];
  };
  points.forEach((v, i) => (v === null ? flush() : run.push([i, v])));
  flush();
  ctx.globalAlpha = 1;
}

function drawPlots() {
  const recent = stats.slice(-PLOT_POINTS);
  const live = session.pc !== null;
  for (const plot of plots) {
    drawPlot(plot, recent.map((s) => (s[plot.metric.key] ?? null)), live);
  }
}

function resetPlots() {
  drawPlots();
}

// ---------------------------------------------------------------------------------------
// Wiring

ui.connect.addEventListener("click", () => {
  connect().catch((err) => console.warn("connect failed:", err));
});
ui.hangup.addEventListener("click", hangup);
// Say or Ask from the text box: the box empties once the message went out.
function sendFromBox(action) {
  clearAlert();
  try {
    if (action(ui.text.value)) ui.text.value = "";
  } catch (err) {
    showAlert(describeError(err));
  }
  ui.text.focus();
}
ui.form.addEventListener("submit", (ev) => {
  ev.preventDefault();
  sendFromBox(say);
});
ui.ask.addEventListener("click", () => sendFromBox(ask));
ui.interrupt.addEventListener("click", () => {
  try {
    interrupt();
  } catch (err) {
    showAlert(describeError(err));
  }
});
ui.bargeIn.addEventListener("change", () => {
  if (session.channel && session.channel.readyState === "open") {
    send({ type: "config", barge_in: ui.bargeIn.checked });
  }
});
window.addEventListener("resize", drawPlots);
window.addEventListener("pagehide", hangupOnUnload);
// Back from the back/forward cache after that: its session was deleted, the call is over.
window.addEventListener("pageshow", (event) => {
  if (event.persisted && session.hangingUp) teardown("closed");
});

buildPlots();
drawPlots();
setState("idle");

// Test and console hooks.
window.voiceAgent = {
  get pc() { return session.pc; },
  get channel() { return session.channel; },
  get sessionId() { return session.id; },
  get state() { return ui.state.dataset.state; },
  get micTrack() { return session.micStream ? session.micStream.getAudioTracks()[0] ?? null : null; },
  events,
  stats,
  texts,
  items,
  serverStats,
  connect,
  hangup,
  say,
  ask,
  interrupt,
};
