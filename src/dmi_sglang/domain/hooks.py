"""The hook catalog, presets and the selection syntax.

Short names, ids and stored ``act_name`` values are DMI-compatible (DMI's ``HOOK_DEFS``;
id 10 is deliberately absent there too). Per-layer hooks store ``"blocks." + name`` style
act names with the layer in ``layer_no``; global hooks store their bare name with
``layer_no = -1``.

Selection syntax (``DMX_HOOK_SELECTION``)::

    selection := item ("," item)*
    item      := name ["@" layers] (":" modifier)*
    layers    := N | N "-" M            (inclusive, 0-based)
    name      := a hook short name | a preset | an alias
    modifier  := rule | dtype | topk(K)  (at most one of each)
    rule      := all | last_prompt | last | generated | every(K) | positions(A-B)
    dtype     := bf16 | fp16

A preset expands to its members; members a model lacks are omitted (reported in
:attr:`Selection.omitted` so the caller can log them). A hook named explicitly that the
model lacks is an error. A layer range applies to the per-layer members of its item; a
range on a global hook is an error. A rule keeps only some positions of each request
(:mod:`~dmi_sglang.domain.positions`, which defines them); the same hook and layer
selected twice with different rules is an error. A payload modifier
(:mod:`~dmi_sglang.domain.payloads`) changes how rows are stored: a storage dtype for
the item's float hooks, or ``topk(K)`` on ``final_logits``, which selects the two
captures ``logits_topk_values`` and ``logits_topk_ids`` instead of the full row.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TypeVar

import attrs

from dmi_sglang.domain.payloads import ACCEPTED as PAYLOAD_MODIFIERS
from dmi_sglang.domain.payloads import TOPK_HOOKS, Payload, is_payload_modifier
from dmi_sglang.domain.positions import ACCEPTED as POSITION_RULES
from dmi_sglang.domain.positions import PositionRule, Positions
from dmi_sglang.errors import SelectionError

__all__ = [
    "ALIASES",
    "CATALOG",
    "PRESETS",
    "Hook",
    "HookSelection",
    "LayerRange",
    "ModelHooks",
    "RowBasis",
    "Selection",
    "SelectionItem",
    "hook_by_name",
    "parse_selection",
]


class RowBasis(enum.Enum):
    """What one row of a captured tensor stands for."""

    TOKEN = "token"
    """One row per forwarded token position."""
    REQUEST = "request"
    """One row per request and forward (final_logits: one per generated token)."""


@attrs.frozen
class Hook:
    """One entry of the catalog.

    Attributes:
        id: DMI's numeric hook id.
        name: the short name used in selections (``resid_pre``).
        act_name: the name stored in the ``act_name`` column.
        per_layer: True for hooks that fire once per decoder layer.
        row_basis: token rows, or request rows (final_logits).
        tp_sharded: True when each tensor-parallel rank holds a shard.
        attention_matrix: True for attention scores/patterns, which SGLang's kernels
            never materialise.
    """

    id: int
    name: str
    act_name: str
    per_layer: bool
    row_basis: RowBasis = RowBasis.TOKEN
    tp_sharded: bool = False
    attention_matrix: bool = False

    @property
    def stored_layer(self) -> int:
        """``layer_no`` a global hook is stored with."""
        return -1

    @property
    def is_integer(self) -> bool:
        """True for hooks whose rows are integers (token ids, routing ids): a storage
        dtype never applies to them."""
        return self.name in _INTEGER

    @property
    def derived(self) -> bool:
        """True for captures another hook's payload modifier makes (``topk(K)``); they
        are selected through that hook, never by name or preset."""
        return self.name in TOPK_HOOKS


def _layer(hid: int, name: str, act: str, *, sharded: bool = False, attn: bool = False) -> Hook:
    return Hook(hid, name, act, per_layer=True, tp_sharded=sharded, attention_matrix=attn)


_INTEGER = frozenset({"token_ids", "topk_ids", "logits_topk_ids"})


def _global(hid: int, name: str, basis: RowBasis = RowBasis.TOKEN) -> Hook:
    act = name if name in {"token_ids", "final_logits", *TOPK_HOOKS} else f"hook_{name}"
    return Hook(hid, name, act, per_layer=False, row_basis=basis)


CATALOG: tuple[Hook, ...] = (
    _layer(0, "resid_pre", "blocks.hook_resid_pre"),
    _layer(1, "ln1", "blocks.hook_ln1"),
    _layer(2, "attn_out", "blocks.hook_attn_out"),
    _layer(3, "resid_mid", "blocks.hook_resid_mid"),
    _layer(4, "attn_scores", "blocks.attn.hook_attn_scores", sharded=True, attn=True),
    _layer(5, "pattern", "blocks.attn.hook_pattern", sharded=True, attn=True),
    _layer(6, "q", "blocks.attn.hook_q", sharded=True),
    _layer(7, "k", "blocks.attn.hook_k", sharded=True),
    _layer(8, "v", "blocks.attn.hook_v", sharded=True),
    _layer(9, "z", "blocks.attn.hook_z", sharded=True),
    _layer(11, "ln2", "blocks.hook_ln2"),
    _layer(12, "mlp_in", "blocks.hook_mlp_in"),
    _layer(13, "mlp_out", "blocks.hook_mlp_out"),
    _global(14, "resid_final"),
    _global(15, "embed"),
    _global(16, "pos_embed"),
    _global(17, "final_ln"),
    _global(18, "token_ids"),
    _global(19, "final_logits", RowBasis.REQUEST),
    _layer(20, "mlp_post", "blocks.hook_mlp_post", sharded=True),
    _layer(21, "router_logits", "blocks.mlp.hook_router_logits"),
    _layer(22, "topk_ids", "blocks.mlp.hook_topk_ids"),
    _layer(23, "topk_weights", "blocks.mlp.hook_topk_weights"),
    # Not DMI's: the two captures of ``final_logits:topk(K)``.
    _global(24, "logits_topk_values", RowBasis.REQUEST),
    _global(25, "logits_topk_ids", RowBasis.REQUEST),
)
"""Every hook, in DMI id order (24 and 25 are this project's)."""

_BY_NAME: dict[str, Hook] = {h.name: h for h in CATALOG}

# Firing order within one forward (DMI's placement order): the FIFO contract for plans.
FIRING_ORDER: tuple[str, ...] = (
    "token_ids",
    "embed",
    "pos_embed",
    "resid_pre",
    "ln1",
    "q",
    "k",
    "v",
    "attn_scores",
    "pattern",
    "z",
    "attn_out",
    "resid_mid",
    "ln2",
    "mlp_in",
    "router_logits",
    "topk_ids",
    "topk_weights",
    "mlp_post",
    "mlp_out",
    "resid_final",
    "final_ln",
    "final_logits",
    "logits_topk_values",
    "logits_topk_ids",
)

RESIDUAL_STREAM: frozenset[str] = frozenset({"resid_pre", "resid_mid", "resid_final"})
"""Hooks whose tensor is the model's residual stream: the model changes it in place only
at the next fused add+RMSNorm (or not at all after the last), so its capture points
announce that change (the capturer's ``join``) and its copy may run beside the model's
next kernels until then."""

PRESETS: Mapping[str, tuple[str, ...]] = {
    "full": tuple(h.name for h in CATALOG if not h.derived),
    "sglang-full": tuple(h.name for h in CATALOG if not h.attention_matrix and not h.derived),
    "hidden-states": ("resid_pre",),
    "logits": ("final_logits",),
    # For SGLang: attention patterns are never materialised by its attention kernels.
    "hf-only": ("resid_pre", "final_ln", "final_logits"),
}
"""Named groups of hooks. Members a model lacks are omitted, not errors."""

ALIASES: Mapping[str, str] = {
    "hidden_states": "hidden-states",
    "token-ids": "token_ids",
    "sglang_full": "sglang-full",
    "hf_only": "hf-only",
}
"""Alternative spellings accepted in selections."""


def hook_by_name(name: str) -> Hook:
    """The catalog entry for a short name.

    Raises:
        SelectionError: the name is not a hook; the message lists the accepted names.
    """
    try:
        return _BY_NAME[name]
    except KeyError:
        msg = f"unknown hook {name!r}; accepted hooks: {', '.join(_BY_NAME)}"
        raise SelectionError(msg) from None


@attrs.frozen
class LayerRange:
    """An inclusive range of layer indices, ``first <= layer <= last``."""

    first: int
    last: int

    @property
    def indices(self) -> range:
        """The layers of the range."""
        return range(self.first, self.last + 1)

    def __str__(self) -> str:
        return str(self.first) if self.first == self.last else f"{self.first}-{self.last}"


@attrs.frozen
class SelectionItem:
    """One comma-separated item of a selection, as written."""

    name: str
    """A hook short name or a preset name (aliases already resolved)."""
    layers: LayerRange | None
    is_preset: bool
    positions: Positions = attrs.field(factory=Positions)
    """Which positions of each request it keeps (default: all)."""
    payload: Payload = attrs.field(factory=Payload)
    """How its rows are stored (default: as computed)."""

    def __str__(self) -> str:
        text = self.name if self.layers is None else f"{self.name}@{self.layers}"
        if not self.positions.is_all:
            text = f"{text}:{self.positions}"
        return text if self.payload.is_default else f"{text}:{self.payload}"


_T = TypeVar("_T")
_FROM_LAST_PROMPT = (PositionRule.LAST_PROMPT, PositionRule.GENERATED, PositionRule.LAST)


@attrs.frozen
class HookSelection:
    """A parsed selection, independent of any model. Resolve it with :meth:`resolve`."""

    items: tuple[SelectionItem, ...]

    def __str__(self) -> str:
        return ",".join(str(i) for i in self.items)

    @property
    def changes_payloads(self) -> bool:
        """True when an item stores rows otherwise than computed (a storage dtype or
        ``topk(K)``)."""
        return any(not item.payload.is_default for item in self.items)

    @property
    def selects_positions(self) -> bool:
        """True when an item keeps only some positions (a ``:rule`` other than ``all``)."""
        return any(not item.positions.is_all for item in self.items)

    @property
    def needs_prompt_positions(self) -> bool:
        """True unless every item keeps only positions from the last prompt position on
        (``last_prompt``, ``generated``, ``last``, or request-row hooks such as
        ``final_logits``, whose rows are the positions that decide tokens): SGLang's radix
        cache always computes the last prompt position of a request (it matches at most
        ``prompt - 1`` cached positions), so such a selection captures all it asks for
        with the cache on."""
        return not all(item.positions.rule in _FROM_LAST_PROMPT or (
            item.positions.is_all and all(
                _BY_NAME[name].row_basis is RowBasis.REQUEST
                for name in (PRESETS[item.name] if item.is_preset else (item.name,))))
            for item in self.items)

    def resolve(self, model: ModelHooks) -> Selection:
        """Bind the selection to a model: which hooks, which layers.

        Raises:
            SelectionError: an explicitly named hook the model lacks, or a layer outside
                the model's ``0..num_layers-1``.
        """
        layers_by_hook: dict[str, set[int]] = {}
        rules: dict[tuple[str, int], Positions] = {}
        payloads: dict[tuple[str, int], Payload] = {}
        omitted: list[str] = []
        for item in self.items:
            if item.layers is not None and item.layers.last >= model.num_layers:
                msg = (
                    f"layer range {item.layers} in {str(item)!r} is outside the model's "
                    f"layers 0-{model.num_layers - 1}"
                )
                raise SelectionError(msg)
            for name, payload in _targets(item):
                hook = _BY_NAME[name]
                available = "final_logits" if hook.derived else name
                if available not in model.hooks and name not in model.hooks:
                    if item.is_preset:
                        omitted.append(name)
                        continue
                    msg = (
                        f"hook {available!r} is not available for {model.architecture}; "
                        f"it has: {', '.join(sorted(model.hooks, key=_firing_index))}"
                    )
                    raise SelectionError(msg)
                wanted: range | tuple[int, ...] = (-1,)
                if hook.per_layer:
                    wanted = (range(model.num_layers) if item.layers is None
                              else item.layers.indices)
                layers_by_hook.setdefault(name, set()).update(n for n in wanted if n >= 0)
                for layer in wanted:
                    _once(rules, (name, layer), item.positions, item=item,
                          what="position rules")
                    _once(payloads, (name, layer), payload, item=item, what="payloads")
        ordered = sorted(layers_by_hook, key=_firing_index)
        return Selection(
            hooks=tuple(
                (_BY_NAME[n], tuple(sorted(layers_by_hook[n]))) for n in ordered
            ),
            omitted=tuple(sorted(set(omitted) - set(layers_by_hook), key=_firing_index)),
            rules=tuple(sorted((n, layer, p) for (n, layer), p in rules.items()
                               if not p.is_all)),
            payloads=tuple(sorted(((n, layer, p) for (n, layer), p in payloads.items()
                                   if not p.is_default), key=lambda t: (t[0], t[1]))),
        )


def _targets(item: SelectionItem) -> list[tuple[str, Payload]]:
    """The hooks an item selects, each with the payload it is stored with.

    Raises:
        SelectionError: ``topk(K)`` on anything but ``final_logits``, or a storage dtype
            on an explicitly named integer hook.
    """
    names = PRESETS[item.name] if item.is_preset else (item.name,)
    payload = item.payload
    out: list[tuple[str, Payload]] = []
    for name in names:
        hook = _BY_NAME[name]
        if payload.topk:
            if name != "final_logits":
                msg = (f"topk({payload.topk}) in {str(item)!r} applies to final_logits only, "
                       f"not {name!r}")
                raise SelectionError(msg)
            out.extend((derived, payload) for derived in TOPK_HOOKS)
            continue
        if payload.dtype is not None and hook.is_integer:
            if not item.is_preset:
                msg = (f"{payload.dtype.value} in {str(item)!r}: {name!r} holds integers; "
                       f"a storage dtype applies to float hooks only")
                raise SelectionError(msg)
            out.append((name, Payload()))
            continue
        out.append((name, payload))
    return out


def _once(known: dict[tuple[str, int], _T], key: tuple[str, int], value: _T, *,
          item: SelectionItem, what: str) -> None:
    """Record ``item``'s value for one capture; the same capture with another value is
    an error."""
    first = known.setdefault(key, value)
    if first != value:
        name, layer = key
        where = name if layer < 0 else f"{name}@{layer}"
        msg = (f"{where} is selected with two {what}, {str(first) or 'as computed'} and "
               f"{str(value) or 'as computed'} ({str(item)!r}); select each hook and layer "
               f"once")
        raise SelectionError(msg)


def _firing_index(name: str) -> int:
    return FIRING_ORDER.index(name)


@attrs.frozen
class ModelHooks:
    """What a hooked model offers: its hooks and its number of layers."""

    architecture: str
    hooks: frozenset[str]
    num_layers: int


@attrs.frozen
class Selection:
    """A selection bound to a model.

    Attributes:
        hooks: ``(hook, layers)`` in firing order; ``layers`` is empty for global hooks.
        omitted: preset members the model lacks (log them).
    """

    hooks: tuple[tuple[Hook, tuple[int, ...]], ...]
    omitted: tuple[str, ...] = ()
    rules: tuple[tuple[str, int, Positions], ...] = ()
    """``(hook, layer_no, rule)`` of the captures that keep only some positions (every
    other capture keeps all)."""
    payloads: tuple[tuple[str, int, Payload], ...] = ()
    """``(hook, layer_no, payload)`` of the captures stored otherwise than computed."""

    def captures_kept_by(self, rule: PositionRule) -> tuple[tuple[Hook, int], ...]:
        """The captures (:meth:`captures` order) whose position rule is of kind
        ``rule``."""
        return tuple((hook, layer) for hook, layer in self.captures()
                     if self.positions_of(hook.name, layer).rule is rule)

    def payload_of(self, name: str, layer_no: int) -> Payload:
        """How one capture's rows are stored (``layer_no = -1`` for a global hook)."""
        for hook, layer, payload in self.payloads:
            if hook == name and layer == layer_no:
                return payload
        return _AS_COMPUTED

    def positions_of(self, name: str, layer_no: int) -> Positions:
        """The position rule of one capture (``layer_no = -1`` for a global hook)."""
        for hook, layer, rule in self.rules:
            if hook == name and layer == layer_no:
                return rule
        return _ALL

    @property
    def names(self) -> tuple[str, ...]:
        """Short names of the selected hooks, in firing order."""
        return tuple(h.name for h, _ in self.hooks)

    def layers_of(self, name: str) -> tuple[int, ...]:
        """Selected layers of a per-layer hook (empty for a global or unselected one)."""
        for hook, layers in self.hooks:
            if hook.name == name:
                return layers
        return ()

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def capture_points(self) -> tuple[tuple[Hook, int], ...]:
        """The capture points a model fires for the selection, in firing order: its
        captures, with ``final_logits`` in place of the captures derived from it (the
        top-K ones), once."""
        points: list[tuple[Hook, int]] = []
        for hook, layer in self.captures():
            point = (hook_by_name("final_logits"), -1) if hook.derived else (hook, layer)
            if point not in points:
                points.append(point)
        return tuple(points)

    def captures(self) -> tuple[tuple[Hook, int], ...]:
        """Every captured tensor of one forward, ``(hook, layer_no)``, in firing order.

        Per-layer hooks interleave by layer (layer 0's hooks, then layer 1's ...), the way
        a forward fires them; global hooks carry ``layer_no = -1``.
        """
        before = [(h, -1) for h, _ in self.hooks if not h.per_layer and not _after_layers(h)]
        after = [(h, -1) for h, _ in self.hooks if not h.per_layer and _after_layers(h)]
        per_layer = [(h, ls) for h, ls in self.hooks if h.per_layer]
        all_layers = sorted({layer for _, ls in per_layer for layer in ls})
        middle = [(h, layer) for layer in all_layers for h, ls in per_layer if layer in ls]
        return (*before, *middle, *after)


_ALL = Positions()
_AS_COMPUTED = Payload()


def _after_layers(hook: Hook) -> bool:
    return hook.name in {"resid_final", "final_ln", "final_logits", *TOPK_HOOKS}


def parse_selection(text: str) -> HookSelection:
    """Parse the selection syntax (see the module docstring).

    Raises:
        SelectionError: names the bad token and lists the accepted names.
    """
    items: list[SelectionItem] = []
    tokens = [t.strip() for t in text.split(",")]
    if not text.strip():
        msg = f"empty hook selection {text!r}; {_accepted()}"
        raise SelectionError(msg)
    for token in tokens:
        if not token:
            msg = f"empty item in hook selection {text!r}; {_accepted()}"
            raise SelectionError(msg)
        head, *modifiers = token.split(":")
        positions, payload = _modifiers(modifiers, token)
        name, _, layer_text = head.partition("@")
        name = ALIASES.get(name.strip(), name.strip())
        is_preset = name in PRESETS
        if not is_preset and name not in _BY_NAME:
            msg = f"unknown hook or preset {name!r} in {token!r}; {_accepted()}"
            raise SelectionError(msg)
        if _BY_NAME.get(name) is not None and _BY_NAME[name].derived:
            msg = (f"{name!r} in {token!r} is made by final_logits:topk(K); select "
                   f"that instead (e.g. final_logits:topk(64))")
            raise SelectionError(msg)
        layers = _parse_layers(layer_text, token) if "@" in head else None
        if layers is not None and not is_preset and not _BY_NAME[name].per_layer:
            msg = f"{name!r} in {token!r} is a global hook and takes no layer range"
            raise SelectionError(msg)
        if layers is not None and is_preset and not any(
                _BY_NAME[member].per_layer for member in PRESETS[name]):
            msg = f"preset {name!r} in {token!r} holds only global hooks: no layer range"
            raise SelectionError(msg)
        items.append(SelectionItem(name=name, layers=layers, is_preset=is_preset,
                                   positions=positions, payload=payload))
    return HookSelection(tuple(items))


def _modifiers(parts: list[str], token: str) -> tuple[Positions, Payload]:
    """The position rule and the payload of an item's ``:`` parts (at most one rule)."""
    positions: Positions | None = None
    payload = Payload()
    for part in parts:
        if is_payload_modifier(part):
            payload = payload.with_modifier(part, token)
            continue
        if not Positions.names_a_rule(part):
            msg = (f"unknown modifier {part.strip()!r} in {token!r}; position rules: "
                   f"{POSITION_RULES}; payload modifiers: {PAYLOAD_MODIFIERS}")
            raise SelectionError(msg)
        if positions is not None:
            msg = f"two position rules in {token!r}; give one"
            raise SelectionError(msg)
        positions = Positions.parse(part, token)
    return positions or Positions(), payload


def _parse_layers(text: str, token: str) -> LayerRange:
    first, dash, last = (p.strip() for p in text.strip().partition("-"))
    try:
        if not all(p.isascii() and p.isdigit() for p in ((first, last) if dash else (first,))):
            raise ValueError(text)  # int() would take "1_0" or other scripts' digits
        lo = int(first)
        hi = int(last) if dash else lo
    except ValueError:
        msg = f"bad layer range {text!r} in {token!r}; accepted: N or N-M (0-based, inclusive)"
        raise SelectionError(msg) from None
    if lo < 0 or hi < lo:
        msg = f"bad layer range {text!r} in {token!r}; need 0 <= N <= M"
        raise SelectionError(msg)
    return LayerRange(lo, hi)


def _accepted() -> str:
    return (
        f"accepted hooks: {', '.join(n for n, h in _BY_NAME.items() if not h.derived)}; "
        f"presets: {', '.join(PRESETS)}; "
        f"aliases: {', '.join(ALIASES)}"
    )
