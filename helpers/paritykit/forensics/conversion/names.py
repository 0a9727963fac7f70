r"""Tensor names as structure: skeletons with the numbers taken out, layer indices, ancestors, and the word
similarity that settles ambiguous matches."""

from __future__ import annotations

import difflib
import functools
import re
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

DIGITS = re.compile(r"\d+")


_WORDS = re.compile(r"[A-Za-z]+")


@functools.lru_cache(maxsize=1 << 16)
def name_skeleton(name: str) -> str:
    return DIGITS.sub("#", name)


def name_numbers(name: str) -> list[str]:
    return DIGITS.findall(name)


@functools.lru_cache(maxsize=1 << 16)
def _layer_indices(name: str) -> tuple[str, ...]:
    # layer indices are whole dotted components; "norm1" is a name, not an index
    return tuple(c for c in name.split(".") if c.isdigit())


def name_ancestors(name: str, depth: int = 8) -> list[str]:
    return list(_ancestors(name, depth))


@functools.lru_cache(maxsize=1 << 16)
def _ancestors(name: str, depth: int) -> tuple[str, ...]:
    parts = name.split(".")[:-1]
    return tuple(".".join(parts[:n]) for n in range(len(parts), max(0, len(parts) - depth), -1))


@functools.lru_cache(maxsize=1 << 16)
def _words(name: str) -> frozenset[str]:
    return frozenset(_WORDS.findall(name.lower()))


# words that name the same thing across research and diffusers naming (the text stream of dual-stream blocks
# is "txt"/"context" in research code and "added"/"context" in diffusers; norms and MLPs have many names)
_SYNONYMS = [
    {"txt", "text", "context", "added", "add", "encoder", "cond"},
    {"img", "image", "sample", "hidden"},
    {"ln", "norm", "layernorm", "groupnorm", "rmsnorm"},
    {"ff", "ffn", "mlp", "feedforward"},
    {"scale", "weight", "gamma", "g"},
    {"shift", "bias", "beta", "b"},
]


_SYNONYM_OF = {w: frozenset(group) for group in _SYNONYMS for w in group}


def _words_match(a: str, b: str) -> bool:
    # prefixes count: q ~ query, attn ~ attention
    return a == b or a.startswith(b) or b.startswith(a) or b in _SYNONYM_OF.get(a, ())


class NameScorer:
    r"""Ranks candidate sources for a target whose values several sources share.

    In order: the (source, target) naming pattern was already proven by a value-unique match; the candidate
    sits in a source module that value-unique matches tie to the target's parent modules (their context);
    the layer indices agree; shared words (prefixes and synonyms count: ``q`` ~ ``query``, ``added`` ~
    ``txt``); not yet used; similar tails."""

    def __init__(self) -> None:
        self.pairs: set[tuple[str, str]] = set()
        self.used: set[str] = set()
        # target ancestor module -> source ancestor module -> value-unique matches under both
        self.partners: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.totals: dict[str, int] = defaultdict(int)
        self._homes: dict[str, str] | None = None
        # target module -> names of its direct children (modules or tensors)
        self.target_children: dict[str, set[str]] = defaultdict(set)

    def learn(self, source: str, target: str, *, evidence: bool = True) -> None:
        r"""Record a match; only value-unique matches (``evidence``) teach naming patterns and module ties."""
        self.used.add(source)
        if not evidence:
            return
        self.pairs.add((name_skeleton(source), name_skeleton(target)))
        self._homes = None
        for t_anc in name_ancestors(target):
            self.totals[t_anc] += 1
            partners = self.partners[t_anc]
            for s_anc in name_ancestors(source):
                partners[s_anc] += 1

    def home_of(self) -> dict[str, str]:
        r"""Target module -> the deepest source module holding all of its value-unique evidence.

        A module whose evidence all comes from one child module sits one level above that child's home
        (``layers.0`` pairs with ``blocks.0``, not with ``blocks.0.proj``, the home of ``layers.0.linear``).
        """
        if self._homes is None:
            homes: dict[str, str] = {}
            children: dict[str, list[str]] = defaultdict(list)
            for t_anc in self.partners:
                if "." in t_anc and t_anc.rsplit(".", 1)[0] in self.partners:
                    children[t_anc.rsplit(".", 1)[0]].append(t_anc)
            for t_anc in sorted(self.partners, key=lambda a: -a.count(".")):
                partners = self.partners[t_anc]
                if not partners:
                    # every source key it met is top-level (``in_proj_weight``): no module to pair with
                    continue
                top = max(partners.values())
                best = max((s for s, n in partners.items() if n == top), key=lambda s: s.count("."))
                kids = children.get(t_anc, [])
                # only when the module also holds tensors outside that child (a norm beside a linear);
                # ``to_out`` around ``to_out.0`` is the same module as its only child
                wider = len(self.target_children.get(t_anc, ())) > 1
                if len(kids) == 1 and wider and homes.get(kids[0]) == best and "." in best:
                    best = best.rsplit(".", 1)[0]
                homes[t_anc] = best
            self._homes = homes
        return self._homes

    def homes(self, target: str) -> list[str]:
        r"""For each parent module of ``target`` (deepest first), the source module most tied to it."""
        home_of = self.home_of()
        return [home_of[a] for a in name_ancestors(target) if a in home_of]

    def claimed(self) -> dict[str, set[str]]:
        r"""Source module -> the target modules it is the home of."""
        out: dict[str, set[str]] = defaultdict(set)
        for t_anc, s_anc in self.home_of().items():
            out[s_anc].add(t_anc)
        return out

    def key(self, source: str, target: str, cheap: bool = False) -> tuple:
        known = (name_skeleton(source), name_skeleton(target)) in self.pairs
        si, ti = _layer_indices(source), _layer_indices(target)
        indices = sum(a == b for a, b in zip(si, ti)) / max(1, len(si), len(ti))
        context = 0.0
        for t_anc in name_ancestors(target):
            partners = self.partners.get(t_anc)
            if partners:
                hits = max((partners.get(s_anc, 0) for s_anc in name_ancestors(source)), default=0)
                context += hits / self.totals[t_anc]
        sw, tw = _words(source), _words(target)
        common = sum(any(_words_match(w, v) for v in sw) for w in tw)
        words = common / max(1, len(sw | tw))
        head = (known, round(context, 6), indices, round(words, 6), source not in self.used)
        if cheap:
            return head
        tail = difflib.SequenceMatcher(
            None, ".".join(source.split(".")[-2:]), ".".join(target.split(".")[-2:])
        )
        return (*head, tail.ratio())

    def rank(self, target: str, candidates: Iterable[str], *, keep: int = 64) -> list[str]:
        r"""Best candidates first; the costlier string comparison only runs on the ``keep`` best."""
        candidates = list(candidates)
        if len(candidates) > keep:
            candidates = sorted(candidates, key=lambda s: self.key(s, target, cheap=True), reverse=True)[
                :keep
            ]
        return sorted(candidates, key=lambda s: self.key(s, target), reverse=True)


def module_of_tensor(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0] if "." in param_name else ""


def _fine_skeleton(name: str) -> str:
    r"""The name with layer indices (whole dotted numbers) blanked; ``norm1`` stays ``norm1``."""
    return ".".join("#" if c.isdigit() else c for c in name.split("."))


def _step_family(op: str, args: dict[str, Any]) -> tuple:
    r"""What an op does, without the sizes that differ between layers of different width."""
    if op == "chunk":
        return ("chunk", args["dim"], args.get("index"), args.get("count"))
    if op in ("transpose", "permute"):
        return (op, tuple(args["dims"]))
    if op in ("swap_halves", "concat"):
        return (op, args["dim"])
    if op == "cast":
        return (op, args["dtype"])
    if op == "permute_rows":
        return (op, args["dim"], args["pattern"])
    return (op,)


def _op_family(op: str, args: dict[str, Any]) -> tuple:
    steps = [] if op == "identity" else [_step_family(op, args)]
    return tuple(steps + [_step_family(s["op"], s) for s in args.get("then", [])])


def layer_key(name: str) -> tuple[str, tuple[str, ...]]:
    r"""A name without its first layer index: ``blocks.1.m.2.w`` -> ``("blocks.#.m.#.w", ("2",))``.

    Names with equal keys are the same tensor in different layers (the first index counts layers; later
    indices, such as a chunk number or a sub-block, say which tensor inside the layer it is).
    """
    numbers = [c for c in name.split(".") if c.isdigit()]
    return _fine_skeleton(name), tuple(numbers[1:])


def _source_key(name: str) -> tuple[str, str]:
    r"""A source name with every number blanked, and the numbers of the module holding it (``norm2``)."""
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    # a whole number there is a layer index, not part of the module's name
    return name_skeleton(name), "" if module.isdigit() else "".join(DIGITS.findall(module))


def name_relation(way: Any, target: str) -> tuple:
    r"""The layer-independent form of a way: ``norm1 <- norm2`` in block 1 differs from ``norm1 <- norm1``
    in block 0, while ``resnets.1 <- block_2`` and ``resnets.0 <- block_1`` are alike."""
    return (tuple(_source_key(s) for s in way.sources), layer_key(target), _op_family(way.op, way.args))


EMA_NAME = re.compile(r"(^|[._])(model_ema|ema|shadow\w*)([._]|$)|(^|[._])ema_|_ema([._]|$)", re.IGNORECASE)


PARAM_LEAVES = ("weight", "bias")
PARAM_LEAF = re.compile(rf"(.+)_({'|'.join(PARAM_LEAVES)})")


def param_stem(name: str) -> tuple[str, str]:
    r"""(module stem, leaf): ``a.qkv.bias`` and ``a.qkv_bias`` are both ``("a.qkv", "bias")``; a top-level
    ``in_proj_weight`` is ``("in_proj", "weight")``; other names split at the last dot."""
    head, _, leaf = name.rpartition(".")
    m = PARAM_LEAF.fullmatch(leaf)
    if m:
        return (f"{head}.{m[1]}" if head else m[1]), m[2]
    return head, leaf


def stem_names(stem: str, leaf: str) -> list[str]:
    r"""The source names a parameter ``leaf`` of module ``stem`` may have (``X.bias`` or ``X_bias``)."""
    if not stem:
        return [leaf]
    return [f"{stem}.{leaf}", f"{stem}_{leaf}"] if leaf in PARAM_LEAVES else [f"{stem}.{leaf}"]


@functools.lru_cache(maxsize=1 << 16)
def is_ema(name: str) -> bool:
    return EMA_NAME.search(name) is not None
