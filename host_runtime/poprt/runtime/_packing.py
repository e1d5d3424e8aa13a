"""Where ``PackRunner`` puts each request of a batch (pure functions, no threads).

A packed model's inputs are ``[B, S, ...]``: ``B`` rows of ``S`` tokens. A request
is a sequence of ``L`` tokens (``L <= S``). Three placements, as PopRT's CPU packing:

- **across rows** (the default; the model unpacks and repacks itself, ``unpack_info``
  gives each request's length): requests are laid end to end over the ``B*S`` tokens,
  a request may continue on the next row;
- **single row, next fit** (``PackAlgorithm.next_fit``): a request goes at the end of
  the current row if it fits there, else at the start of the next row;
- **single row, first fit** (``PackAlgorithm.first_fit``): the first row, from the top,
  with room at its end; else the next unused row.

In a row, ``delimiter_num`` zeros separate a request from the one before it. A batch
holds at most ``max_valid_num`` requests (0: no bound but the rows). The first request
that does not fit ends the batch (requests keep their order of arrival).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Place", "Packer"]


@dataclass(frozen=True)
class Place:
    """Where a request's tokens go: row ``row`` from column ``col`` (across rows: the
    flat offset ``row * S + col``), its number in its row (1-based, single row) or in
    the batch (across rows), and its position in the unpack info."""

    row: int
    col: int
    number: int


class Packer:
    """Places request lengths into one batch (module docstring)."""

    def __init__(self, rows: int, seq: int, single_row: bool, first_fit: bool,
                 max_valid_num: int, delimiter_num: int) -> None:
        self.rows, self.seq = rows, seq
        self.single_row, self.first_fit = single_row, first_fit
        self.max_valid_num = max_valid_num
        self.delimiter = delimiter_num
        self.reset()

    def reset(self) -> None:
        self.ends: list[int] = []          # single row: the used length of each open row
        self.counts: list[int] = []        # ... and how many requests it holds
        self.offset = 0                    # across rows: the next free token
        self.placed = 0

    def fits_alone(self, length: int) -> bool:
        return 0 < length <= (self.seq if self.single_row else self.rows * self.seq)

    def place(self, length: int) -> Place | None:
        """Where the next request of ``length`` tokens goes; None: the batch is full."""
        if self.max_valid_num and self.placed >= self.max_valid_num:
            return None
        if not self.single_row:
            if self.offset + length > self.rows * self.seq:
                return None
            at = self.offset
            self.offset += length
            self.placed += 1
            return Place(at // self.seq, at % self.seq, self.placed)
        candidates = range(len(self.ends)) if self.first_fit else range(
            max(len(self.ends) - 1, 0), len(self.ends))
        for r in candidates:
            start = self.ends[r] + self.delimiter
            if start + length <= self.seq:
                return self._put(r, start, length)
        if len(self.ends) >= self.rows:
            return None
        self.ends.append(0)
        self.counts.append(0)
        return self._put(len(self.ends) - 1, 0, length)

    def _put(self, row: int, col: int, length: int) -> Place:
        self.ends[row] = col + length
        self.counts[row] += 1
        self.placed += 1
        return Place(row, col, self.counts[row])
