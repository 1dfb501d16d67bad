// Browser client for voice rooms: join a room by name, hear the agent and every other
// speaker, see who is in the room and who is talking, mute/unmute, instruct the agent.
// Plain ES module, no build step. Wire contract: README "Rooms".
//
// Media layout (the server's): audio transceiver 0 carries the agent (and our microphone
// the other way); transceivers 1..slots are receive-only "slots", slot s carrying the
// person who holds speaker slot s. They are offered up front, so later speakers need no
// renegotiation.

import { MEDIA_STALL_MS, audioPackets, sessionStatus } from "./audiowatch.js";

const TOKEN = new URLSearchParams(location.search).get("token");
// ?slots=N overrides the number of speaker slots offered; else the server's
// --room-max-speakers (GET /ice-servers "roomSlots"): fewer, and the higher slots' speakers
// would be listed, shown talking, and never heard.
const SLOTS_PARAM = new URLSearchParams(location.search).get("slots");
const DEFAULT_SLOTS = 4;
// ?processing=off: no echo cancellation / noise suppression / gain control on the microphone
// (music, test tones; a steady tone is what noise suppression removes).
const RAW_MIC = new URLSearchParams(location.search).get("processing") === "off";
const ICE_GATHER_TIMEOUT_MS = 2000;
const LEAVE_WAIT_MS = 1000; // how long Leave waits for DELETE /sessions/{id}
const LEVEL_INTERVAL_MS = 100;
// A meeting runs for hours and speaker.active flips with every burst of speech: the page
// keeps the newest events only (as the main page does).
const MAX_EVENTS = 1000;

const $ = (id) => document.getElementById(id);
// The access token goes along to the 1:1 page, as it came here from it.
if (TOKEN) $("call-link").search = `?token=${encodeURIComponent(TOKEN)}`;
const ui = {
  state: $("state"), me: $("me"), alert: $("alert"), joinForm: $("join-form"),
  room: $("room-name"), name: $("display-name"), speak: $("speak"), join: $("join"),
  leave: $("leave"), mute: $("mute"), people: $("people"), sayForm: $("say-form"),
  text: $("text"), say: $("say"), ask: $("ask"), interrupt: $("interrupt"), caption: $("caption"),
  players: $("players"),
};

const call = { pc: null, channel: null, mic: null, sessionId: null, me: null, muted: false };
let generation = 0; // bumped by every join and teardown: a join left meanwhile stops
let joining = false; // a join is under way: Join again does nothing (one call, not two)
let leaving = false; // Leave is telling the server: the connection closing is expected
const people = new Map(); // participant id -> participant (from room.state / events)
const events = []; // the data-channel events, in order: the newest MAX_EVENTS
const tracks = []; // index (0 = agent, 1.. = slots) -> { analyser, freq, level }
let audioContext = null;
// Whether the room's agent takes our instructions (room.state): in a room where only hosts
// may instruct it (--room-instruct hosts), everyone else's would all be refused.
let mayInstruct = true;
const TEXT_HINT = ui.text.placeholder;

function headers(extra = {}) {
  return TOKEN ? { ...extra, Authorization: `Bearer ${TOKEN}` } : extra;
}

function setState(name) {
  ui.state.textContent = name;
  ui.state.dataset.state = name;
}

function showAlert(text) {
  ui.alert.textContent = text;
  ui.alert.hidden = !text;
}

function setJoined(joined) {
  ui.join.disabled = joined;
  ui.leave.disabled = !joined;
  // What a join was made with: changing it during the call would change nothing.
  ui.room.disabled = joined;
  ui.name.disabled = joined;
  ui.speak.disabled = joined;
  setChannelOpen(joined && channelOpen());
}

// Say, Ask, Interrupt and Mute go over the data channel: usable once it is open, which is
// a moment after the answer is applied (DTLS, then SCTP). Before, what they sent was lost.
function setChannelOpen(open) {
  ui.mute.disabled = !open || !call.mic || call.mic.readyState === "ended";
  const instruct = open && mayInstruct;
  ui.text.disabled = !instruct;
  ui.say.disabled = !instruct;
  ui.ask.disabled = !instruct;
  ui.interrupt.disabled = !instruct;
  ui.text.placeholder = mayInstruct ? TEXT_HINT : "Only the room's hosts may instruct its agent";
}

function channelOpen() {
  return call.channel !== null && call.channel.readyState === "open";
}

// --- who is here ---------------------------------------------------------------------
// The list is a live region: a screen reader reads out each row added and each text
// changed. So rows are kept and changed in place, only where something changed (a list
// rebuilt on every event was read out whole with every caption).
function renderPeople() {
  const agent = people.get("agent");
  const rows = [agent, ...[...people.values()].filter((p) => p.participant_id !== "agent")]
    .filter(Boolean);
  const old = new Map([...ui.people.children].map((li) => [li.dataset.id, li]));
  rows.forEach((p, i) => {
    let li = old.get(p.participant_id);
    old.delete(p.participant_id);
    if (!li) {
      li = document.createElement("li");
      li.dataset.id = p.participant_id;
    }
    li.dataset.speaking = p.speaking ? "true" : "false";
    li.dataset.muted = p.muted ? "true" : "false";
    const you = p.participant_id === call.me ? " (you)" : "";
    const label = p.name || (p.participant_id === "agent" ? "Agent" : p.participant_id);
    const role = p.role === "speaker" ? "🎤" : p.role === "agent" ? "🤖" : "🎧";
    const state = p.muted ? " · muted" : p.speaking ? " · talking" : "";
    const text = `${role} ${label}${you}${state}`;
    if (li.textContent !== text) li.textContent = text;
    li.style.fontWeight = p.speaking ? "bold" : "normal";
    if (ui.people.children[i] !== li) ui.people.insertBefore(li, ui.people.children[i] ?? null);
  });
  for (const li of old.values()) li.remove();
}

function handleEvent(msg) {
  events.push(msg);
  if (events.length > MAX_EVENTS) events.splice(0, events.length - MAX_EVENTS);
  switch (msg.type) {
    case "room.state":
      call.me = msg.participant_id;
      ui.me.textContent = `${msg.room} · ${msg.participant_id}`;
      people.clear();
      people.set("agent", { participant_id: "agent", role: "agent", name: "Agent",
                            speaking: Boolean(msg.agent_speaking) });
      for (const p of msg.participants) people.set(p.participant_id, p);
      mayInstruct = msg.instruct !== "hosts" || Boolean(people.get(call.me)?.host);
      if (!joining) setChannelOpen(channelOpen()); // else join() does it
      break;
    case "participant.joined":
    case "participant.updated":
      people.set(msg.participant_id, { ...people.get(msg.participant_id), ...msg });
      break;
    case "participant.left":
      people.delete(msg.participant_id);
      break;
    case "speaker.active": {
      const p = people.get(msg.participant_id);
      if (p) p.speaking = msg.active;
      break;
    }
    case "speech.segment":
      ui.caption.textContent = msg.text;
      break;
    case "speech.ended":
      ui.caption.textContent = "";
      break;
    case "error":
      showAlert(`${msg.code}: ${msg.message}`);
      break;
    case "session.closed": // the server ends our seat (e.g. idle_timeout) and closes next
      ended(call.pc, "closed", `The room closed your session (${msg.reason}).`);
      break;
    default:
      break;
  }
  renderPeople();
}

// --- media ---------------------------------------------------------------------------
function play(index, track) {
  const stream = new MediaStream([track]);
  // An element must play a remote stream for Chrome to deliver its audio to WebAudio too.
  const audio = document.createElement("audio");
  audio.autoplay = true;
  audio.srcObject = stream;
  audio.dataset.index = String(index);
  ui.players.append(audio);
  audio.play().catch(() => {
    // Blocked by the browser's autoplay policy (Safari's, or a join made without a click):
    // the next click plays every player that is still paused.
    showAlert("Click anywhere on the page to hear the room.");
    document.addEventListener("click", playBlocked, { once: true });
  });
  audioContext = audioContext || new AudioContext();
  const analyser = audioContext.createAnalyser();
  analyser.fftSize = 8192;
  const source = audioContext.createMediaStreamSource(stream);
  source.connect(analyser);
  tracks[index] = { source, analyser, freq: 0, level: -Infinity };
}

function playBlocked() {
  audioContext?.resume(); // made with the players, under the same policy: the meters too
  const paused = [...ui.players.querySelectorAll("audio")].filter((audio) => audio.paused);
  Promise.all(paused.map((audio) => audio.play()))
    .then(() => { if (/hear the room/.test(ui.alert.textContent)) showAlert(""); })
    .catch(() => document.addEventListener("click", playBlocked, { once: true }));
}

// The loudest frequency and its level on each received track (what tests and meters read).
function measure() {
  for (const t of tracks) {
    if (!t) continue;
    const bins = new Float32Array(t.analyser.frequencyBinCount);
    t.analyser.getFloatFrequencyData(bins);
    let best = 0;
    for (let i = 1; i < bins.length; i++) if (bins[i] > bins[best]) best = i;
    t.level = bins[best];
    t.freq = (best * audioContext.sampleRate) / t.analyser.fftSize;
  }
}
setInterval(measure, LEVEL_INTERVAL_MS);

function waitForIce(pc) {
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ICE_GATHER_TIMEOUT_MS);
    pc.addEventListener("icegatheringstatechange", () => {
      if (pc.iceGatheringState === "complete") { clearTimeout(timer); resolve(); }
    });
  });
}

// Join: one call at a time. Every await is followed by a check that Leave (or a lost
// connection) did not end this join meanwhile; if it did, the join stops there.
async function join(room, name, speak) {
  if (joining || call.pc) return;
  joining = true;
  ui.join.disabled = true; // a second click on Join would make a second, orphaned call
  // Leave gives up a join under way (a microphone prompt left unanswered, a slow server):
  // every step of connectTo checks stale(), and a seat made meanwhile is deleted.
  ui.leave.disabled = false;
  ui.room.disabled = ui.name.disabled = ui.speak.disabled = true;
  showAlert("");
  setState("connecting");
  const gen = ++generation;
  const stale = () => gen !== generation;
  try {
    await connectTo(room, name, speak, stale);
    if (stale()) return;
    joining = false;
    setJoined(true);
  } catch (err) {
    if (stale()) return; // ended meanwhile: teardown closed what this join had opened
    showAlert(err.message || String(err));
    await leave();
    throw err;
  }
}

function slotCount(offered) {
  const wanted = Number(SLOTS_PARAM ?? offered ?? DEFAULT_SLOTS);
  return Number.isInteger(wanted) && wanted >= 0 ? wanted : DEFAULT_SLOTS;
}

async function connectTo(room, name, speak, stale) {
  let servers = [];
  let roomSlots;
  try {
    const resp = await fetch("/ice-servers", { headers: headers() });
    if (resp.ok) ({ iceServers: servers = [], roomSlots } = await resp.json());
  } catch (err) {
    console.warn("no /ice-servers", err);
  }
  if (stale()) return;
  if (speak) {
    const audio = RAW_MIC
      ? { echoCancellation: false, noiseSuppression: false, autoGainControl: false }
      : true;
    let stream;
    try {
      stream = await navigator.mediaDevices.getUserMedia({ audio });
    } catch (err) {
      throw new Error(`Microphone unavailable (${err.name || err}): untick "speak" to join as a listener.`);
    }
    if (stale()) {
      for (const track of stream.getTracks()) track.stop(); // else the microphone stays on
      return;
    }
    const mic = stream.getAudioTracks()[0];
    call.mic = mic;
    // Unplugged or its permission withdrawn mid-call: the room no longer hears us.
    mic.addEventListener("ended", () => {
      if (call.mic !== mic) return; // Leave's own stop, or an earlier call's
      ui.mute.disabled = true;
      showAlert("Your microphone stopped (unplugged, or its permission withdrawn): the room no longer hears you.");
    });
  }
  const pc = new RTCPeerConnection({ iceServers: servers });
  call.pc = pc;
  const order = [];
  order.push(call.mic ? pc.addTransceiver(call.mic, { direction: "sendrecv" })
                      : pc.addTransceiver("audio", { direction: "recvonly" }));
  for (let i = 0; i < slotCount(roomSlots); i++) order.push(pc.addTransceiver("audio", { direction: "recvonly" }));
  pc.addEventListener("track", (ev) => play(order.indexOf(ev.transceiver), ev.track));
  pc.addEventListener("connectionstatechange", () => onConnectionState(pc));
  const channel = pc.createDataChannel("agent");
  call.channel = channel;
  // Only this call's: an event the old channel delivers after Leave (already queued when it
  // closed) would fill the people list and "me" of a page no longer in the room.
  channel.addEventListener("message", (ev) => {
    if (channel === call.channel) handleEvent(JSON.parse(ev.data));
  });
  channel.addEventListener("open", () => {
    if (channel === call.channel && !joining) setChannelOpen(true); // else join() does it
  });
  // The server closes the channel when it ends our seat (or the server goes away).
  channel.addEventListener("close", () => ended(pc, "closed", "The room connection closed."));
  await pc.setLocalDescription(await pc.createOffer());
  await waitForIce(pc);
  if (stale()) return;
  const body = { sdp: pc.localDescription.sdp, type: "offer", room };
  if (name) body.name = name;
  const res = await fetch("/offer", {
    method: "POST",
    headers: headers({ "Content-Type": "application/json" }),
    body: JSON.stringify(body),
  });
  const data = await res.json().catch(() => null);
  if (!res.ok) {
    const err = (data && data.error) || { code: `http_${res.status}`, message: res.statusText };
    // A refusal with Retry-After (server_full, not_ready...) says when to try again, as
    // rate_limited's message does itself.
    const after = Number(res.headers.get("Retry-After"));
    const hint = after > 0 && !/retry in/i.test(err.message) ? `; retry in ${after} s` : "";
    throw new Error(`${err.code}: ${err.message}${hint}`);
  }
  if (stale()) {
    deleteSession(data.session_id); // the server made a seat nobody will use
    return;
  }
  call.sessionId = data.session_id;
  call.me = data.participant_id;
  await pc.setRemoteDescription({ type: "answer", sdp: data.sdp });
}

function onConnectionState(pc) {
  if (pc !== call.pc) return; // an earlier call's
  // "disconnected" may recover by itself; the browser turns it into "failed" if not.
  if (pc.connectionState === "connected" || pc.connectionState === "disconnected") {
    setState(pc.connectionState);
  }
  if (pc.connectionState === "failed" || pc.connectionState === "closed") {
    ended(pc, pc.connectionState, `The connection to the room ${pc.connectionState}.`);
  }
}

// The server can vanish without a word (killed, its machine gone): no channel close, and
// Chromium calls the connection failed only ~18 s later. Its audio stops at once, though
// (audiowatch.js), so a call whose audio stopped for MEDIA_STALL_MS asks the server about
// its seat: gone (404) ends the call now; no answer for SERVER_GONE_MS ends it too (a
// network blip answers again sooner); still there, the call waits (the media path may come
// back, or ICE fails). A seat is not resumed, unlike the main page's session.
const WATCH_INTERVAL_MS = 1000;
const SERVER_GONE_MS = 4000;
const watch = { pc: null, packets: -1, heardAt: 0, unreachableSince: null, checking: false };

async function watchCall() {
  const pc = call.pc;
  if (!pc || joining || leaving || !call.sessionId || watch.checking) return;
  if (watch.pc !== pc) {
    Object.assign(watch, { pc, packets: -1, heardAt: performance.now(), unreachableSince: null });
  }
  let packets;
  try {
    packets = audioPackets(await pc.getStats());
  } catch {
    return; // closed meanwhile
  }
  const now = performance.now();
  if (pc !== call.pc) return;
  if (packets !== watch.packets) {
    Object.assign(watch, { packets, heardAt: now, unreachableSince: null });
    return;
  }
  if (now - watch.heardAt < MEDIA_STALL_MS) return;
  watch.checking = true;
  try {
    await checkSeat(pc, call.sessionId, now);
  } finally {
    watch.checking = false;
  }
}

async function checkSeat(pc, sessionId, now) {
  const status = await sessionStatus(sessionId, headers());
  if (pc !== call.pc) return;
  if (status === 404) {
    ended(pc, "closed", "Your seat in the room is gone (the server closed it or restarted).");
  } else if (status !== null) {
    watch.unreachableSince = null;
  } else {
    watch.unreachableSince ??= now;
    if (performance.now() - watch.unreachableSince >= SERVER_GONE_MS) {
      ended(pc, "failed", "The server stopped answering: the call ended.");
    }
  }
}
setInterval(watchCall, WATCH_INTERVAL_MS);

// The call ended without Leave (the server went away, the connection failed, the server
// closed our session): say so and go back to the not-joined state, so that the page does
// not look joined with nothing behind it.
function ended(pc, state, message) {
  if (!pc || pc !== call.pc || leaving) return; // no call, an earlier one, or Leave's
  const id = call.sessionId;
  teardown(state);
  // A failed connection cannot tell the server it closed: without a DELETE the seat (and
  // its slot, heard by everyone as silence) stayed until the server's RTCP timeout. A
  // server that is gone answers nothing, and that is all right.
  if (state === "failed" && id) deleteSession(id, { keepalive: true });
  showAlert(message);
}

function deleteSession(id, options = {}) {
  const url = `/sessions/${encodeURIComponent(id)}`;
  return fetch(url, { method: "DELETE", headers: headers(), ...options }).catch(() => {});
}

// Leave: tell the server first (DELETE /sessions/{id}, at most LEAVE_WAIT_MS), then close
// locally; closing first lets the server drop the seat by itself, and the DELETE gets 404.
// Also ends a join still under way.
async function leave() {
  const id = call.sessionId;
  const gen = generation;
  if (id) {
    leaving = true;
    ui.leave.disabled = true;
    await deleteSession(id, { signal: AbortSignal.timeout(LEAVE_WAIT_MS) });
  }
  if (gen === generation) teardown("idle");
}

// Close whatever call exists (joined or still joining) and reset the page to not-joined.
function teardown(state) {
  generation += 1;
  joining = false;
  leaving = false;
  const { pc, mic } = call;
  Object.assign(call, { pc: null, channel: null, mic: null, sessionId: null, me: null, muted: false });
  mayInstruct = true;
  if (pc) pc.close(); // call.pc is already null: its channel's close is not news
  if (mic) mic.stop();
  // The page's one AudioContext outlives the call: its nodes of this call's tracks would
  // stay connected, holding the ended streams and their 8192-point analysers, per join.
  for (const t of tracks) {
    if (t) { t.source.disconnect(); t.analyser.disconnect(); }
  }
  tracks.length = 0;
  ui.players.replaceChildren();
  people.clear();
  renderPeople();
  ui.me.textContent = "";
  ui.caption.textContent = "";
  ui.mute.textContent = "Mute";
  ui.mute.setAttribute("aria-pressed", "false");
  setJoined(false);
  setState(state);
}

// Whether the message went out; if not, the user is told (nothing is dropped silently).
function send(message) {
  if (!call.channel || call.channel.readyState !== "open") {
    showAlert("Not connected to the room: nothing was sent.");
    return false;
  }
  call.channel.send(JSON.stringify(message));
  return true;
}

function setMuted(muted) {
  // The room is told first: a microphone muted here but shown as live to the others (or
  // the reverse) would be worse than the click doing nothing.
  if (!call.mic || !send({ type: "mute", muted })) return;
  call.muted = muted;
  call.mic.enabled = !muted; // the browser then sends silence: others see us stop talking
  ui.mute.textContent = muted ? "Unmute" : "Mute";
  ui.mute.setAttribute("aria-pressed", String(muted));
}

ui.joinForm.addEventListener("submit", (ev) => {
  ev.preventDefault();
  // join() shows its own errors.
  join(ui.room.value.trim(), ui.name.value.trim(), ui.speak.checked)
    .catch((err) => console.warn("join failed:", err));
});
ui.leave.addEventListener("click", leave);
ui.mute.addEventListener("click", () => setMuted(!call.muted));
// Say: the agent speaks the text as it is. Ask: the room's brain answers it (`chat`).
// The box empties only once the text went out: unsent, it stays for another try.
function sendText(type) {
  const text = ui.text.value.trim();
  if (text && !send({ type, text })) return;
  ui.text.value = "";
}
ui.sayForm.addEventListener("submit", (ev) => {
  ev.preventDefault();
  sendText("say");
});
ui.ask.addEventListener("click", () => sendText("chat"));
ui.interrupt.addEventListener("click", () => send({ type: "interrupt" }));
window.addEventListener("pagehide", () => {
  if (call.sessionId) {
    fetch(`/sessions/${encodeURIComponent(call.sessionId)}`,
          { method: "DELETE", headers: headers(), keepalive: true }).catch(() => {});
  }
});

// The token's "room" claim, or null. Read without checking the signature: the server does
// that; the page only needs to know which room to ask for.
function roomOfToken(token) {
  try {
    const part = token.split(".")[1].replace(/-/g, "+").replace(/_/g, "/");
    const bytes = Uint8Array.from(atob(part), (c) => c.charCodeAt(0));
    const claims = JSON.parse(new TextDecoder().decode(bytes));
    return typeof claims.room === "string" ? claims.room : null;
  } catch {
    return null; // no token, or not a JWT: the server will say so at Join
  }
}

// For tests and the console.
window.voiceRoom = { events, tracks, people, call, join, leave, send, setMuted };
const params = new URLSearchParams(location.search);
if (params.get("room")) ui.room.value = params.get("room");
// A token minted for one room (`voice-agent token --room standup`) joins that room only:
// the box shows it and cannot be changed (it said "lobby", and Join was refused 403).
const tokenRoom = roomOfToken(TOKEN);
if (tokenRoom !== null) {
  ui.room.value = tokenRoom;
  ui.room.readOnly = true;
}
if (params.get("name")) ui.name.value = params.get("name");
