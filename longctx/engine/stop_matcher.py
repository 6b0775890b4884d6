"""Stop strings matched as the text grows, at a cost that does not grow with their number.

Owns: ``StopMatcher``, an Aho-Corasick automaton over one request's stop strings, fed only the
characters each new token adds. Its state after a character is the longest end of the text
that is a start of some stop string, which is also how much text must wait before it is
handed out (a later token may complete a stop there). Built once per request (linear in the
strings' total length); each character costs amortised O(1) plus the matches it reports, so
2,000 strings cost what 2 do per token. Never: detokenizing or deciding what a match does.
"""

from __future__ import annotations

from collections import deque


class StopMatcher:
    """``feed(chars)`` -> the first stop string completed in them, as (its index in ``stops``,
    the end of the match in ``chars``, exclusive), or None; ``pending`` is the length of the
    longest end of all text fed so far that is a proper start of some stop string."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        self.out: list[int] = [-1]  # the longest stop ending at this node (its index), or -1
        self.link = [0]  # failure link: the longest proper suffix that is a node
        self.out_link = [0]  # the nearest node along the failure links that ends a stop (0: none)
        for index, stop in enumerate(stops):
            node = 0
            for ch in stop:
                nxt = self.goto[node].get(ch)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto[node][ch] = nxt
                    self.goto.append({})
                    self.depth.append(self.depth[node] + 1)
                    self.out.append(-1)
                    self.link.append(0)
                    self.out_link.append(0)
                node = nxt
            if self.out[node] < 0:  # (a repeated string: its first index)
                self.out[node] = index
        self._link_nodes()
        self.state = 0

    def _link_nodes(self) -> None:
        queue = deque(self.goto[0].values())
        while queue:
            node = queue.popleft()
            for ch, child in self.goto[node].items():
                queue.append(child)
                fall = self.link[node]
                while fall and ch not in self.goto[fall]:
                    fall = self.link[fall]
                target = self.goto[fall].get(ch, 0)
                self.link[child] = target if target != child else 0
                self.out_link[child] = target if self.out[target] >= 0 else self.out_link[target]

    def _step(self, node: int, ch: str) -> int:
        while node and ch not in self.goto[node]:
            node = self.link[node]
        return self.goto[node].get(ch, 0)

    def feed(self, chars: str) -> tuple[int, int] | None:
        """Advance over ``chars``; the first completed stop (the one ending earliest; of those
        ending at one place the longest), or None. After a match the state is left as it is:
        the request ends there."""
        node = self.state
        for i, ch in enumerate(chars):
            node = self._step(node, ch)
            found = node if self.out[node] >= 0 else self.out_link[node]
            if found:
                self.state = node
                return self.out[found], i + 1
        self.state = node
        return None

    @property
    def pending(self) -> int:
        """Characters at the end of the text fed so far that a later one may turn into a stop."""
        return self.depth[self.state]

    def reset(self, text: str = "") -> None:
        """Forget what was fed; feed ``text`` (no match reported: the caller checked it)."""
        self.state = 0
        for ch in text:
            self.state = self._step(self.state, ch)
