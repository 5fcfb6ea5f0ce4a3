"""Sessions as the pool sees them: which are at work in a pair (the `sessions` load signal),
and which backend holds each session's (or stored response's) state."""

from __future__ import annotations

from collections import OrderedDict


class SessionActivity:
    """One pair's sessions at work: requests in flight per session, and when each idle
    session's last request ended (oldest first), for the `sessions` load signal; and each
    such session's last prompt, the prefix cache a turn throws away (`reusable_context`)
    once one of its requests has ended."""

    def __init__(self) -> None:
        self.in_flight: dict[str, int] = {}
        self.idle_since: OrderedDict[str, float] = OrderedDict()
        self.requests = 0  # requests in flight that name a session
        self.last_prompt: dict[str, int] = {}  # tokens, of the sessions in flight or idle
        self.served: set[str] = set()  # of those, the ones with a request ended: a cached context

    def begin(self, session: str | None, now: float, idle_s: float,
              prompt_tokens: int = 0) -> None:
        if session is None:
            return
        self._forget_idle(now, idle_s)
        self.idle_since.pop(session, None)
        self.last_prompt[session] = prompt_tokens
        self.in_flight[session] = self.in_flight.get(session, 0) + 1
        self.requests += 1

    def end(self, session: str | None, now: float, idle_s: float) -> None:
        if session is None or session not in self.in_flight:
            return
        self.requests -= 1
        left = self.in_flight[session] - 1
        if left > 0:
            self.in_flight[session] = left
            return
        del self.in_flight[session]
        self.served.add(session)
        self.idle_since[session] = now
        self._forget_idle(now, idle_s)

    def at_work(self, now: float, idle_s: float) -> int:
        """Sessions with a request in flight or idle at most `idle_s`. A read: the sessions
        idle longer are forgotten by the next begin or end, not here."""
        gone = 0
        for since in self.idle_since.values():  # oldest first: stop at the first still here
            if now - since <= idle_s:
                break
            gone += 1
        return len(self.in_flight) + len(self.idle_since) - gone

    def working(self, now: float, idle_s: float) -> list[str]:
        """The sessions at work: in flight, or idle at most `idle_s`. A read, as `at_work`."""
        idle = [s for s, since in self.idle_since.items() if now - since <= idle_s]
        return [*self.in_flight, *idle]

    def reusable_context(self, now: float, idle_s: float) -> int:
        """The prefix cache the traffic would reuse, in tokens: the last prompt of every session
        at work (in flight, or idle at most `idle_s`: its next request extends that prompt)
        that has had a request end (a session's first request has nothing cached yet: a
        turn now continues it, and a cold start has no context to lose). One-off prompts are
        never hit again and count nothing. A read, as `at_work`."""
        return sum(self.last_prompt[s] for s in self.working(now, idle_s) if s in self.served)

    def _forget_idle(self, now: float, idle_s: float) -> None:
        while self.idle_since and now - next(iter(self.idle_since.values())) > idle_s:
            session, _ = self.idle_since.popitem(last=False)
            self.last_prompt.pop(session, None)
            self.served.discard(session)


class SessionMap:
    """Key (a session, a stored response) -> name of the backend that holds its state, least
    recently used forgotten first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, str] = OrderedDict()

    def get(self, key: str | None) -> str | None:
        if key is None or key not in self._entries:
            return None
        self._entries.move_to_end(key)
        return self._entries[key]

    def put(self, key: str | None, backend: str) -> None:
        if key is None or self.capacity == 0:
            return
        self._entries[key] = backend
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


STORED_RESPONSES = 10_000  # response ids remembered for affinity, least recently used forgotten


class ResponseStore:
    def __init__(self, capacity: int = STORED_RESPONSES) -> None:
        self._holders = SessionMap(capacity)

    def holder(self, response_id: str | None) -> str | None:
        """The backend that stored `response_id` (None: not known here)."""
        return self._holders.get(response_id)

    def remember(self, response_id: str | None, backend: str) -> None:
        self._holders.put(response_id, backend)
