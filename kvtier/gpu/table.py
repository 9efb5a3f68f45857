"""The slot table: per-slot state and per-entry verdicts in flat arrays, and the block-hash index.

A *row* is one indexed block hash; its column g says where group g's object for that block is:
`e_slot` (global slot or -1), `e_gen` (the slot's generation while bound) and `e_verdict` (the
Reason a lookup reports for it: OK only when SEALED, whole, aligned, of the live namespace and
layout). Row `R` (one past the last) is a sentinel: every column MISSING, never written; a lookup
maps an unknown hash to it, so the hot path is one dict probe per hash and one gather.
"""

from __future__ import annotations

import numpy as np

from kvtier.core.forms import Reason
from kvtier.gpu.errors import AdmissionRefused, IllegalTransition
from kvtier.gpu.states import BlockState, check_move, check_moves

IN_FLIGHT = 100  # verdict of an object being recovered right now; mapped to RECOVER before any vector is built

# enum members as plain values for the per-slot paths (an enum attribute lookup is a descriptor call each time)
_RECOVERING, _SEALED, _EVICTING = BlockState.RECOVERING, BlockState.SEALED, BlockState.EVICTING
_OK, _STALE = int(Reason.OK), int(Reason.STALE_VERSION)

_CLASS_SHIFT = 1 << 48  # eviction order: stale namespace, then state forms, then history; LRU within


_NO_SLOTS = np.empty(0, dtype=np.int64)


class BlockTable:
    """All slot and index state; not thread-safe on its own (the manager holds the lock)."""

    def __init__(self, slots_per_group: list[int], history: list[bool], gens: np.ndarray | None = None) -> None:
        """`gens`: where slot generations live (the shared `GenerationTable`), else private memory."""
        self.n_groups = len(slots_per_group)
        counts = np.array(slots_per_group, dtype=np.int64)
        self.base = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
        s = int(counts.sum())
        self.n_slots = s
        self.s_group = np.repeat(np.arange(self.n_groups), counts).astype(np.intp)
        self.s_history = np.array(history, dtype=bool)[self.s_group]
        self.s_state = np.zeros(s, dtype=np.int8)
        self.s_gen = np.zeros(s, dtype=np.int64) if gens is None else gens
        self.s_row = np.full(s, 2 * s + 16, dtype=np.intp)
        self.s_pins = np.zeros(s, dtype=np.int32)
        self.s_leases = np.zeros(s, dtype=np.int32)
        self.s_touch = np.zeros(s, dtype=np.int64)
        self.s_recoverable = np.zeros(s, dtype=bool)
        self.s_ns = np.full(s, -1, dtype=np.int16)
        # rows: one per occupied slot at most, plus rows kept only by leases (slack), plus the sentinel
        r = 2 * s + 16
        self.sentinel = r
        self.e_slot = np.full((self.n_groups, r + 1), -1, dtype=np.int64)
        self.e_gen = np.full((self.n_groups, r + 1), -1, dtype=np.int64)
        self.e_verdict = np.full((self.n_groups, r + 1), Reason.MISSING, dtype=np.int8)
        self.r_live = np.zeros(r + 1, dtype=np.int32)
        self.r_leases = np.zeros(r + 1, dtype=np.int32)
        self.r_touch = np.zeros(r + 1, dtype=np.int64)
        self.r_hash: list[bytes | None] = [None] * r
        self.index: dict[bytes, int] = {}
        self._free_rows = list(range(r - 1, -1, -1))
        self.free = [list(range(int(b + c) - 1, int(b) - 1, -1)) for b, c in zip(self.base, counts)]
        self.next_gen = 1
        self.tick = 0
        self.n_recovering = 0

    # -- rows ---------------------------------------------------------------------------------

    def row(self, block_hash: bytes) -> int:
        """The row of an indexed hash, created (all columns MISSING) if absent."""
        row = self.index.get(block_hash)
        if row is None:
            if not self._free_rows:
                raise AdmissionRefused(
                    "the block index is full of rows held only by leases; release leases (or wait for their TTL)"
                )
            row = self._free_rows.pop()
            self.index[block_hash] = row
            self.r_hash[row] = block_hash
        return row

    def drop_row_if_dead(self, row: int) -> bool:
        """Unindex a row that holds no slot and no lease (its hash becomes a plain miss)."""
        if row == self.sentinel or self.r_live[row] or self.r_leases[row]:
            return False
        h = self.r_hash[row]  # read only past the sentinel check: the sentinel row is past the list's end
        if h is None:
            return False
        del self.index[h]
        self.r_hash[row] = None
        self.e_slot[:, row] = -1
        self.e_gen[:, row] = -1
        self.e_verdict[:, row] = Reason.MISSING
        self.r_touch[row] = 0
        self._free_rows.append(row)
        return True

    # -- slots --------------------------------------------------------------------------------

    def move(self, slot: int, to: BlockState) -> None:
        current = int(self.s_state[slot])
        check_move(current, to, slot)
        if current == _RECOVERING:
            self.n_recovering -= 1
        if to == _RECOVERING:
            self.n_recovering += 1
        self.s_state[slot] = to

    def bind(self, slot: int, row: int, verdict: int, ns_id: int) -> int:
        """Give a freshly allocated slot a new generation and make it row's object of its group."""
        gen = self.next_gen
        self.next_gen += 1
        self._stamp(slot, row, gen, verdict, ns_id)
        self.r_live[row] += 1
        return gen

    def bind_recovering(self, slots: np.ndarray, rows: np.ndarray, ns_id: int) -> None:
        """`move(FREE -> RECOVERING)` and `bind(..., IN_FLIGHT, ...)` for a batch of freshly allocated slots;
        each (group, row) at most once (a row recurs once per group)."""
        check_moves(self.s_state[slots], _RECOVERING, slots)
        n = len(slots)
        self.s_state[slots] = _RECOVERING
        self.n_recovering += n
        gens = np.arange(self.next_gen, self.next_gen + n, dtype=np.int64)
        self.next_gen += n
        self._stamp(slots, rows, gens, IN_FLIGHT, ns_id)
        np.add.at(self.r_live, rows, 1)

    def _stamp(
        self, slot: int | np.ndarray, row: int | np.ndarray, gen: int | np.ndarray, verdict: int, ns_id: int
    ) -> None:
        """The slot's fields and its row's column for a new binding (one slot, or arrays of them)."""
        g = self.s_group[slot]
        self.s_gen[slot] = gen
        self.s_row[slot] = row
        self.s_ns[slot] = ns_id
        self.s_recoverable[slot] = False
        self.s_pins[slot] = 0
        self.s_leases[slot] = 0
        self.e_slot[g, row] = slot
        self.e_gen[g, row] = gen
        self.e_verdict[g, row] = verdict

    def seal_recovered(self, slots: np.ndarray, live_ns: int) -> None:
        """`seal(slot, live_ns, recoverable=True)` for a batch of RECOVERING slots, touched in order."""
        not_recovering = self.s_state[slots] != _RECOVERING
        if not_recovering.any():
            i = int(np.argmax(not_recovering))
            raise IllegalTransition(
                f"slot {int(slots[i])}: {BlockState(int(self.s_state[slots[i]])).name} is not RECOVERING; "
                "this is a kvtier bug, please report it"
            )
        n = len(slots)
        self.s_state[slots] = _SEALED
        self.n_recovering -= n
        rows = self.s_row[slots]
        self.e_verdict[self.s_group[slots], rows] = np.where(self.s_ns[slots] == live_ns, _OK, _STALE)
        self.s_recoverable[slots] = True
        ticks = np.arange(self.tick + 1, self.tick + 1 + n, dtype=np.int64)
        self.tick += n
        self.s_touch[slots] = ticks
        hist = self.s_history[slots]
        self.r_touch[rows[hist]] = ticks[hist]

    def evict_many(self, slots: np.ndarray, marker: Reason) -> np.ndarray:
        """For a batch of slots, in order: `move` to EVICTING and on to FREE, and `unbind` (generations in that
        order); their groups' free lists are the caller's. Returns the rows they were bound to, in that order."""
        check_moves(self.s_state[slots], _EVICTING, slots)
        self.s_state[slots] = BlockState.FREE  # (only SEALED slots may go: EVICTING -> FREE is legal, none recovered)
        n = len(slots)
        g, rows = self.s_group[slots], self.s_row[slots]
        gens = np.arange(self.next_gen, self.next_gen + n, dtype=np.int64)
        self.next_gen += n
        self.s_gen[slots] = gens
        self.e_slot[g, rows] = -1  # (a row holds one slot per group: no (group, row) twice)
        self.e_gen[g, rows] = gens
        self.e_verdict[g, rows] = marker
        np.subtract.at(self.r_live, rows, 1)
        self.s_row[slots] = self.sentinel
        self.s_leases[slots] = 0
        self.s_pins[slots] = 0
        return rows

    def unbind(self, slot: int, marker: Reason) -> int:
        """Detach a slot from its row (generation moves, column gets `marker`); returns the row."""
        g = self.s_group[slot]
        row = int(self.s_row[slot])
        self.s_gen[slot] = self.next_gen
        self.next_gen += 1
        self.e_slot[g, row] = -1
        self.e_gen[g, row] = self.s_gen[slot]
        self.e_verdict[g, row] = marker
        self.r_live[row] -= 1
        self.s_row[slot] = self.sentinel
        self.s_leases[slot] = 0
        self.s_pins[slot] = 0
        return row

    def set_verdict(self, slot: int, verdict: int) -> None:
        self.e_verdict[self.s_group[slot], self.s_row[slot]] = verdict

    def seal(self, slot: int, live_ns: int, *, recoverable: bool = False) -> None:
        """WRITING / RECOVERING -> SEALED: the object reads OK if it is of the live namespace."""
        self.move(slot, _SEALED)
        self.set_verdict(slot, _OK if self.s_ns[slot] == live_ns else _STALE)
        if recoverable:
            self.mark_recoverable(slot)
        self.touch_slot(slot)

    def mark_recoverable(self, slot: int) -> None:
        """The lower tier holds a verified copy: write-back may skip the slot."""
        self.s_recoverable[slot] = True

    def restamp(self, live_ns: int) -> None:
        """Re-derive every sealed object's verdict for a new live namespace (the others turn stale)."""
        sealed = np.flatnonzero(self.s_state == BlockState.SEALED)
        live = self.s_ns[sealed] == live_ns
        verdict = np.where(live, Reason.OK, Reason.STALE_VERSION).astype(np.int8)
        self.e_verdict[self.s_group[sealed], self.s_row[sealed]] = verdict

    def touch_rows(self, rows: np.ndarray) -> None:
        self.tick += 1
        self.r_touch[rows] = self.tick

    def touch_slot(self, slot: int) -> None:
        self.tick += 1
        self.s_touch[slot] = self.tick
        if self.s_history[slot]:
            self.r_touch[self.s_row[slot]] = self.tick

    # -- holds and pins: what eviction must pass over ------------------------------------------

    def hold_rows(self, rows: np.ndarray) -> None:
        """A lease holds rows: they stay indexed and their history objects are spared by pressure eviction."""
        self.r_leases[rows] += 1
        self.touch_rows(rows)

    def hold_row(self, row: int) -> None:
        """Keep one row indexed (a recovery adopting a row its lookup did not find)."""
        self.r_leases[row] += 1

    def let_go_row(self, row: int) -> bool:
        """Undo `hold_row`; True if the row held nothing else and was unindexed."""
        self.r_leases[row] -= 1
        return self.drop_row_if_dead(row)

    def hold_slots(self, slots: list[int]) -> list[tuple[int, int]]:
        """A lease holds slots against pressure eviction; returns (slot, generation) of each to let go by."""
        held = []
        for slot in slots:
            self.s_leases[slot] += 1
            self.s_touch[slot] = self.tick
            held.append((slot, int(self.s_gen[slot])))
        return held

    def let_go(self, rows: np.ndarray, slots: list[tuple[int, int]]) -> None:
        """Undo `hold_rows` and `hold_slots` (a slot evicted since is skipped: its generation moved);
        rows left with no slot and no lease are unindexed."""
        self.r_leases[rows] -= 1
        for slot, gen in slots:
            if self.s_gen[slot] == gen:
                self.s_leases[slot] -= 1
        dead = rows[(self.r_live[rows] == 0) & (self.r_leases[rows] == 0)]
        # not np.unique: its first call imports numpy.ma, slow enough to show in a request
        for row in sorted(set(dead.tolist())):
            self.drop_row_if_dead(row)

    def pin(self, slot: int) -> bool:
        """Spare a slot from every eviction until unpinned."""
        self.s_pins[slot] += 1
        return True

    def unpin(self, slot: int) -> bool:
        """Undo one `pin`; False if the slot was not pinned."""
        if self.s_pins[slot] <= 0:
            return False
        self.s_pins[slot] -= 1
        return True

    def victim(self, where: slice | np.ndarray, live_ns: int) -> int:
        """The slot to evict among `where`: SEALED, unpinned, unleased; stale namespace first, then state
        forms, then history, least recently touched within; -1 if none."""
        found = self.victims(where, live_ns, 1)
        return int(found[0]) if len(found) else -1

    def victims(self, where: slice | np.ndarray, live_ns: int, n: int) -> np.ndarray:
        """The first n slots `victim` would name among `where` if each were evicted before the next was asked for
        (evicting one changes no other's rank), fewer where fewer may go."""
        state = self.s_state[where]
        ok = state == BlockState.SEALED
        if not ok.any():
            return _NO_SLOTS
        rows = self.s_row[where]
        hist = self.s_history[where]
        ok &= (self.s_pins[where] == 0) & (self.s_leases[where] == 0) & ~(hist & (self.r_leases[rows] > 0))
        if not ok.any():
            return _NO_SLOTS
        klass = np.where(self.s_ns[where] != live_ns, 0, np.where(hist, 2, 1))
        score = klass * _CLASS_SHIFT + np.where(hist, self.r_touch[rows], self.s_touch[where])
        ids = np.arange(self.n_slots)[where]
        if n == 1:  # the common one-object case: argmin, no sort
            score[~ok] = np.iinfo(np.int64).max
            return ids[[int(np.argmin(score))]]
        ids, score = ids[ok], score[ok]
        return ids[np.argsort(score, kind="stable")[:n]]  # stable: ties go in slot order, as argmin's first
