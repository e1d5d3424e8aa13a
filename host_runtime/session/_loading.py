"""What a session puts on its device, and the LOAD that puts it there.

A session's executable goes to its device in shared memory: the executable
region (the executable but its weights, with the LOAD spec), the device memory
region, the weights (a region shared by every session of the same bytes,
:mod:`host_runtime.session._weights`, or, with prepacking, the PopEF file the IPU
process reads itself), the constant inputs (a region shared by every session of
the same values, :mod:`host_runtime.session._constants`). A multi-IPU executable
goes part by part (:class:`host_runtime.devices.ShardedLoad`). The :class:`Loader`
holds these for the session's life (across bindings) and sends LOAD and MODES;
which binding it loads for is the caller's :class:`~host_runtime.session._state.Binding`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Sequence

from shm import Region

from host_runtime.devices import Device, ShardedLoad, load_spec_region, translated, wait
from host_runtime.errors import BadRequestError, ModelRuntimeError, PopefError
from host_runtime.popef.reader import file_identity as popef_file_identity
from host_runtime.popef.reader import file_span as popef_file_span
from host_runtime.session._config import SessionConfig
from host_runtime.session._constants import SharedConstants, constants_bytes, shared_constants
from host_runtime.session._binding import Binding
from host_runtime.session._streams import StreamTable
from host_runtime.session._weights import SharedWeights, check_fits, is_shared, shared_weights
from host_runtime.settings import HostSettings
from ipu_emulator.executable import ExecutableError, ExecutableHeader, weights_span
from ipu_emulator.faults import FaultTable
from ipu_emulator.fit import misfit
from ipu_emulator.ipu_protocol import LoadSpec, Op, WeightsFile

__all__ = ["Loader"]

ConstantInputs = dict[str, tuple[Callable[[memoryview], None], memoryview]]
"""handle -> (callback, value) of the inputs fed by a value that never changes."""


class Loader:
    """A session's executable on its device (see the module docstring)."""

    def __init__(self, exe: bytes | memoryview, header: ExecutableHeader, key: str,
                 streams: StreamTable, config: SessionConfig, settings: HostSettings,
                 fault_table: FaultTable | None) -> None:
        self._exe = exe
        self._header = header
        self._key = key   # the device caches the executable by it
        self._streams = streams
        self._flow = streams.flow
        self._config = config
        self._settings = settings
        self._fault_table = fault_table   # the fault schedule its IPUs follow
        self._spec_region: Region | None = None
        self._spec_written: LoadSpec | None = None   # what it holds
        self._memory_region: Region | None = None
        # the executable's weights section: in a region shared by every session of the same
        # bytes (host_runtime.session._weights), not in this session's executable region
        self._weights_at, self._weights_len = _weights_span(self._exe, self._header)
        self._weights: SharedWeights | None = None
        # constant inputs (PopEF tensor data of the Load programs, frozen inputs): their
        # values in one region shared by every session of the same values
        # (host_runtime.session._constants); those the device was last loaded with
        self._constants: SharedConstants | None = None
        self._constants_of: ConstantInputs = {}   # the inputs whose values it holds
        self._constants_loaded: ConstantInputs = {}
        self._sharded: ShardedLoad | None = None   # a multi-IPU executable's resources
        # the fast path's LOAD is not waited for where it is sent (``defer``): the next run
        # (or LOAD) waits for it first (:meth:`settle`); its future and device meanwhile
        self.defer = False
        self._loading: tuple[Any, Device] | None = None

    @property
    def memory_region(self) -> Region | None:
        """The device memory region (made at the first LOAD)."""
        return self._memory_region

    def ensure_resources(self, dev: Device | None) -> None:
        """Make the session's rings and device memory region once (the IPU processes map
        them at LOAD); with ``dev``, the rings are reset for it when it is a new peer.
        Without (``None``: made while the device attaches, see ``Session``) they wait for
        their peer."""
        extra = [] if self._memory_region is not None else [
            ("the device memory region", max(64, self._header.memory_bytes)),
            ("the executable region", self._weights_at)] + (
            [("the weights region", self._weights_len)]
            if self._weights is None and self._weights_len and self._weights_file(dev) is None
            else []) + (
            [("the constants region", constants_bytes(
                {h: v for h, (_, v) in self._streams.constants().items()}))]
            if self._constants is None and self._streams.constants() else [])
        self._streams.ensure_rings(dev.link.pid if dev is not None else None, extra)
        if self._memory_region is None:
            size = max(64, self._header.memory_bytes)
            with translated("the device memory region", size):
                # backed by the IPU process where it will touch it (not where it reads
                # constants in place): ipu_emulator.ipu._constants.memory_ranges
                self._memory_region = Region.create(size, kind="mem", prefault=False,
                                                    backed=0)
        if dev is None and self._spec_region is None and self._header.num_ipus == 1:
            self._prepare_load()

    def _prepare_load(self) -> None:
        """While the device attaches: the constants region and the LOAD's spec region, as
        far as they are known without the device (load() rewrites the spec in place)."""
        constants = self._streams.constants()
        if constants:
            self._constants = shared_constants({h: v for h, (_, v) in constants.items()})
            self._constants_of = constants
        self._write_spec(self._spec(True, self._streams.modes(), self._weights_file(None)))

    def _write_spec(self, spec: LoadSpec) -> Region:
        """The spec region holding ``spec`` (written only if it differs from the last)."""
        if self._spec_region is None or spec != self._spec_written:
            self._spec_region = load_spec_region(self._spec_region, spec,
                                                 memoryview(self._exe)[:self._weights_at])
            self._spec_written = spec
        return self._spec_region

    def _spec(self, fresh: bool, modes: list[int], weights_file: WeightsFile | None
              ) -> LoadSpec:
        return LoadSpec(
            key=self._key, fresh=bool(fresh), executable_size=self._weights_at,
            memory_region=self._memory_region.name if self._memory_region else None,
            check_package_hash=bool(self._config.check_package_hash),
            streams=self._streams.load_spec(modes), prepack=bool(self._settings.prepack),
            weights_file=weights_file,
            weights_region=(self._weights.name if weights_file is None
                            and self._weights is not None else None),
            constants=self._constants.spec() if self._constants is not None else None)


    def load(self, dev: Device, binding: Binding, fresh: bool,
             keep_load_constants: bool = False) -> None:
        """Send LOAD to ``dev`` (the caller holds its lock and is its active session; the
        caller moves ``binding`` to its next phase). ``keep_load_constants``: the constant
        inputs only Load programs read stay those of the last LOAD (no Load program runs
        before the next request). With ``defer`` set (the fast path), a single-IPU LOAD is
        sent and waited for by :meth:`settle` (its requests follow it on the ring)."""
        self.settle()
        self.ensure_resources(dev)
        header = self._header
        wrong = misfit(header.name, header.ipu_version,
                       max(header.memory_bytes, header.required_bytes), None,
                       device=dev.describe(), device_version=dev.ipuVersion(),
                       device_ipus=dev.numIpus(), tiles_per_ipu=dev.tilesPerIpu(),
                       memory_per_tile=dev.memoryPerTile())
        if wrong is not None:
            raise BadRequestError(wrong[1])
        modes = self._streams.modes()
        constants, same = self._constants_to_load(keep_load_constants)
        if not same:   # the device's cached copy of the executable streams them otherwise
            fresh = True
        if self._header.num_ipus > 1 and self._load_sharded(dev, binding, modes, fresh):
            self._constants_loaded = constants
            return
        weights_file = self._weights_file(dev)
        if weights_file is None:
            self.share_weights(dev)
        spec = self._spec(fresh, modes, weights_file)
        sent = self._first_load(dev, spec)
        if sent is None:
            # the executable stays where it is; only "fresh", modes and weights change
            sent = dev.link.request(Op.LOAD, self._load_body(self._write_spec(spec)))
        self._loading = (sent, dev)
        if not self.defer:
            self.settle()
        binding.modes_sent = modes
        self._constants_loaded = constants

    def _load_body(self, region: Region) -> dict[str, Any]:
        load: dict[str, Any] = {"spec_region": region.name}
        if self._fault_table is not None:
            load["faults"] = [self._fault_table.name]
        return load

    def first_load(self) -> dict[str, Any] | None:
        """The body of the LOAD a device attached for this session may be sent first (see
        ``host_runtime.devices._first``): the spec made while it attaches; None if there
        is none (an executable of several IPUs)."""
        region = self._spec_region
        return self._load_body(region) if region is not None else None

    def _first_load(self, dev: Device, spec: LoadSpec) -> "Any | None":
        """The answer of the LOAD ``dev`` was sent first, if it is the one this LOAD would
        send (the same spec; "fresh" aside: the device has nothing of this host cached);
        else None, once that one is answered (its spec region is rewritten next)."""
        first = dev.link.take_first()
        if first is None:
            return None
        op, body, fut = first
        region, written = self._spec_region, self._spec_written
        if (op is Op.LOAD and region is not None and written is not None
                and body == self._load_body(region)
                and dataclasses.replace(written, fresh=spec.fresh) == spec):
            return fut
        try:
            self._wait_load(fut, dev)
        except ModelRuntimeError:   # superseded by the LOAD sent next
            pass
        return None

    def _wait_load(self, fut: Any, dev: Device) -> None:
        """The answer of a LOAD sent to ``dev`` (its error raised), within ``load_timeout``
        and the host sync timeout."""
        wait(fut, self._settings.load_timeout, f"LOAD on {dev.describe()}",
             pids=dev.pids(), progress=lambda: dev.link.progress,
             sync=dev.link.sync_timeout)

    def settle(self) -> None:
        """Wait for the LOAD sent last, if it has not been waited for (its error raised as
        the LOAD's, within ``load_timeout`` and the host sync timeout)."""
        loading, self._loading = self._loading, None
        if loading is None:
            return
        fut, dev = loading
        try:
            self._wait_load(fut, dev)
        finally:
            if self._settings.prepack:
                # the IPU process keeps its own (prepacked) copy and let go of the shared
                # one: the region lives only while a session of these weights loads
                self._weights = None

    def _constants_to_load(self, keep_load_constants: bool) -> tuple[ConstantInputs, bool]:
        """The constant inputs the next LOAD names (handle -> (callback, value)), their
        region held in ``self._constants``; and whether they are those of the last LOAD.
        ``keep_load_constants``: see :meth:`_load`."""
        constants = self._streams.constants()
        if keep_load_constants:
            only = self._streams.load_only
            constants = {**{h: cv for h, cv in constants.items() if h not in only},
                         **{h: cv for h, cv in self._constants_loaded.items() if h in only}}
        same = _identical(constants, self._constants_loaded)
        if not constants:
            self._constants, self._constants_of = None, {}
        elif self._constants is None or not _identical(constants, self._constants_of):
            self._constants = shared_constants({h: v for h, (_, v) in constants.items()})
            self._constants_of = constants
        return constants, same

    def sync_constants(self, dev: Device, binding: Binding, progs: Sequence[int]) -> None:
        """Before ``progs`` run: if the constant inputs are not those the device was loaded
        with (a callback set on one, or a new value) and ``progs`` read them, load again so
        that they read them as they are now. An input only Load programs read changes at
        the next Load run: until then the device keeps what the last Load wrote, as a real
        one does."""
        now = {h: cb for h, (cb, _) in self._streams.constants().items()}
        was = {h: cb for h, (cb, _) in self._constants_loaded.items()}
        changed = {h for h in now.keys() | was.keys() if now.get(h) is not was.get(h)}
        loads = bool(set(progs) & set(self._flow.load()))
        if changed and (loads or not changed <= self._streams.load_only):
            # the binding keeps its phase: the load programs need not run again for this
            self.load(dev, binding, fresh=True, keep_load_constants=not loads)

    def _weights_file(self, dev: Device | None = None) -> WeightsFile | None:
        """With prepacking on, where an IPU process reads the weights itself: the PopEF
        file they were read from, while it is unchanged (it takes its own copy at once;
        no shared region is needed). None: they go through the shared region, also where
        an IPU process of ``dev`` runs as another user (a daemon's), which cannot open
        this process's snapshot of the file (``/proc/<pid>/fd/``)."""
        if not (self._weights_len and self._settings.prepack
                and isinstance(self._exe, memoryview)):
            return None
        if dev is not None and not _same_user(dev.pids()):
            return None
        view = self._exe[self._weights_at:self._weights_at + self._weights_len]
        span = popef_file_span(view)
        if span is None:
            return None
        # the file as this process read (and checks) it: an IPU process that finds it so
        # need not checksum the weights again
        return WeightsFile(span[0], span[1], self._weights_len,
                           tuple(popef_file_identity(view) or ()))

    def share_weights(self, dev: Device | None = None) -> None:
        """Hold the region of the executable's weights (made if this process has none)."""
        if self._weights is None and self._weights_len and self._weights_file(dev) is None:
            check_fits(self._header.name, self._weights_len, self.memory_per_replica(), 1,
                       bool(self._settings.prepack),
                       held=is_shared(self._exe, self._weights_at, self._weights_len))
            self._weights = shared_weights(self._exe, self._weights_at, self._weights_len)

    def memory_per_replica(self) -> int:
        """Bytes of /dev/shm a session of this model takes besides
        its weights and rings (its executable and device memory regions)."""
        return self._weights_at + max(64, self._header.memory_bytes)

    def weights_bytes(self) -> int:
        """Bytes of the executable's weights section (0: none)."""
        return self._weights_len

    def _load_sharded(self, dev: Device, binding: Binding, modes: list[int],
                      fresh: bool) -> bool:
        """A multi-IPU executable: each IPU of the device gets its part (host_runtime.devices._ipu_group)."""
        if self._sharded is None:
            self._sharded = ShardedLoad.of(self._exe, self._key)
            if self._sharded is None:
                return False
        rings = self._streams.rings
        self._sharded.load(dev.link, self._streams.load_spec(modes),
                           self._config.check_package_hash, fresh, self._settings.load_timeout,
                           lambda h, pid: rings[h].set_peer(pid),
                           [self._fault_table.name] if self._fault_table is not None else None,
                           self._constants.spec() if self._constants is not None else None)
        binding.modes_sent = modes
        return True

    def send_modes(self, dev: Device, binding: Binding) -> None:
        """Send the stream modes if they are not those ``dev`` was last sent."""
        modes = self._streams.modes()
        if modes != binding.modes_sent:
            dev.link.notify(Op.MODES, modes)
            binding.modes_sent = modes



    def wake_links(self) -> None:
        """After a STOP: invalidate a sharded model's IPU-Links (reset before each run)."""
        sharded = self._sharded
        if sharded is not None:
            for ring in sharded.links.values():
                if not ring.closed:
                    ring.invalidate()

    def close(self) -> None:
        """Release what the session holds: its regions, its hold on the shared weights and
        constants (the last session of them frees their region), a sharded load's parts."""
        for region in (self._spec_region, self._memory_region):
            if region is not None:
                region.close()
                region.unlink()
        self._spec_region = self._memory_region = None
        self._loading = None   # (a LOAD nobody waited for: the device goes too)
        self._weights = None   # the last session of these weights frees their region
        self._constants, self._constants_of = None, {}   # and of these constants
        if self._sharded is not None:
            self._sharded.close()
            self._sharded = None


def _identical(a: ConstantInputs, b: ConstantInputs) -> bool:
    """The same inputs, each fed by the same callback and value objects."""
    return a.keys() == b.keys() and all(cv is b[h] for h, cv in a.items())


def _weights_span(exe: bytes | memoryview, header: ExecutableHeader) -> tuple[int, int]:
    """(offset, length) of the executable's weights section ((len, 0): none)."""
    if header.num_ipus > 1:
        return len(exe), 0   # a multi-IPU executable's parts carry their own weights
    try:
        return weights_span(exe)
    except ExecutableError as exc:
        raise PopefError(f"executable {header.name!r}: {exc}") from exc


def _same_user(pids: list[int]) -> bool:
    """Whether every process of ``pids`` runs as this process's user (None known: yes)."""
    uid = os.getuid()
    for pid in pids:
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                return False
        except OSError:
            continue
    return True
