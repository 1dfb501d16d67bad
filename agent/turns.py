"""The conversation: the user's turns in, the brain's replies out, barge-in, history.

- The user starts talking (VAD onset): ``user.speech.started``; if the agent is speaking or
  preparing a reply and barge-in is on, the reply is cancelled and the playout buffer
  dropped (the pipeline's interrupt: ``speech.ended`` with ``interrupted: true``, silence
  from the next frame).
- The user's turn ends (enough silence): ``user.speech.ended``; the turn's audio goes to
  speech-to-text; ``user.transcript``; the text takes the turn's place in the history (kept
  when it ends, so turns stay in the order spoken whichever transcript comes back first) and
  the brain answers once the user is silent and no turn's transcript is still to come. A
  turn whose transcript arrives after a newer turn began is not answered on its own: the
  newer turn's reply answers both.
- Replies stream into the pipeline as text deltas (one utterance per reply), so the first
  sentence is spoken while the brain is still writing. Replies run one after another.
- History: each reply keeps a slot in the history at the place it was asked; when its
  utterance ends, the slot gets what was played (the captions whose audio went out), so an
  interrupted reply is cut at the last segment played, and a reply nobody heard leaves none:
  the question it was to answer is open again, and the next turn's reply answers it (that
  turn's transcript may be empty, a cough, or have failed). A reply is asked with the
  history up to its own slot; an earlier reply still being played counts as written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
import numpy.typing as npt

from agent.brain import Brain, EchoBrain, LLMBrain
from agent.conversation_config import VAD_SAMPLE_RATE, ListenSettings, ServiceSettings
from agent.httpservice import ServiceError
from agent.llm import ChatCompletions, Message
from agent.outbox import error_event
from agent.speech import SpeechError, SpeechPipeline, discard_event
from agent.stt import Transcriber
from agent.vad import ActivityEvent

log = logging.getLogger(__name__)
# A reply cut at the text limit ends between words when that drops at most this much.
MAX_WORD_CHARS = 40

Event = dict[str, Any]


@dataclass
class Reply:
    id: str
    slot: Message  # its place in the history; content filled when the utterance ends
    heard: list[str] = field(default_factory=list)  # captions whose audio was played
    written: list[str] = field(default_factory=list)  # deltas the pipeline took
    chars: int = 0  # ... their length in all
    opened: bool = False  # its text stream was opened in the pipeline
    withdrawals: int = 0  # the conversation's count of explicit interrupts when it was asked
    stream_open: bool = False  # ... and not ended yet
    # What it answers: the chat's id or the voice turn's, carried on its errors as
    # ``reply_to`` so that a client can mark the question the reply failed (None: none given).
    reply_to: str | None = None


@dataclass
class ConversationStats:
    turns: int = 0
    transcripts: int = 0
    replies: int = 0
    barge_ins: int = 0
    service_errors: int = 0


class Conversation:
    def __init__(
        self,
        pipeline: SpeechPipeline,
        listen: ListenSettings,
        services: ServiceSettings,
        emit: Callable[[Event], None],
    ) -> None:
        self.pipeline = pipeline
        self.services = services
        self.barge_in = listen.barge_in  # per session (data channel `config`)
        self.history: list[Message] = []
        self.stats = ConversationStats()
        self.user_speaking = False
        # When the user's last turn ended (monotonic): talking is using the session, for its
        # idle timeout, even while the agent stays silent.
        self._user_spoke_at = -math.inf
        self._emit = emit
        self._http: aiohttp.ClientSession | None = None
        self._brain: Brain | None = None
        self._transcriber: Transcriber | None = None
        self._replies: dict[str, Reply] = {}  # by utterance id, until it ends
        self._reply_tasks: list[asyncio.Task[None]] = []  # in order; each waits for the last
        # Replies with no utterance in the pipeline yet (waiting, or the LLM not started).
        self._unopened: set[str] = set()
        # Replies whose history is not asked for yet, in order: trimming keeps their places.
        self._unasked: list[Reply] = []
        self._turn_tasks: set[asyncio.Task[None]] = set()
        self._turn_id: str | None = None
        self._unanswered = False  # a user message in the history that no reply follows yet
        # The last question asked (a chat, or a turn with words in it), by when it was asked
        # (a count: turns by when they ended, as transcripts may come back out of order) and
        # its id: what the next reply answers, named on its errors as ``reply_to``. A cough's
        # turn, whose reply answers the question before it, does not replace it.
        self._questions_asked = 0
        self._question: tuple[int, str | None] = (0, None)
        self._withdrawals = 0  # the client's interrupts so far
        self._closed = False
        self._told_no_stt = False

    # --- services (created on first use: a session that never talks opens no connection) --
    def _client(self) -> aiohttp.ClientSession:
        if self._http is None:
            # No total timeout: aiohttp's default (300 s) also bounds reading the body, and
            # cut a slow but steady LLM stream. Every wait has a bound of its own
            # (--llm-timeout between events, --stt-timeout for a transcription).
            # The environment's proxy is chosen per request (agent/httpservice.py env_proxy).
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        return self._http

    @property
    def brain(self) -> Brain:
        if self._brain is None:
            s = self.services
            self._brain = (
                LLMBrain(ChatCompletions(s, self._client()), s) if s.llm_base_url else EchoBrain()
            )
        return self._brain

    @property
    def brain_name(self) -> str:
        return "llm" if self.services.llm_base_url else "echo"

    def _stt(self) -> Transcriber | None:
        if self._transcriber is None and self.services.stt_base_url:
            self._transcriber = Transcriber(self.services, self._client())
        return self._transcriber

    # --- the user's voice (called by the inbound audio) --------------------------------
    @property
    def agent_active(self) -> bool:
        """Speaking, or preparing a reply that would be spoken."""
        return self.pipeline.busy or any(not t.done() for t in self._reply_tasks)

    @property
    def in_flight(self) -> bool:
        """Speaking, preparing a reply, or transcribing a turn (whose reply comes next):
        what a graceful shutdown lets finish."""
        return self.agent_active or any(not t.done() for t in self._turn_tasks)

    def user_heard_at(self, now: float) -> float:
        """When the user was last heard talking (monotonic): ``now`` while they talk."""
        return now if self.user_speaking else self._user_spoke_at

    def user_started(self, event: ActivityEvent) -> None:
        self._turn_id = f"turn-{uuid.uuid4().hex[:10]}"
        self.user_speaking = True
        self.stats.turns += 1
        if self.barge_in and self.agent_active:
            self._cut()  # not a withdrawal: a question whose reply this cuts unheard stays open
            self.stats.barge_ins += 1
        self._emit({"type": "user.speech.started", "id": self._turn_id})

    def user_ended(self, audio: npt.NDArray[np.float32], event: ActivityEvent) -> None:
        self.user_speaking = False
        # Kept past the turn: one that begins and ends between two of the idle watchdog's
        # looks (about a second apart) still counts.
        self._user_spoke_at = time.monotonic()
        turn_id = self._turn_id or f"turn-{uuid.uuid4().hex[:10]}"
        duration_ms = round(audio.size * 1000 / VAD_SAMPLE_RATE)
        self._emit({"type": "user.speech.ended", "id": turn_id, "duration_ms": duration_ms})
        if self._closed:
            return
        # The turn's place in the history, taken now: a long turn's transcript may come back
        # after a shorter next one's, and must still come before it.
        slot: Message = {"role": "user", "content": ""}
        self.history.append(slot)
        self._trim_history()
        self._questions_asked += 1
        asked = self._questions_asked
        task = asyncio.get_running_loop().create_task(
            self._turn(turn_id, asked, slot, audio, self._withdrawals)
        )
        self._turn_tasks.add(task)
        task.add_done_callback(self._turn_tasks.discard)

    async def _turn(
        self,
        turn_id: str,
        asked: int,
        slot: Message,
        audio: npt.NDArray[np.float32],
        withdrawals: int,
    ) -> None:
        text = await self._transcribe(turn_id, audio)
        if text:
            slot["content"] = text
            self._after_replies(slot)
            # The client's interrupt while this was transcribed (Stop pressed after speaking)
            # withdraws it as it does a question whose reply was being prepared: it stays as
            # context, but no reply is started for it. Answered, the agent began to talk
            # right after the user told it to stop.
            if withdrawals == self._withdrawals:
                self._unanswered = True
                if asked > self._question[0]:  # not an earlier turn whose transcript came late
                    self._question = (asked, turn_id)
        else:
            self._remove(slot)  # nothing said (a cough), or nothing known of it (a failure)
        # The last transcript to come in starts the reply, which covers every unanswered turn
        # before it; an empty or failed one (a cough) still lets an earlier unanswered message
        # be answered, one whose reply this very turn's barge-in cancelled unheard included.
        if self._unanswered and not self.user_speaking and not self._transcribing():
            if self._queue_full():
                # Bounded like chat: replies blocked behind a stream that does not end (the
                # client's own, barge-in off) or a slow brain must not pile up a task per
                # turn. The turn stays unanswered: the next reply answers it too.
                limit = self.pipeline.settings.max_queued_utterances
                self._error(
                    "queue_full",
                    f"{limit} utterances are already waiting: the next reply answers this turn",
                    turn_id,
                )
                return
            self._start_reply(self._question[1])

    def _after_replies(self, slot: Message) -> None:
        """Move a just-transcribed turn after the replies asked for since it ended (a chat
        sent while it was transcribed): none of them saw it (its slot was empty), so it is
        not answered by them. Left before them, the turn's own reply was asked with a
        history ending in the agent's last reply (the echo brain repeated that chat's
        words; an LLM was asked to go on from its own answer). The turns spoken after it
        and still being transcribed move with it: the order spoken is kept."""
        at = next((i for i, m in enumerate(self.history) if m is slot), None)
        if at is None:
            return  # trimmed away
        after = self.history[at + 1 :]
        last = max((i for i, m in enumerate(after) if m["role"] == "assistant"), default=None)
        if last is None:
            return
        pending = [m for m in after[:last] if m["role"] == "user" and not m["content"]]
        moved = [slot, *pending]
        kept = [m for m in after[: last + 1] if not any(m is p for p in pending)]
        self.history[at:] = [*kept, *moved, *after[last + 1 :]]

    def _transcribing(self) -> bool:
        """Another turn's transcript is still to come."""
        current = asyncio.current_task()
        return any(task is not current and not task.done() for task in self._turn_tasks)

    async def _transcribe(self, turn_id: str, audio: npt.NDArray[np.float32]) -> str:
        """The turn's text; empty if it has none, or could not be had (an error says why)."""
        stt = self._stt()
        if stt is None:
            # Said once per session: barge-in still works without STT, and repeating the same
            # error at every turn would only bury the page in alerts.
            if not self._told_no_stt:
                self._told_no_stt = True
                self._error(
                    "stt_unavailable",
                    "no speech-to-text service is configured (--stt-url): turns are not "
                    "transcribed (barge-in still works; said once per session)",
                    turn_id,
                )
            return ""
        try:
            text = await stt.transcribe(audio)
        except ServiceError as exc:
            self._error(exc.code, exc.message, turn_id)
            return ""
        except Exception:  # a bug must not leave the turn unanswered without a word
            log.exception("turn %s: transcription failed", turn_id)
            self._error("internal", "the transcription failed", turn_id)
            return ""
        self.stats.transcripts += 1
        self._emit({"type": "user.transcript", "id": turn_id, "text": text})
        return text

    # --- typed chat (data channel `chat`) ------------------------------------------------
    def ask(self, text: str, asker: str | None = None, question_id: str | None = None) -> str:
        """Answer ``text`` as if the user had said it; returns the reply's utterance id.
        ``asker``: who asked, by name, where several people share the brain (a room): the
        history holds "asker: text", so the brain can tell them apart and address them.
        ``question_id``: the chat's own id, which the reply's errors carry (``reply_to``)."""
        limit = self.pipeline.settings.max_text_chars
        if not text.strip():
            raise SpeechError("empty_text", "'text' is empty")
        if len(text) > limit:
            raise SpeechError("text_too_long", f"'text' is limited to {limit} characters")
        if self._closed:
            raise SpeechError("closed", "the session is closed")
        if self._queue_full():
            limit = self.pipeline.settings.max_queued_utterances
            raise SpeechError("queue_full", f"{limit} utterances are already waiting")
        self._add_user(f"{asker}: {text}" if asker else text, typed=text)
        self._questions_asked += 1
        self._question = (self._questions_asked, question_id)
        return self._start_reply(question_id)

    def _queue_full(self) -> bool:
        """Each reply waits for the ones before it (and costs an LLM call when its turn
        comes): bounded like the utterances queued for ``say``. A reply streaming already is
        one of the pipeline's utterances: counted once."""
        waiting = self.pipeline.queued + len(self._unopened)
        return waiting >= self.pipeline.settings.max_queued_utterances

    # --- barge-in ------------------------------------------------------------------------
    def interrupt(self) -> None:
        """The client's ``interrupt``: cancel every reply being prepared and stop speaking
        from the next frame. The questions they were to answer are withdrawn with them: a
        later cough does not bring them back (a barge-in's cut does not withdraw them)."""
        self._withdrawals += 1
        self._unanswered = False  # a question a barge-in's cut left open: withdrawn too
        self._cut()

    def _cut(self) -> None:
        for task in self._reply_tasks:
            task.cancel()
        self.pipeline.interrupt()  # ends each dropped utterance: observe() settles history

    # --- replies -------------------------------------------------------------------------
    def _add_user(self, text: str, typed: str | None = None) -> None:
        """``typed``: the words alone, where ``text`` names their asker ("Ann: ...", for an
        LLM to tell a room's askers apart): what the echo brain says back."""
        self._unanswered = True
        message = {"role": "user", "content": text}
        if typed is not None and typed != text:
            message["typed"] = typed
        self.history.append(message)
        self._trim_history()

    def _trim_history(self) -> None:
        limit = self.services.max_history_messages
        excess = len(self.history) - limit
        if excess <= 0:
            return
        if self._unasked:
            # A reply not asked yet is asked with the history up to its slot: trimmed away
            # with its question (chats sent together, more than half the limit), it was
            # asked with the whole history, every later question included. Its question,
            # the message before it, is kept until it is asked (the trimming then catches
            # up), within twice the limit.
            slot = self._unasked[0].slot
            at = next((i for i, m in enumerate(self.history) if m is slot), None)
            if at is not None:
                excess = max(min(excess, at - 1), len(self.history) - 2 * limit)
        if excess > 0:
            del self.history[:excess]

    def _start_reply(self, reply_to: str | None = None) -> str:
        self._unanswered = False
        reply = Reply(
            f"reply-{uuid.uuid4().hex[:10]}",
            {"role": "assistant", "content": ""},
            withdrawals=self._withdrawals,
            reply_to=reply_to,
        )
        self.history.append(reply.slot)
        self._reply_tasks = [t for t in self._reply_tasks if not t.done()]
        previous = self._reply_tasks[-1] if self._reply_tasks else None
        task = asyncio.get_running_loop().create_task(self._run_reply(reply, previous))
        self._unopened.add(reply.id)
        self._unasked.append(reply)
        # A done callback, not a finally: a task cancelled before its first step (a chat
        # and an interrupt in one batch of messages) never runs its body at all.
        task.add_done_callback(lambda _: self._settle_unopened(reply))
        self._reply_tasks.append(task)
        self.stats.replies += 1
        return reply.id

    def _request_history(self, reply: Reply) -> list[Message]:
        """What the brain sees: the conversation up to the reply's own place, with no
        pending or empty slots.

        Only what comes before its slot: questions asked after it (chats sent together, a
        turn ended while it waited) have replies of their own. Sent all, the first reply
        answered the last question (the echo brain spoke it once per chat) and each later
        one answered it again.

        A reply before it that is written but still being played (its slot is filled only
        when its utterance ends, and replies are asked for as soon as the previous one is
        written) is sent as written: otherwise the brain answered the next question without
        knowing its own answer to the one before. Were it cut, this reply would be too (a
        barge-in or ``interrupt`` cancels every reply), so that is what the user hears.
        """
        # As the pipeline speaks it: without the pieces it drops (an emoji line, Cyrillic
        # under ChatTTS), which the history will not hold once the reply has played either.
        playing = {
            id(r.slot): self.pipeline.spoken_text("".join(r.written))
            for r in self._replies.values()
        }
        messages: list[Message] = []
        for message in self.history:
            if message is reply.slot:
                break
            # A turn's slot stays empty until its transcript; a reply's until it is played.
            content = message["content"] or playing.get(id(message), "")
            if content.strip():
                request = {"role": message["role"], "content": content}
                if "typed" in message:
                    request["typed"] = message["typed"]
                messages.append(request)
        return messages

    async def _run_reply(self, reply: Reply, previous: asyncio.Task[None] | None) -> None:
        try:
            if previous is not None:
                await asyncio.wait([previous])  # one reply at a time, in order
            history = self._request_history(reply)
            self._asked(reply)
            # The answer's start while it has nothing to say aloud: the newlines many models
            # send before tool calls, an emoji. Opened on it, an answer of only that was an
            # utterance of nothing (no caption, nothing heard, so it left no answer in the
            # history either). Held until there are words, then sent whole.
            pending = ""
            # Closed when left early (the break below): its HTTP stream with it.
            async with contextlib.aclosing(self.brain.reply(history)) as deltas:
                async for delta in deltas:
                    if not reply.opened:
                        pending += delta
                        # The new delta alone: what is speakable is decided character by
                        # character (agent/engine.py); checking every longer ``pending``
                        # whole cost quadratic time (2 s of loop for 5000 emoji).
                        if not self.pipeline.speakable(delta):
                            if len(pending) > self.pipeline.settings.max_text_chars:
                                break  # nothing to say however long it goes on: llm_empty
                            continue
                        delta, pending = pending, ""
                        limit = self.pipeline.settings.max_text_chars
                        if len(delta) > limit and not self.pipeline.speakable(delta[:limit]):
                            # Its first words come past the text limit (a rule of 5000
                            # dashes first): nothing of it may be said, llm_empty. Opened
                            # on the dashes it was a silent utterance no end settled, and
                            # "spoken up to the limit" (found by review).
                            break
                        # Another writer's stream (the client's text.delta, a room
                        # participant's) is open: the reply waits for its end, as a say
                        # queues behind it.
                        await self.pipeline.stream_free(reply.id)
                    delta, past_limit = self._within_limit(reply, delta)
                    # The reply owns its stream: a client's text.end or id-less delta cannot
                    # end or join it, and its own end cannot end a client's stream.
                    if delta:  # empty: the limit was reached exactly by the last one
                        self.pipeline.text_delta(delta, reply.id, owner=reply.id)
                        reply.written.append(delta)
                        reply.chars += len(delta)
                        if not reply.opened:
                            reply.opened = reply.stream_open = True
                            self._unopened.discard(reply.id)
                            self._replies[reply.id] = reply
                    if past_limit:
                        limit = self.pipeline.settings.max_text_chars
                        raise SpeechError(
                            "text_too_long",
                            f"the reply was spoken up to the limit of {limit} characters",
                        )
            if not reply.opened:
                # The brain answered with no text (an empty completion, only tool calls):
                # nothing will be spoken, and the client, who asked, would hear of nothing.
                self._reply_error(
                    reply, "llm_empty", "the language model's answer had nothing to say aloud"
                )
            self._close_stream(reply)
        except asyncio.CancelledError:
            # Barge-in: the pipeline dropped the stream and discards its further deltas
            # until text.end; end it so the next stream starts clean.
            self._close_stream(reply)
            raise
        except (ServiceError, SpeechError) as exc:
            self.stats.service_errors += isinstance(exc, ServiceError)
            # stream_refused: the engine failed on the reply's speech, which ended it; that
            # error (tts_failed...) goes out with its end, and the rest is not asked for.
            if not (isinstance(exc, SpeechError) and exc.code == "stream_refused"):
                self._reply_error(reply, exc.code, exc.message)
            self._close_stream(reply)  # what was already said plays to its end
        except Exception:  # a bug must not end the session; it is logged and reported
            log.exception("reply %s failed", reply.id)
            self._reply_error(reply, "internal", "the reply failed")
            self._close_stream(reply)
        finally:
            if not reply.opened:
                self._drop_slot(reply)

    def _within_limit(self, reply: Reply, delta: str) -> tuple[str, bool]:
        """``delta`` cut to what the reply may still say (the text limit, max_text_chars),
        between words where it can be, and whether it was cut. One delta past the limit (a
        whole JSON answer is one) was refused whole: nothing at all was said."""
        room = self.pipeline.settings.max_text_chars - reply.chars
        if len(delta) <= room:
            return delta, False
        head = delta[:room]
        # Back to the last space, if that drops a word's worth at most (an LLM's token
        # " world" has its only one first: the cut is that space, not "wo"). Else at the
        # limit itself: text with no spaces (Chinese) after a first line would lose all but
        # that line, and a reply opened on "\n\n" alone would say nothing.
        gap = max(head.rfind(" "), head.rfind("\n"))
        cut = head[: gap + 1]
        if (
            gap < 0
            or len(head) - len(cut) > MAX_WORD_CHARS
            or (not reply.opened and not self.pipeline.speakable(cut))
        ):
            cut = head
        return cut, True

    def _asked(self, reply: Reply) -> None:
        if any(r is reply for r in self._unasked):
            self._unasked = [r for r in self._unasked if r is not reply]
            self._trim_history()  # what was kept for it

    def _settle_unopened(self, reply: Reply) -> None:
        self._unopened.discard(reply.id)
        if not reply.opened:
            self._drop_slot(reply)  # idempotent: the body's finally may have done it
        self._asked(reply)  # cancelled before it was asked: its place need not be kept

    def _close_stream(self, reply: Reply) -> None:
        if reply.stream_open:
            reply.stream_open = False
            with contextlib.suppress(SpeechError):
                self.pipeline.text_end(owner=reply.id)

    def _drop_slot(self, reply: Reply) -> None:
        # A withdrawn reply's question stays in the history, as context for the next one
        # ("and in London?" after a withdrawn "the weather in Paris?"), as OpenAI's Realtime
        # API and pipecat keep an interrupted turn's question; it is only not reopened.
        if self._remove(reply.slot) and reply.withdrawals == self._withdrawals:
            self._reopen()

    def _remove(self, slot: Message) -> bool:
        for i, message in enumerate(self.history):
            if message is slot:
                del self.history[i]
                return True
        return False

    def _reopen(self) -> None:
        """A reply nobody heard answered nothing: the user's last message is open again
        (the next turn's reply answers it, even if that turn is only a cough)."""
        for message in reversed(self.history):
            if message["role"] == "assistant":
                return  # a later reply (played, or still to come) answers it
            if message["content"]:  # not a turn still being transcribed: that one tells
                self._unanswered = True
                return

    # --- what was played (every event the session sends passes here) ---------------------
    def observe(self, event: Event) -> None:
        """Every event on its way out. A reply's error from the pipeline (``tts_failed``
        while it is spoken) is tagged with what it answers, as the reply's own errors are."""
        kind = event.get("type")
        if kind not in ("speech.segment", "speech.ended", "error"):
            return
        reply = self._replies.get(event.get("id", ""))
        if reply is None:
            return
        if kind == "error":
            if reply.reply_to is not None:
                event.setdefault("reply_to", reply.reply_to)
            return
        if kind == "speech.segment":
            reply.heard.append(str(event.get("text", "")))
            return
        del self._replies[reply.id]
        heard = " ".join(t.strip() for t in reply.heard if t.strip())
        if heard:
            reply.slot["content"] = heard
        else:
            self._drop_slot(reply)

    # --- helpers -------------------------------------------------------------------------
    def _error(self, code: str, message: str, request_id: str | None) -> None:
        self._emit(error_event(code, message, request_id))

    def _reply_error(self, reply: Reply, code: str, message: str) -> None:
        """A reply's error: its own id (which the client may never have seen: a reply that
        failed before it spoke has no ``speech.started``) and what it answers."""
        event = error_event(code, message, reply.id)
        if reply.reply_to is not None:
            event["reply_to"] = reply.reply_to
        self._emit(event)

    def snapshot(self) -> dict[str, Any]:
        return {
            "brain": self.brain_name,
            "barge_in": self.barge_in,
            "turns": self.stats.turns,
            "transcripts": self.stats.transcripts,
            "replies": self.stats.replies,
            "barge_ins": self.stats.barge_ins,
            "history_messages": len(self.history),
        }

    def discard(self) -> None:
        """Close a conversation that never ran (nothing asked, nothing heard): no task to
        wait for, no HTTP client yet; only its link to whoever gets its events goes."""
        if self._reply_tasks or self._turn_tasks or self._http is not None:
            raise RuntimeError("a conversation that ran is closed with close()")
        self._closed = True
        self._emit = discard_event

    async def close(self) -> None:
        self._closed = True
        tasks = [*self._reply_tasks, *self._turn_tasks]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._http is not None:
            await self._http.close()
        self._emit = discard_event  # as SpeechPipeline.close(): no cycle with the session
