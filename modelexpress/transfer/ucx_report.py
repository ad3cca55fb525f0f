"""UCX's protocol report: make UCX write it where we can read it, and read it back.

A transfer result names the transport UCX used, never one inferred from memory
kinds (DESIGN.md, "Transports"). UCX states which transport serves a "remote memory
read" only in its protocol report (``UCX_PROTO_INFO``), which goes to its log
stream: stdout unless ``UCX_LOG_FILE`` names a file. Both settings are read when UCX
starts: ``UCX_LOG_FILE`` once per process, when ``libucs`` loads (NIXL loads it with
the first UCX backend), ``UCX_PROTO_INFO`` once per UCP context (every NIXL agent).

:func:`configure` decides once per process, before the first UCX backend:

- the user set neither: UCX logs to ``<tmp>/mx-ucx-<uid>/ucx.<host>.<pid>.log`` and
  reports read protocols only (``UCX_PROTO_INFO=*remote memory read*``); its own
  messages are relayed to this module's logger; the file goes at exit;
- the user set ``UCX_LOG_FILE`` to a file: that file is read (``UCX_PROTO_INFO`` for
  reads is added when unset);
- ``UCX_PROTO_INFO=n``, ``UCX_PROTO_INFO`` without ``UCX_LOG_FILE``,
  ``UCX_LOG_FILE=stdout``, or UCX loaded before us without a log file: nothing is
  changed and results say ``unknown``, with the reason.

Our variables are set only around each UCX backend start (:func:`ucx_env`), then
removed again, so child processes and other UCX users never inherit them.

A table as UCX (bundled with nixl 1.5.1) writes it, every line behind the same
prefix (time, host, pid, thread; here ``[1796110150.578108] [vm:19933:0]`` and three
spaces)::

    +--------+-------------+-------------------------------------------+
    | mx-47436ea13a834ff78e70527b65f0 intra-node cfg#1                 |
    | remote memory read by ucp_get*(multi) into host memory from host |
    +--------+-------------+-------------------------------------------+
    | Range  | Description |                  Config                   |
    +--------+-------------+-------------------------------------------+
    | 0..inf | zero-copy   | cma/memory                                |
    +--------+-------------+-------------------------------------------+

With ``UCX_TLS=tcp`` on both sides the row reads
``| 0..inf | software emulation | tcp/lo |``.

The first title is the UCP context's name (NIXL passes the agent name; UCX keeps
31 characters), the endpoint kind and the endpoint configuration index; it never
names the peer. Which peer a table belongs to is decided in
:mod:`~modelexpress.transfer.observer`.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import ctypes
import dataclasses
import glob
import logging
import os
import pwd
import re
import socket
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence

from modelexpress.transfer.transport import UcxLogFacts

log = logging.getLogger(__name__)

__all__ = ["CONTEXT_NAME_MAX", "PROTO_INFO_READS", "ProtoRow", "ProtoTable", "ReportReader",
           "ReportSetup", "configure", "parse_tables", "parse_ucx_log", "read_ucx_log", "reader",
           "ucx_env", "ucx_proto_info_env"]

# The UCX_PROTO_INFO glob we set: UCX matches it (fnmatch, case-insensitive) against the
# operation line of each table, so only read tables are written, not the dozens of
# active-message and put tables a worker selects.
PROTO_INFO_READS = "*remote memory read*"
# UCP_ENTITY_NAME_MAX (32) less the terminating NUL: UCX cuts context names there.
CONTEXT_NAME_MAX = 31
# A single poll reads at most this much; the rest waits for the next poll.
_MAX_READ_BYTES = 16 << 20
_MAX_VMM_EVENTS = 256

_PREFIX = re.compile(r"^\[(?P<stamp>[\d.]+)\]\s+\[(?P<host>[^:\]]*):\s*(?P<pid>\d+)\s*:"
                     r"(?P<thread>[^\]]*)\]\s?")
_ENDPOINT = re.compile(r"^(?:(?P<context>.*?)\s+)?(?P<kind>self|intra-node|inter-node)\s+"
                       r"cfg#(?P<cfg>\d+)$")
_TL = re.compile(r"(?:^|[\s,(])([A-Za-z][A-Za-z0-9_]*)/")
_SIZE = re.compile(r"^(\d+)\s*([KMGTPE]?)B?$", re.IGNORECASE)
_UNITS = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40, "P": 50, "E": 60}
_LEVEL = re.compile(r"\bUCX\s+(FATAL|ERROR|WARN|DIAG|INFO|DEBUG|TRACE\w*)\b")
_VMM_KEY = re.compile(r"unsupported key handle type")
# UCX memory type names (ucs_memory_type_names) -> NIXL memory kinds.
_MEM_KINDS = {"host": "DRAM", "ze-host": "DRAM", "cuda": "VRAM", "cuda-managed": "VRAM",
              "rocm": "VRAM", "rocm-managed": "VRAM", "ze-device": "VRAM", "ze-shared": "VRAM"}
_FALSE = ("n", "no", "0", "off", "false")


# -- the table format ----------------------------------------------------------------------
def _size(text: str) -> int | None:
    m = _SIZE.match(text.strip())
    return int(m.group(1)) << _UNITS[m.group(2).upper()] if m else None


@dataclasses.dataclass(frozen=True)
class ProtoRow:
    """One row: the message sizes ``lo..hi`` (``hi`` None: no bound) and their protocol."""

    lo: int
    hi: int | None
    description: str
    config: str
    transports: tuple[str, ...]

    def covers(self, sizes: Sequence[int]) -> bool:
        """Whether any of ``sizes`` (sorted ascending) falls in this row's range."""
        i = bisect.bisect_left(sizes, self.lo)
        return i < len(sizes) and (self.hi is None or sizes[i] <= self.hi)


def _row(cells: list[str]) -> ProtoRow:
    lo_text, _, hi_text = cells[0].partition("..")
    lo = _size(lo_text)
    hi = lo if not hi_text else (None if hi_text.strip() == "inf" else _size(hi_text))
    if lo is None or (hi_text and hi is None and hi_text.strip() != "inf"):
        lo, hi = 0, None  # a range we cannot read counts for every size
    tls = tuple(dict.fromkeys(_TL.findall(cells[2])))
    return ProtoRow(lo, hi, cells[1], cells[2], tls)


def _mem_after(operation: str, word: str) -> str | None:
    idx = operation.find(word)
    if idx < 0:
        return None
    for token in operation[idx + len(word):].split():
        kind = _MEM_KINDS.get(token.split("/")[0].lower())
        if kind is not None:
            return kind
        if token in ("into", "from"):
            break
    return None


@dataclasses.dataclass(frozen=True)
class ProtoTable:
    """One protocol-selection table.

    Attributes:
        pid: the process that wrote it.
        context: the UCP context name (a NIXL agent's name, cut to 31 characters).
        endpoint: endpoint kind and configuration, e.g. ``intra-node cfg#1``.
        operation: e.g. ``remote memory read by ucp_get*(multi) into host memory from host``.
        rows: the protocol per message-size range.
    """

    pid: int
    context: str
    endpoint: str
    operation: str
    rows: tuple[ProtoRow, ...]

    @property
    def is_read(self) -> bool:
        return self.operation.startswith("remote memory read")

    @property
    def local_mem(self) -> str | None:
        """``DRAM``/``VRAM`` the data lands in (None when the line does not say)."""
        return _mem_after(self.operation, " into ")

    @property
    def remote_mem(self) -> str | None:
        """``DRAM``/``VRAM`` the data is read from (None when the line does not say)."""
        return _mem_after(self.operation, " from ")

    def transports(self, sizes: Sequence[int] | None = None) -> tuple[str, ...]:
        """UCX transports of the rows covering ``sizes`` (sorted); all rows when None."""
        rows = [r for r in self.rows if sizes is None or r.covers(sizes)] or list(self.rows)
        return tuple(dict.fromkeys(tl for r in rows for tl in r.transports))

    def describe(self) -> str:
        rows = "; ".join(f"{r.lo}..{'inf' if r.hi is None else r.hi} {r.description} "
                         f"{r.config}" for r in self.rows)
        return f"{self.context} {self.endpoint}: {self.operation}: {rows}".strip()


class _Block:
    __slots__ = ("titles", "rows")

    def __init__(self) -> None:
        self.titles: list[str] = []
        self.rows: list[ProtoRow] = []

    def table(self, pid: int) -> ProtoTable:
        context = endpoint = ""
        operation = ""
        for title in self.titles:
            m = _ENDPOINT.match(title)
            if m and not endpoint:
                context = m.group("context") or ""
                endpoint = f"{m.group('kind')} cfg#{m.group('cfg')}"
            elif not operation:
                operation = title
        return ProtoTable(pid, context, endpoint, operation, tuple(self.rows))


class _Assembler:
    """Builds tables from prefixed lines, one block per (pid, thread, timestamp).

    UCX writes a table in one call with one timestamp, so lines of concurrent
    tables from other threads never share a block. A table is complete at the
    separator after its rows (or when a new title follows rows).
    """

    def __init__(self) -> None:
        self._blocks: dict[tuple[int, str, str], _Block] = {}

    def feed(self, key: tuple[int, str, str], body: str) -> ProtoTable | None:
        body = body.strip()
        block = self._blocks.get(key)
        if body.startswith("+"):
            if block is not None and block.rows:
                del self._blocks[key]
                return block.table(key[0])
            return None
        cells = [c.strip() for c in body.strip("|").split("|")]
        done = None
        if len(cells) >= 3:
            if block is None or cells[0].lower() == "range":
                return None
            block.rows.append(_row(cells[:3]))
            return None
        if block is not None and block.rows:  # a new title after rows: the previous table ended
            done = block.table(key[0])
            block = None
        if block is None:
            if len(self._blocks) >= 64:  # never-finished blocks of an unknown format
                self._blocks.pop(next(iter(self._blocks)))
            block = self._blocks[key] = _Block()
        block.titles.extend(c for c in cells if c)
        return done

    def flush(self) -> list[ProtoTable]:
        """Tables still open (complete only when the text is known to be whole)."""
        out = [b.table(k[0]) for k, b in self._blocks.items() if b.rows]
        self._blocks.clear()
        return out


def parse_tables(text: str, pid: int | None = None) -> tuple[list[ProtoTable], list[str]]:
    """Parse whole UCX log text.

    Args:
        text: UCX log output (``UCX_PROTO_INFO`` tables and UCX messages).
        pid: keep only this process's lines; all when None.

    Returns:
        ``(tables, messages)``: every complete table, and the other prefixed lines.
    """
    asm = _Assembler()
    tables: list[ProtoTable] = []
    messages: list[str] = []
    for line in text.splitlines():
        m = _PREFIX.match(line)
        if not m or (pid is not None and int(m.group("pid")) != pid):
            continue
        body = line[m.end():]
        if body.lstrip().startswith(("+", "|")):
            key = (int(m.group("pid")), m.group("thread").strip(), m.group("stamp"))
            table = asm.feed(key, body)
            if table is not None:
                tables.append(table)
        else:
            messages.append(line.strip())
    tables.extend(asm.flush())
    return tables, messages


def parse_ucx_log(text: str) -> UcxLogFacts:
    """Read-transport choices and the VMM key error in a whole UCX log.

    Args:
        text: UCX output captured with ``UCX_PROTO_INFO`` (e.g. ``UCX_PROTO_INFO=y
            UCX_LOG_FILE=/path/ucx.%p.log``); other lines are ignored.

    Returns:
        The facts found, over every read table (empty when the log holds none).
    """
    tables, messages = parse_tables(text)
    reads = [t for t in tables if t.is_read]
    tls = tuple(dict.fromkeys(tl for t in reads for tl in t.transports()))
    vmm = [m for m in messages if _VMM_KEY.search(m)]
    evidence = tuple([t.describe() for t in reads] + vmm)[:6]
    return UcxLogFacts(tls, bool(vmm), evidence, "UCX protocol report" if tls else "")


def read_ucx_log(path: str) -> UcxLogFacts | None:
    """Flush UCX's buffered log stream and parse the file ``path``; None when unreadable."""
    _flush_c_streams()
    try:
        with open(path, errors="replace") as f:
            return parse_ucx_log(f.read())
    except OSError as exc:
        log.debug("UCX log %s unreadable: %s", path, exc)
        return None


def ucx_proto_info_env(log_file: str) -> dict[str, str]:
    """Environment that makes a child process's UCX write its full protocol report
    to ``log_file`` (``%p`` = the child's pid)."""
    return {"UCX_PROTO_INFO": "y", "UCX_LOG_FILE": log_file}


_libc: "ctypes.CDLL | None" = None


def _flush_c_streams() -> None:
    # UCX writes its log through a buffered C FILE*; a table written a moment ago can
    # still sit in that buffer. fflush(NULL) flushes every C output stream of this
    # process, which is harmless and the only handle we have on UCX's stream.
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None)
        _libc.fflush(None)
    except (OSError, AttributeError) as exc:  # no libc symbol table: read what is on disk
        log.debug("fflush(NULL) unavailable: %s", exc)


# -- reading one process's log as it grows ---------------------------------------------
class ReportReader:
    """Tails this process's UCX log: read tables and VMM key errors, numbered in order.

    Thread-safe. Events are ``(seq, table)`` in :attr:`tables` and ``(seq, line)`` in
    :attr:`vmm_lines`; ``seq`` grows by one per event across both.

    Args:
        pattern: the log file as a glob pattern (a literal path, escaped, unless
            the user's template has ``%t`` or ``%c``; then the newest match).
        relay: log UCX's own messages through our logger (we moved them off stdout).
    """

    def __init__(self, pattern: str, *, relay: bool) -> None:
        self.pattern = pattern
        self.relay = relay
        self.pid = os.getpid()
        self.error = ""
        self.tables: list[tuple[int, ProtoTable]] = []
        self.vmm_lines: list[tuple[int, str]] = []
        self._seq = 0
        # Re-entrant, and a poll inside a poll returns at once: a finalizer that runs
        # in the middle of a poll (a transfer manager collected while this thread
        # polls, whose close() polls once more) must neither deadlock on the lock this
        # thread holds nor read while the outer poll is half way through its lines.
        self._lock = threading.RLock()
        self._polling = False
        self._path = ""
        self._offset = 0
        self._partial = b""
        self._asm = _Assembler()

    @property
    def path(self) -> str:
        """The file read last (the pattern until it was found)."""
        return self._path or self.pattern

    def _current(self) -> str | None:
        matches = glob.glob(self.pattern)
        if not matches:
            return None
        return max(matches, key=lambda p: os.stat(p).st_mtime) if len(matches) > 1 else matches[0]

    def poll(self) -> int:
        """Read what UCX wrote since the last poll. Returns the last event number."""
        with self._lock:
            if self._polling:  # re-entered on this thread (see __init__)
                return self._seq
            self._polling = True
            try:
                return self._poll()
            finally:
                self._polling = False

    def _poll(self) -> int:
        _flush_c_streams()
        try:
            path = self._current()
            if path is None:
                self.error = f"UCX has not written its log file {self.pattern}"
                return self._seq
            if path != self._path:
                self._path, self._offset, self._partial = path, 0, b""
                self._asm = _Assembler()
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self._offset:  # truncated or rotated: start again
                    self._offset, self._partial, self._asm = 0, b"", _Assembler()
                f.seek(self._offset)
                data = f.read(_MAX_READ_BYTES)
        except OSError as exc:
            self.error = f"UCX log {self.pattern} unreadable: {exc}"
            return self._seq
        self.error = ""
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for raw in lines:
            self._line(raw.decode(errors="replace"))
        return self._seq

    def _line(self, line: str) -> None:
        m = _PREFIX.match(line)
        if not m or int(m.group("pid")) != self.pid:
            return
        body = line[m.end():]
        if body.lstrip().startswith(("+", "|")):
            table = self._asm.feed((self.pid, m.group("thread").strip(), m.group("stamp")), body)
            if table is not None and table.is_read:
                self._seq += 1
                self.tables.append((self._seq, table))
            return
        text = body.strip()
        if _VMM_KEY.search(text) and len(self.vmm_lines) < _MAX_VMM_EVENTS:
            self._seq += 1
            self.vmm_lines.append((self._seq, text))
        if self.relay:
            level = _LEVEL.search(text)
            name = level.group(1) if level else "INFO"
            lvl = {"FATAL": logging.ERROR, "ERROR": logging.ERROR, "WARN": logging.WARNING,
                   "DIAG": logging.INFO}.get(name, logging.DEBUG)
            log.log(lvl, "UCX: %s", text)


# -- the process-wide decision ------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ReportSetup:
    """Where this process's UCX protocol report goes.

    Attributes:
        pattern: the UCX log file as a glob pattern; None when it cannot be read.
        owned: modelexpress chose the file (it relays UCX's messages and removes it).
        reason: why there is no readable report (when ``pattern`` is None).
        env: variables to set around each UCX backend start (only ones the user left unset).
    """

    pattern: str | None
    owned: bool
    reason: str
    env: dict[str, str]


_lock = threading.Lock()
_env_lock = threading.Lock()
_setup: ReportSetup | None = None
_setup_pid = 0
_reader: ReportReader | None = None


def _ucx_loaded() -> bool:
    try:
        with open("/proc/self/maps") as f:
            return any("/libucs" in line for line in f)
    except OSError:
        return False


def _host() -> str:
    return socket.gethostname().split(".")[0]  # ucs_get_host_name cuts at the first dot


def _user() -> str:
    try:
        return os.path.basename(pwd.getpwuid(os.geteuid()).pw_name)
    except KeyError:
        return "*"


def _exe() -> str:
    try:
        return os.path.basename(os.readlink("/proc/self/exe"))
    except OSError:
        return "*"


def _pattern(template: str) -> str:
    """UCX's file-name template (ucs_fill_filename_template) as a glob pattern."""
    known = {"p": lambda: str(os.getpid()), "h": _host, "u": _user, "e": _exe,
             "i": lambda: str(os.geteuid()),
             "c": lambda: "*", "t": lambda: "*"}  # first CPU, opening time: not knowable
    out: list[str] = []
    i = 0
    while i < len(template):
        k = template[i + 1] if template[i] == "%" and i + 1 < len(template) else ""
        if k in known:
            value = known[k]()
            out.append(value if value == "*" else glob.escape(value))
            i += 2
        else:  # UCX copies any other character, '%' included
            out.append(glob.escape(template[i]))
            i += 1
    return "".join(out)


def _our_template() -> tuple[str | None, str]:
    """(template, "") for our per-process log file, or (None, why not)."""
    directory = os.path.join(tempfile.gettempdir(), f"mx-ucx-{os.geteuid()}")
    if ":" in directory or len(directory) > 180:  # UCX cuts the name at ':' and at 255 bytes
        return None, f"the temporary directory {directory!r} cannot hold a UCX log file name"
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        st = os.stat(directory)
    except OSError as exc:
        return None, f"cannot create {directory} for the UCX log: {exc}"
    if st.st_uid != os.geteuid():
        return None, f"{directory} belongs to another user; UCX's log is not redirected there"
    _remove_stale(directory)
    return os.path.join(directory, "ucx.%h.%p.log"), ""


def _remove_stale(directory: str) -> None:
    """Remove log files of this host's processes that no longer exist (killed ones)."""
    name = re.compile(r"^ucx\.(?P<host>.+)\.(?P<pid>\d+)\.log$")
    host = _host()
    try:
        entries = os.listdir(directory)
    except OSError:
        return
    for entry in entries:
        m = name.match(entry)
        if not m or m.group("host") != host or int(m.group("pid")) == os.getpid():
            continue
        try:
            os.kill(int(m.group("pid")), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, entry))
        except PermissionError:
            pass  # alive, another user's


def _decide(environ: Mapping[str, str], loaded: bool) -> ReportSetup:
    file = environ.get("UCX_LOG_FILE", "")
    info = environ.get("UCX_PROTO_INFO")
    if info is not None and info.strip().lower() in _FALSE:
        return ReportSetup(None, False, f"UCX_PROTO_INFO={info}: UCX does not report which "
                           "protocols it selects", {})
    if not file:
        if info is not None:
            return ReportSetup(None, False, f"UCX_PROTO_INFO={info} is set but UCX_LOG_FILE is "
                               "not, so UCX prints its protocol report to stdout where it cannot "
                               "be read; set UCX_LOG_FILE=/path/ucx.%p.log as well", {})
        if loaded:
            return ReportSetup(None, False, "UCX was already loaded in this process before its "
                               "first modelexpress NIXL agent, so its log cannot be moved to a "
                               "file; set UCX_LOG_FILE=/path/ucx.%p.log before UCX starts", {})
        template, why = _our_template()
        if template is None:
            return ReportSetup(None, False, why, {})
        return ReportSetup(_pattern(template), True, "",
                           {"UCX_LOG_FILE": template, "UCX_PROTO_INFO": PROTO_INFO_READS})
    head = file.split(":", 1)[0]
    for stream in ("stdout", "stderr"):
        if head and stream.startswith(head):  # UCX's own test: a prefix of the stream name
            return ReportSetup(None, False, f"UCX_LOG_FILE={file} sends UCX's protocol report to "
                               f"{stream}, where it cannot be read; name a file instead", {})
    # UCX opens the name relative to the directory it starts in: pin it now.
    name = os.path.abspath((file[5:] if file.startswith("file:") else file).split(":", 1)[0])
    ours = os.path.join(tempfile.gettempdir(), f"mx-ucx-{os.geteuid()}") + os.sep
    env = {} if info is not None else {"UCX_PROTO_INFO": PROTO_INFO_READS}
    return ReportSetup(_pattern(name), name.startswith(ours), "", env)


def configure() -> ReportSetup:
    """Decide, once per process, where UCX's protocol report goes (table above).

    Call before the process's first UCX backend starts (``NixlAgent`` does); later
    calls return the same decision.
    """
    global _setup, _setup_pid, _reader
    with _lock:
        if _setup is not None and _setup_pid == os.getpid():
            return _setup
        _setup = _decide(os.environ, _ucx_loaded())
        _setup_pid = os.getpid()
        _reader = None
        if _setup.pattern is not None:
            _reader = ReportReader(_setup.pattern, relay=_setup.owned)
            atexit.register(_at_exit, _reader, _setup.owned)
            log.debug("UCX protocol report: %s%s", _setup.pattern,
                      " (UCX's messages are relayed to this logger)" if _setup.owned else "")
        else:
            log.debug("UCX protocol report not readable: %s", _setup.reason)
        return _setup


def reader() -> ReportReader | None:
    """This process's report reader (after :func:`configure`); None when unreadable."""
    configure()
    return _reader


@contextlib.contextmanager
def ucx_env() -> Iterator[ReportSetup]:
    """Set our UCX variables (those the user left unset) while a UCX backend starts.

    UCX reads them during the start (the log file only at its first one in the
    process); afterwards they are removed, so children never inherit them.
    """
    setup = configure()
    with _env_lock:
        added = [k for k in setup.env if k not in os.environ]
        for k in added:
            os.environ[k] = setup.env[k]
        try:
            yield setup
        finally:
            for k in added:
                os.environ.pop(k, None)


def _at_exit(rdr: ReportReader, owned: bool) -> None:
    if rdr.pid != os.getpid():
        return
    rdr.poll()  # relay UCX's last messages
    if owned and rdr._path:
        with contextlib.suppress(OSError):
            os.unlink(rdr._path)
