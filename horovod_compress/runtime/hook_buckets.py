"""The buckets a comm hook is handed: their keys, and the layout kept across a rebuild and a restore.

A comm hook (PyTorch DDP's) does not choose its buckets: the framework hands
it one flat bucket at a time, in the same order on every rank. A bucket is
identified by its parameters in bucket order (:func:`flat_key`); for a flat
method that key also names its compressor state.

DDP puts every parameter into one bucket in the first iteration and rebuilds
its buckets after it (``torch.nn.parallel.DistributedDataParallel``'s bucket
rebuild), so the layout of the last iteration is what a checkpoint records.
A model restored from it starts again with DDP's initial buckets; in that
first iteration :class:`HookBuckets` *defers*: it collects the parameters as
buckets arrive and releases each saved bucket as soon as all its parameters
are there (:meth:`HookBuckets.ready_groups`), plus, with the last bucket,
the parameters no saved bucket holds (:meth:`HookBuckets.rest_group`). A
bucket is complete when all its parameters are reduced
(:meth:`HookBuckets.completed`).
"""
from __future__ import annotations

import hashlib
from typing import Any

#: Prefix of a flat bucket's key (and of its compressor state's name).
FLAT_PREFIX = "ddp["

Group = tuple[str, tuple[str, ...]]


def flat_key(names: tuple[str, ...], numel: int) -> str:
    """The state key of a flat bucket: its parameters (in bucket order) and size."""
    digest = hashlib.blake2b("\0".join(names).encode(), digest_size=4).hexdigest()
    return f"{FLAT_PREFIX}{names[0]}..{names[-1]}|{len(names)}|{numel}|{digest}]"


class HookBuckets:
    """This iteration's buckets, the saved layout and, after a restore, the deferred parameters.

    ``saved``: ``[(key, parameter names)]`` of the last completed iteration
    (``None`` before one); ``restored``: a layout was loaded and no iteration
    completed since. The per-iteration fields are reset by :meth:`new_iteration`.
    """

    def __init__(self) -> None:
        self.saved: list[Group] | None = None
        self.restored = False
        self.new_iteration()

    def new_iteration(self) -> None:
        """Forget this iteration's buckets (after it ended, or failed)."""
        self.groups: list[Group] = []       # reduced as handed over (not deferring)
        self.deferring = False
        self.pending: dict[str, Any] = {}   # name -> the parameter's slot (deferring)
        self._pending_order: list[str] = []
        self.processed: set[str] = set()
        self._done: set[str] = set()
        self._waiting: list[tuple[Any, tuple[str, ...]]] = []

    def defers(self, key: str, named: bool) -> bool:
        """Whether the bucket ``key`` (and every later one this iteration) is regrouped.

        True from the first bucket of an iteration after a restore that the
        saved layout does not hold, when parameters have stable names.
        """
        if not self.deferring and self.restored and named and self.saved is not None \
                and key not in {k for k, _ in self.saved}:
            self.deferring = True
        return self.deferring

    def reduced(self, key: str, names: tuple[str, ...], handed: bool = True) -> None:
        """Note the group ``key`` of ``names`` as reduced (``handed``: a bucket as DDP handed it)."""
        if handed:
            self.groups.append((key, names))
        self.processed.update(names)
        self._done.add(key)

    def defer(self, bucket: Any, names: tuple[str, ...], slots: list[Any]) -> None:
        """Keep ``bucket``'s parameter slots until their saved groups are complete."""
        for name, slot in zip(names, slots):
            self.pending[name] = slot
            self._pending_order.append(name)
        self._waiting.append((bucket, names))

    def ready_groups(self) -> list[Group]:
        """The saved groups not yet reduced whose parameters have all arrived."""
        return [(k, names) for k, names in self.saved or ()
                if k not in self._done and all(n in self.pending for n in names)]

    def rest_group(self) -> Group | None:
        """The arrived parameters no reduced group holds, as one group (at the last bucket)."""
        rest = tuple(n for n in self._pending_order if n not in self.processed)
        if not rest:
            return None
        return flat_key(rest, sum(self.pending[n].array.size for n in rest)), rest

    def completed(self) -> list[Any]:
        """The waiting buckets whose parameters are all reduced (removed from the wait list)."""
        done = [b for b, names in self._waiting if all(n in self.processed for n in names)]
        self._waiting = [(b, names) for b, names in self._waiting
                         if not all(n in self.processed for n in names)]
        return done

    def end_iteration(self) -> set[str] | None:
        """Close the iteration; the new layout's keys when it changed (DDP's rebuild), else ``None``.

        Raises ``RuntimeError`` if a bucket is still waiting (cannot happen:
        the last bucket releases every parameter).
        """
        changed = None
        if not self.deferring and self.groups != self.saved:
            changed = {k for k, _ in self.groups}
            self.saved = list(self.groups) if self.groups else None
        leftover = self._waiting
        self.restored = False
        self.new_iteration()
        if leftover:
            raise RuntimeError(f"{len(leftover)} DDP bucket(s) left without a result")
        return changed

    # ---------------------------------------------------------- checkpoints
    def saved_lists(self) -> list[list[Any]] | None:
        """The saved layout as plain lists (a checkpoint's ``"layout"``)."""
        return None if self.saved is None else [[k, list(n)] for k, n in self.saved]

    def load_saved(self, layout: list[Any] | None) -> None:
        """Restore :meth:`saved_lists` output; the next iteration regroups by it."""
        self.saved = None if layout is None else [(str(k), tuple(str(x) for x in n))
                                                  for k, n in layout]
        self.restored = self.saved is not None
        self.new_iteration()
