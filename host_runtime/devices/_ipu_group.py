"""Multi-IPU devices: one request to every IPU process of the device, and the IPU-Links.

::

    Session ---- GroupLink.request(RUN) ----+--> member link 0 --control--> IPU process 0
                 (one future: done when     +--> member link 1 --control--> IPU process 1
                  every IPU is done)        ...
    host rings:  input anchor  --> the IPU that consumes it
                 output anchor <-- the IPU that produces it
    link rings:  IPU process a --(SPSC ring, created and owned by the session)--> IPU process b

``GroupLink`` is the ``DeviceLink`` (:mod:`host_runtime.devices.link`) of a device of
several IPUs. Until a
multi-IPU executable is loaded it talks to IPU 0 only, exactly like the one-IPU
link did (a one-IPU executable on a bigger device runs on its first IPU). A LOAD
whose body holds ``spec_regions`` (one per IPU) widens it: from then on every
request goes to each IPU's process and its future resolves when all of them are
done; the first failure softly stops the others (STOP value 1) and invalidates
the IPU-Links (waking an IPU process blocked on one at once), so that no IPU
is left waiting for an activation that will never come, and the future fails
with that failure, which names the IPU, once every IPU has answered and the
others were told to stop (the caller's next request never overtakes that stop). Before each RUN/LOOP (nothing
runs then) the links are emptied and the sharding tokens put back, whatever an
abandoned iteration left in them.

An IPU whose part is idle (the model was compiled for N IPUs and holds no node on
that IPU: ``Executable.idle``) belongs to the device like the others (its process is
started and watched, as the IPU is held on hardware) but gets no LOAD (its spec region
is None) and no request: it runs nothing.

Failure is whole-device: when any IPU process dies, the remaining IPU processes
of the device are killed (their rings then fail at once, and none of them is left
waiting on a link whose producer is gone), then every member link fails its
pending requests with one ``DeviceLostError`` naming the IPU.

``ShardedLoad`` is the session's side: per IPU a spec region (that IPU's part of
the executable), a device-memory region, and one ring per link. Every IPU gets
the session's full list of host streams (same indices, so NEED/OUT events and
MODES need no translation; an IPU never touches the streams its part does not
name) followed by its links, in direct mode.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

from shm import Region, Ring

from host_runtime.devices._link import Answer, ProcessLink, wait
from host_runtime.devices._shm_space import load_spec_region
from host_runtime.devices.link import DeviceLink, StreamServicer
from host_runtime.errors import BadRequestError, DeviceLostError, InvalidStateError, PopefError
from host_runtime.settings import HostSettings
from ipu_emulator.ipu.launcher import IpuConnection, describe_returncode, kill_all
from ipu_emulator.ipu_protocol import MODE_DIRECT, LoadConstants, LoadSpec, LoadStream, Op

if TYPE_CHECKING:  # pragma: no cover
    from ipu_emulator.executable import Executable

__all__ = ["GroupLink", "ShardedLoad", "make_link", "LINK_DEPTH"]

_log = logging.getLogger(__name__)

LINK_DEPTH = 4
"""Slots of an IPU-Link ring: how many batches a pipeline stage may run ahead of the next."""


def make_link(description: str, processes: list[IpuConnection],
              settings: HostSettings | None = None) -> DeviceLink:
    """The link of a device: a ProcessLink for one IPU, a GroupLink for several;
    ``settings``: its timeouts' (default: ``HostSettings.current()``)."""
    if len(processes) <= 1:
        return ProcessLink(description, processes, settings)
    return GroupLink(description, processes, settings)


class _MemberLink(ProcessLink):
    """One IPU process's control/event rings; a loss is the whole group's."""

    def __init__(self, group: "GroupLink", description: str,
                 processes: list[IpuConnection], settings: HostSettings | None = None) -> None:
        super().__init__(description, processes, settings)
        self._group = weakref.ref(group)   # the group owns its members

    def mark_lost(self) -> DeviceLostError:
        group = self._group()
        return group.mark_lost() if group is not None else super().mark_lost()


class GroupLink:
    """The link of a device of several IPUs (see the module docstring)."""

    def __init__(self, description: str, processes: list[IpuConnection],
                 settings: HostSettings | None = None) -> None:
        self.description = description
        self._procs = list(processes)
        settings = settings if settings is not None else HostSettings.current()
        # each member names its IPU: a program error it reports says which IPU failed
        self._members = [
            _MemberLink(self, f"{description}: IPU {k} of the device (ipu {p.spec.ipu_id})",
                        [p] + [q for q in processes if q is not p], settings)
            for k, p in enumerate(processes)]
        self._width = 1
        self._active = [0]   # the IPUs that run a part (those of an idle part do not)
        self._lost: DeviceLostError | None = None
        self._lost_lock = threading.Lock()
        self._closing = False
        # set by ShardedLoad: empty the IPU-Links (every IPU process is idle then)
        self.reset_links: Callable[[], None] | None = None
        # set by ShardedLoad: invalidate the IPU-Links, waking an IPU process waiting on one
        self.wake_links: Callable[[], None] | None = None
        self._runs: list[cf.Future[None]] = []   # RUN/LOOP answers not yet in

    # -- the DeviceLink protocol -----------------------------------------------------------

    def start(self) -> None:
        for m in self._members:
            m.start()

    def close(self, timeout: float = 1.0) -> None:
        self._closing = True
        for m in self._members:
            m.close(timeout)

    def quiesce(self, timeout: float = 1.0) -> None:
        for m in self._members:
            m.quiesce(timeout)

    @property
    def last_unanswered(self) -> bool:
        # waited for: an IPU waiting on another's link ends its program only then (and
        # one that does not is killed by the stop's bound, not left to the daemon's)
        return False

    def take_first(self) -> tuple[Op, Any, "cf.Future[None]"] | None:
        return None   # a device of several IPUs is sent no first request (launch_all)

    def wake(self) -> None:
        for m in self._members:
            m.wake()

    @property
    def lost(self) -> DeviceLostError | None:
        return self._lost

    def check(self) -> DeviceLostError | None:
        if self._lost is None and self._dead() is not None:
            return self.mark_lost()
        return self._lost

    @property
    def started(self) -> bool:
        return self._members[0].started

    @property
    def pid(self) -> int:
        return self._members[0].pid

    @property
    def width(self) -> int:
        """IPUs the loaded executable spans (1 until a multi-IPU executable is loaded)."""
        return self._width

    @property
    def active(self) -> list[int]:
        """The IPUs of the device that run a part of the loaded executable (an IPU whose
        part is idle holds no node: it is loaded with nothing and runs nothing)."""
        return list(self._active)

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def set_servicer(self, servicer: StreamServicer | None) -> None:
        for m in self._members:
            m.set_servicer(servicer)

    def request(self, op: Op, body: Any = None, value: int = 0,
                last: bool = False) -> "cf.Future[None]":
        bodies: list[Any] | None = None
        if op is Op.LOAD:
            regions = body.get("spec_regions") if isinstance(body, dict) else None
            if regions:
                if len(regions) > len(self._members):
                    fut: cf.Future[None] = Answer()
                    fut.set_exception(BadRequestError(
                        f"the executable needs {len(regions)} IPUs, but {self.description} "
                        f"has {len(self._members)}"))
                    return fut
                self._width = len(regions)
                self._active = [k for k, r in enumerate(regions) if r is not None]
                faults = body.get("faults")   # (host fault tables: every IPU gets them)
                bodies = [{"spec_region": r, "faults": faults} if faults else {"spec_region": r}
                          for r in regions]
            else:
                self._width, self._active = 1, [0]
        if op is Op.UNLOAD:   # every IPU may cache that session's part, whatever ran last
            members = list(self._members)
            return self._all([m.request(op, body, value) for m in members], members, op)
        if self._width == 1:
            return self._members[0].request(op, body, value, last)
        if bodies is None:
            bodies = [body] * self._width
        running = op in (Op.RUN, Op.LOOP)
        if running:
            self._runs = [f for f in self._runs if not f.done()]
            if not self._runs and self.reset_links is not None and self._lost is None:
                # Nothing runs now: start the links afresh, whatever an abandoned iteration
                # (a stop, a failure) left in them. Not behind a run still under way (the
                # Load programs' RUN and Main's LOOP are sent together): its IPUs are
                # passing each other what the next request reads (e.g. a weight that the
                # Load program of one IPU forwards to another).
                self.reset_links()
        members = [self._members[k] for k in self._active]
        futs = [m.request(op, bodies[k], value, last) for k, m in zip(self._active, members)]
        out = self._all(futs, members, op)
        if running:
            self._runs.append(out)
        return out

    def call(self, op: Op, body: Any = None, timeout: float | None = None) -> None:
        wait(self.request(op, body), timeout, f"{op.name} on {self.description}",
             pids=self.pids(), progress=lambda: self.progress, sync=self.sync_timeout)

    @property
    def sync_timeout(self) -> float:
        """The host sync timeout, read when the device was made."""
        return self._members[0].sync_timeout

    @property
    def progress(self) -> float:
        """When the last event of any IPU process of the device came."""
        return max(m.progress for m in self._members)

    def notify(self, op: Op, body: Any = None) -> None:
        for k in self._active if self._width > 1 else [0]:
            self._members[k].notify(op, body)

    # -- combining ----------------------------------------------------------------------------

    def _all(self, futs: list["cf.Future[None]"], members: list[_MemberLink],
             op: Op) -> "cf.Future[None]":
        out: cf.Future[None] = Answer()   # an interrupt of its waiter leaves no lock held
        lock = threading.Lock()
        state: dict[str, Any] = {"left": len(futs), "stopped": False, "first": None}
        ref = weakref.ref(self)   # the members' pending futures hold this callback

        def done(f: "cf.Future[None]") -> None:
            self = ref()
            if self is None:   # the device went: its members failed what was pending
                if not out.done():
                    try:
                        out.set_exception(InvalidStateError("the device was detached"))
                    except cf.InvalidStateError:   # another member's callback was first
                        pass
                return
            exc = f.exception()
            with lock:
                state["left"] -= 1
                stop = exc is not None and not state["stopped"] and op in (Op.RUN, Op.LOOP)
                if stop:
                    state["stopped"] = True
                    if not isinstance(exc, InvalidStateError):   # not stop()'s
                        state["first"] = exc   # the failure; the others' errors follow it
                    # The stop below is one more part of the answer: the caller's next
                    # request must find the STOPs sent and the links invalidated, never
                    # overtake them (a late STOP would end the next run, a late wake
                    # disconnect its links and drop its outputs).
                    state["left"] += 1
                last = state["left"] == 0
            if stop:
                try:
                    self._stop_others(f, futs, members)
                finally:
                    with lock:
                        state["left"] -= 1
                        last = state["left"] == 0
                    if last:
                        settle()
            elif last:
                settle()

        def settle() -> None:   # every part answered: the combined answer
            errors = [e for e in (g.exception() for g in futs) if e is not None]
            futs.clear()   # each future's callbacks hold this list: no cycle left behind
            members.clear()
            if not errors:
                out.set_result(None)
                return
            out.set_exception(_first_cause(errors, state["first"]))

        for f in futs:
            f.add_done_callback(done)
        return out

    def _stop_others(self, failed: "cf.Future[None]", futs: list["cf.Future[None]"],
                     members: list[_MemberLink]) -> None:
        """An IPU's run failed: the others may wait for data from it (or wait to pass it
        some): end their programs, then wake those blocked on an IPU-Link now rather than
        at their next check of the control ring. The links are reset before the next
        RUN/LOOP."""
        if self._lost is not None:
            return
        for g, m in zip(futs, members):
            if g is not failed and not g.done():
                try:
                    m.request(Op.STOP, value=1)
                except Exception:  # pragma: no cover - best effort
                    _log.debug("soft stop of %s failed", m.description, exc_info=True)
        wake = self.wake_links
        if wake is not None:
            try:
                wake()
            except Exception:  # pragma: no cover - best effort
                _log.debug("waking the IPU-Links failed", exc_info=True)

    # -- failure ---------------------------------------------------------------------------

    def _dead(self) -> tuple[int, IpuConnection] | None:
        for k, p in enumerate(self._procs):
            if not p.alive():
                return k, p
        return None

    def mark_lost(self) -> DeviceLostError:
        """A process of the device died: the whole device is lost."""
        with self._lost_lock:
            if self._lost is not None:
                return self._lost
            err = self._lost_error()
            if self._closing:   # the device is being detached: its processes are going away
                _log.debug("%s", err)
            else:
                _log.warning("%s", err)
                # Killed before anyone hears of the loss: whoever reacts to it (a runner
                # that closes, releasing a daemon's IPUs) finds them dead. Killed after,
                # an IPU the daemon had taken back and freed meanwhile died free, and the
                # next attach of it failed.
                alive = [p for p in self._procs if p.alive()]
                for p in alive:
                    _log.info("%s: killing IPU process %d (its device is lost)",
                              self.description, p.pid)
                kill_all(alive)   # all at once, then wait for all
            self._lost = err
        for m in self._members:
            m.adopt_lost(err)
        return err

    def _lost_error(self) -> DeviceLostError:
        dead = self._dead()
        if dead is None:   # a ring saw the peer die before it could be reaped
            for p in self._procs:
                p.wait_exit(0.2)
            dead = self._dead() or (0, self._procs[0])
        k, proc = dead
        err = DeviceLostError(
            f"{self.description}: IPU process {proc.pid} {describe_returncode(proc.returncode())} "
            f"(ipu {proc.spec.ipu_id}, IPU {k} of the device); the whole device is lost")
        tail = proc.log_tail()
        if tail:
            from host_runtime.errors import RemoteTraceback
            err.__cause__ = RemoteTraceback(tail)
        return err


def _first_cause(errors: list[BaseException], first: BaseException | None) -> BaseException:
    for kind in (DeviceLostError,):
        for e in errors:
            if isinstance(e, kind):
                return e
    if first is not None:   # the IPU that failed first: the others were stopped for it
        return first
    for e in errors:   # a real failure rather than "stop() interrupted the programs"
        if not isinstance(e, InvalidStateError):
            return e
    return errors[0]


# -- the session's side ----------------------------------------------------------------------

def main_reads(exe_bytes: bytes | memoryview, main: Sequence[int]) -> list[set[str]]:
    """For each IPU of an executable (one entry for a one-IPU executable): the streams
    its part's ``main`` programs stream in (host inputs and links)."""
    from ipu_emulator.executable import Executable, ExecutableError, Repeat, StreamIn, Switch

    def reads(body: Iterable[Any]) -> Iterator[str]:
        for i in body:
            if isinstance(i, StreamIn):
                yield i.handle
            elif isinstance(i, Repeat):
                yield from reads(i.body)
            elif isinstance(i, Switch):
                for b in i.branches:
                    yield from reads(b)

    try:
        exe = Executable.from_bytes(exe_bytes)
    except ExecutableError as exc:
        raise PopefError(f"the executable is damaged: {exc}") from exc
    return [{h for p in main if 0 <= p < len(part.programs) for h in reads(part.programs[p].body)}
            for part in exe.parts or [exe]]


def paced(ins: list[set[str]], constant: Iterable[str], streamed: Iterable[str]) -> bool:
    """Whether, with the input streams ``constant`` fed from shared memory (not read from
    their rings), every IPU that reads one of them in its Main programs (``ins``: see
    :func:`main_reads`) still waits for each request: it streams in one of ``streamed``
    (inputs the host writes with each request), or a link from an IPU that waits (the
    sharding token's links excepted: their first token is put in by the host). An IPU
    that did not would run iterations ahead of the requests."""
    from ipu_emulator.executable import is_link, is_sync, parse_link

    wanted, fed = set(constant), set(streamed)
    waits: set[int] = set()
    grew = True
    while grew:
        grew = False
        for k, hs in enumerate(ins):
            if k not in waits and (hs & fed or any(
                    is_link(h) and not is_sync(h) and parse_link(h)[0] in waits for h in hs)):
                waits.add(k)
                grew = True
    return all(k in waits for k, hs in enumerate(ins) if hs & wanted)


def paced_by_requests(exe_bytes: bytes | memoryview, main: Sequence[int],
                      constant: Iterable[str], streamed: Iterable[str]) -> bool:
    """:func:`paced` for the executable ``exe_bytes`` and its ``main`` programs."""
    return paced(main_reads(exe_bytes, main), constant, streamed)


class ShardedLoad:
    """The per-IPU resources of one session's multi-IPU executable (owned by the session)."""

    def __init__(self, exe: "Executable", key: str) -> None:
        self.exe = exe
        self.key = key
        self.parts = exe.parts
        self.links: dict[str, Ring] = {}
        # per IPU (None for an IPU whose part is idle: it is sent nothing)
        self.spec_regions: list[Region | None] = []
        self.memory: list[Region | None] = []
        self._part_bytes = [None if p.idle else p.to_bytes() for p in self.parts]
        self._closed = False
        try:
            for handle, spec in self._link_specs().items():
                n = max(1, spec)
                self.links[handle] = Ring.create(n, LINK_DEPTH, kind="link",
                                                 prefault=n * LINK_DEPTH <= (1 << 20))
            self.reset_links()
            for part in self.parts:
                self.memory.append(None if part.idle else Region.create(
                    max(64, part.memory_bytes), kind="mem", prefault=False,
                    backed=0))   # by its IPU
        except BaseException:
            self.close()
            raise

    @classmethod
    def of(cls, exe_bytes: bytes | memoryview, key: str) -> "ShardedLoad | None":
        """A ShardedLoad when ``exe_bytes`` is a multi-IPU executable, else None."""
        from ipu_emulator.executable import Executable, ExecutableError

        try:
            exe = Executable.from_bytes(exe_bytes)
        except ExecutableError as exc:
            raise PopefError(f"the executable is damaged: {exc}") from exc
        if not exe.parts:
            return None
        return cls(exe, key)

    def _link_specs(self) -> dict[str, int]:
        from ipu_emulator.executable import is_link

        out: dict[str, int] = {}
        for part in self.parts:
            for h, s in part.streams.items():
                if is_link(h):
                    out[h] = s.nbytes
        return out

    def load(self, link: DeviceLink, host_streams: tuple[LoadStream, ...],
             check_package_hash: bool, fresh: bool, timeout: float,
             peers: Callable[[str, int], None] | None = None,
             faults: list[str] | None = None,
             constants: LoadConstants | None = None) -> None:
        """Send each IPU its part (LOAD with one spec region per IPU) and wait for all;
        ``faults``: the names of the host's fault tables (ipu_emulator.faults);
        ``constants``: the load spec's ``constants`` (one region shared by every IPU of
        every replica), each IPU told of the streams its part reads."""
        if self._closed:
            raise InvalidStateError("the session's multi-IPU resources are closed")
        if not isinstance(link, GroupLink) or len(link._members) < len(self.parts):
            have = len(link._members) if isinstance(link, GroupLink) else 1
            raise BadRequestError(
                f"executable {self.exe.name!r} is sharded over {len(self.parts)} IPUs, but "
                f"{link.description} has {have}; attach a device of {len(self.parts)} IPUs")
        if fresh:
            self.reset_links()
        names: list[str | None] = []
        for k, part in enumerate(self.parts):
            code, memory = self._part_bytes[k], self.memory[k]
            if code is None or memory is None:   # an idle IPU: held, given nothing
                if k == len(self.spec_regions):
                    self.spec_regions.append(None)
                names.append(None)
                continue
            streams = host_streams + tuple(
                LoadStream(h, self.links[h].name, s.direction, s.nbytes, MODE_DIRECT)
                for h, s in part.streams.items() if h in self.links)
            mine = tuple(c for c in (constants.streams if constants is not None else ())
                         if c.handle in part.streams)
            spec = LoadSpec(key=self.key, fresh=bool(fresh), executable_size=len(code),
                            memory_region=memory.name,
                            check_package_hash=bool(check_package_hash), streams=streams,
                            constants=(LoadConstants(constants.region, mine)
                                       if constants is not None and mine else None))
            old = self.spec_regions[k] if k < len(self.spec_regions) else None
            region = load_spec_region(old, spec, code)
            if k < len(self.spec_regions):
                self.spec_regions[k] = region
            else:
                self.spec_regions.append(region)
            names.append(region.name)
        link.reset_links = self.reset_links
        link.wake_links = self.wake_links
        if peers is not None:
            pids = link.pids()
            for k, part in enumerate(self.parts):
                for h in part.streams:
                    if h not in self.links:
                        peers(h, pids[k])
        body: dict[str, Any] = {"spec_regions": names}
        if faults:
            body["faults"] = faults
        link.call(Op.LOAD, body, timeout=timeout)

    def reset_links(self) -> None:
        """Empty every link; put the one token in each sync link (no IPU process may be
        using them: the owner calls this between requests)."""
        from ipu_emulator.executable import is_sync

        if self._closed:
            return
        for handle, ring in self.links.items():
            ring.reset()
            if is_sync(handle):
                ring.write(b"\0")

    def wake_links(self) -> None:
        """Invalidate every link: an IPU process waiting on one takes its STOP now (the
        owner resets them before the next run)."""
        if self._closed:
            return
        for ring in self.links.values():
            if not ring.closed:
                ring.invalidate()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for ring in self.links.values():
            ring.close()
            ring.unlink()
        self.links = {}
        for region in self.spec_regions + self.memory:
            if region is not None:
                region.close()
                region.unlink()
        self.spec_regions, self.memory = [], []
