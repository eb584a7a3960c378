"""Which positions of a request a hook keeps: the ``:rule`` of the selection syntax.

Each rule is defined by content, never by how the scheduler happened to batch the
forwards. For a request of ``prompt`` tokens and ``completion`` generated tokens, a complete
capture of every position holds (:func:`~dmi_sglang.domain.records.expected_coverage`):

* token-row hooks: positions ``[0, prompt + completion - 1)``, plus ``prompt + completion -
  1`` when SGLang's overlap scheduler forwarded the last generated token once more;
* request-row hooks (``final_logits``): ``[prompt - 1, prompt + completion - 1)``, one row
  per generated token (the row at position ``p`` decides token ``p + 1``).

The rules keep, of those:

========================  ==============================================================
``all`` (the default)     every one
``last_prompt``           ``prompt - 1``: the last prompt position (it decides the first
                          generated token)
``last``                  ``prompt + completion - 2``: the position that decided the last
                          generated token
``generated``             ``[prompt - 1, prompt + completion - 1)``: the positions whose
                          outputs are the generated tokens (never the extra forward's)
``every(K)``              the positions that are multiples of ``K`` (``0, K, 2K, ...``)
``positions(A-B)``        ``A <= position <= B`` (``positions(A)``: position ``A`` alone)
========================  ==============================================================

A kept position is stored as one record per run of consecutive kept positions (a stride
of ``every(K)`` with ``K > 1`` is one record per position), in DMI's columns.

Stored beyond the rule: ``generated`` on a token-row hook also stores the overlap
scheduler's extra forward (position ``prompt + completion - 1``, one row a request, as
``all`` does): while the request runs nobody knows that forward is the extra one. A reader
never returns it (:meth:`Positions.span` with the completion), and :meth:`Positions.rows`
counts it, as it counts what a capture stores.
"""

from __future__ import annotations

import enum
import re

import attrs

from dmi_sglang.errors import SelectionError

__all__ = ["PositionRule", "Positions"]


class PositionRule(enum.Enum):
    """The kinds of position selection (see the module docstring)."""

    ALL = "all"
    LAST_PROMPT = "last_prompt"
    LAST = "last"
    GENERATED = "generated"
    EVERY = "every"
    RANGE = "positions"


_CALL = re.compile(r"^(every|positions)\(([0-9]+)(?:-([0-9]+))?\)$")
ACCEPTED = "all, last_prompt, last, generated, every(K), positions(A-B)"
"""The rules the selection syntax accepts, as the error messages name them."""
_NAMED = frozenset(r.value for r in (PositionRule.ALL, PositionRule.LAST_PROMPT,
                                     PositionRule.LAST, PositionRule.GENERATED))


@attrs.frozen
class Positions:
    """A position rule with its parameters (``every``: ``K``; ``positions``: ``A``-``B``,
    inclusive)."""

    rule: PositionRule = PositionRule.ALL
    k: int = 1
    first: int = 0
    last: int = 0

    @classmethod
    def names_a_rule(cls, text: str) -> bool:
        """Whether ``text`` is written as a position rule (a known name, ``every(...)``
        or ``positions(...)``), valid or not."""
        name = text.strip()
        return name in _NAMED or name.startswith(("every(", "positions("))

    @classmethod
    def parse(cls, text: str, token: str = "") -> Positions:
        """A rule as written after ``:`` in a selection item (``token``: the item, for the
        message).

        Raises:
            SelectionError: an unknown rule, ``every(0)``, or a range ``A-B`` with ``B < A``.
        """
        where = f" in {token!r}" if token else ""
        name = text.strip()
        for rule in (PositionRule.ALL, PositionRule.LAST_PROMPT, PositionRule.LAST,
                     PositionRule.GENERATED):
            if name == rule.value:
                return cls(rule)
        match = _CALL.match(name)
        if match is None or (match.group(1) == "every" and match.group(3) is not None):
            msg = f"unknown position rule {name!r}{where}; accepted: {ACCEPTED}"
            raise SelectionError(msg)
        a = int(match.group(2))
        if match.group(1) == "every":
            if a < 1:
                msg = f"every({a}){where}: K must be at least 1"
                raise SelectionError(msg)
            return cls(PositionRule.EVERY, k=a) if a > 1 else cls()  # every(1): all
        b = int(match.group(3)) if match.group(3) is not None else a
        if b < a:
            msg = f"positions({a}-{b}){where}: need A <= B"
            raise SelectionError(msg)
        return cls(PositionRule.RANGE, first=a, last=b)

    @property
    def is_all(self) -> bool:
        """True for the default rule (every position)."""
        return self.rule is PositionRule.ALL

    def __str__(self) -> str:
        if self.rule is PositionRule.EVERY:
            return f"every({self.k})"
        if self.rule is PositionRule.RANGE:
            span = str(self.first) if self.first == self.last else f"{self.first}-{self.last}"
            return f"positions({span})"
        return str(self.rule.value)

    def keeps(self, position: int, *, prompt: int, completion: int) -> bool:
        """True when the rule keeps ``position`` of a request of ``prompt`` +
        ``completion`` tokens (``position`` being one a complete capture holds)."""
        rule = self.rule
        if rule is PositionRule.ALL:
            return True
        if rule is PositionRule.LAST_PROMPT:
            return position == prompt - 1
        if rule is PositionRule.LAST:
            return position == prompt + completion - 2
        if rule is PositionRule.GENERATED:
            return prompt - 1 <= position < prompt + completion - 1
        if rule is PositionRule.EVERY:
            return position % self.k == 0
        return self.first <= position <= self.last

    @property
    def needs_prompt(self) -> bool:
        """True when :meth:`span` needs the request's prompt length."""
        return self.rule in (PositionRule.LAST_PROMPT, PositionRule.GENERATED,
                             PositionRule.LAST)

    def span(self, start: int, end: int, *, prompt: int | None = None,
             completion: int | None = None) -> tuple[int, int]:
        """The kept positions of ``[start, end)`` as one span ``[lo, hi)`` (empty when
        ``hi <= lo``), for the rules whose kept positions are one span: ``all``,
        ``positions(A-B)``, ``last_prompt``, ``generated`` (these two need ``prompt``,
        the request's prompt length) and ``last`` (it needs ``prompt`` and
        ``completion``: known once the request finished).

        ``generated`` ends at ``prompt + completion - 1``; while the request runs its
        ``completion`` is unknown (None), and the span runs to ``end``: a capture then
        keeps the overlap scheduler's extra forward too (one row a request, never read).

        Raises:
            ValueError: another rule, or a rule that needs ``prompt`` without it.
        """
        rule = self.rule
        if rule is PositionRule.ALL:
            return start, end
        if rule is PositionRule.RANGE:
            return max(start, self.first), min(end, self.last + 1)
        if self.needs_prompt and prompt is None:
            msg = f"{self} needs the request's prompt length"
            raise ValueError(msg)
        if rule is PositionRule.LAST_PROMPT and prompt is not None:
            return max(start, prompt - 1), min(end, prompt)
        if rule is PositionRule.GENERATED and prompt is not None:
            stop = end if completion is None else min(end, prompt + completion - 1)
            return max(start, prompt - 1), stop
        if rule is PositionRule.LAST and prompt is not None and completion is not None:
            if completion < 1:  # no token was generated: no position decided one
                return start, start
            one = prompt + completion - 2
            return max(start, one), min(end, one + 1)
        msg = f"{self} keeps no span of positions that is known while capturing"
        raise ValueError(msg)

    def kept(self, start: int, end: int, *, prompt: int | None = None,
             completion: int | None = None) -> range:
        """The kept positions of ``[start, end)``, in order, for every rule: ``every(K)``
        as a range with step ``K``, the others as :meth:`span` gives them (step 1, the
        same arguments needed).

        Raises:
            ValueError: as :meth:`span`.
        """
        if self.rule is PositionRule.EVERY:
            first = min(-(-start // self.k) * self.k, max(start, end))
            return range(first, max(first, end), self.k)
        lo, hi = self.span(start, end, prompt=prompt, completion=completion)
        return range(lo, max(lo, hi))

    def rows(self, start: int, end: int, *, prompt: int, completion: int) -> int:
        """How many positions of ``[start, end)`` (what a complete capture of the request
        holds for one hook) a capture under the rule stores (see the module docstring for
        ``generated``)."""
        rule = self.rule
        if end <= start:
            return 0
        if rule is PositionRule.ALL:
            return end - start
        if rule is PositionRule.EVERY:
            return -(-end // self.k) - -(-start // self.k)
        if rule is PositionRule.RANGE:
            return max(0, min(end, self.last + 1) - max(start, self.first))
        if rule is PositionRule.GENERATED:  # to ``end``: the extra forward is stored
            return max(0, end - max(start, prompt - 1))
        if rule is PositionRule.LAST and completion < 1:
            return 0
        one = prompt - 1 if rule is PositionRule.LAST_PROMPT else prompt + completion - 2
        return 1 if start <= one < end else 0
