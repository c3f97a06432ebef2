"""Finding a request's stop strings in its generated text, at a cost per character that does not grow with
how many stop strings there are."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class StopMatcher:
    """An Aho-Corasick automaton of a request's stop strings, built once and shared by its n sequences.

    A sequence keeps only a state (an int): the longest tail of its text that begins some stop string. Feeding
    a character follows at most a few links, amortized, whatever the number of stop strings, and the state's
    depth is exactly the text a stream must hold back because a stop string may be starting in it.
    """

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = list(dict.fromkeys(s for s in stops if s))  # "" would match everywhere
        self._next: list[dict[str, int]] = [{}]
        self._fail = [0]
        self._depth = [0]
        # The length of the longest stop string that ends at a state (0: none). At one end position the
        # longest one starts first, so it wins a tie between stop strings that end together.
        self._match = [0]
        for stop in self.stops:
            state = 0
            for ch in stop:
                if ch not in self._next[state]:
                    self._next[state][ch] = len(self._next)
                    self._next.append({})
                    self._fail.append(0)
                    self._depth.append(self._depth[state] + 1)
                    self._match.append(0)
                state = self._next[state][ch]
            self._match[state] = len(stop)
        queue = deque(self._next[0].values())  # breadth first: a state's fail link is shallower than it
        while queue:
            state = queue.popleft()
            for ch, child in self._next[state].items():
                fail = self._fail[state]
                while fail and ch not in self._next[fail]:
                    fail = self._fail[fail]
                self._fail[child] = self._next[fail].get(ch, 0)
                self._match[child] = self._match[child] or self._match[self._fail[child]]
                queue.append(child)

    def scan(self, state: int, text: str) -> tuple[int, int | None]:
        """Feed `text` to a sequence in `state`: (its new state, and the offset in `text` just past the first
        stop string that ends in it, or None). After a match the state is the match's (see matched())."""
        for i, ch in enumerate(text):
            while state and ch not in self._next[state]:
                state = self._fail[state]
            state = self._next[state].get(ch, 0)
            if self._match[state]:
                return state, i + 1
        return state, None

    def matched(self, state: int) -> int:
        """The length of the stop string that scan() just found ending at `state`."""
        return self._match[state]

    def pending(self, state: int) -> int:
        """How many of the last characters fed may be the start of a stop string."""
        return self._depth[state]
