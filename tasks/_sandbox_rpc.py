"""The wire between the sandbox's judge and its workers (tasks/_sandbox_harness.py). Loaded by path
by the harness before it isolates itself; never imported by the app.

Why: a verdict must be decided where the candidate cannot reach. A worker runs candidate code and
holds nothing a verdict is made of: no result fd, no MAC key, no test source, no reporter. The
judge holds those and runs the tests itself, with every name the candidate's code defined bound
to a `Remote` handle: calling it ships the call to the worker and brings the result back as
plain data. So `assert candidate(x) == y` compares, in the judge, a value the worker sent with a
value the test computed; the worker can send any value, as an honest function could return
any value, but never make the judge run its code (no __eq__, __bool__, __hash__ of its own).

Two pipes per worker, frames of a 4-byte big-endian length and a payload:
- judge -> worker: pickled requests (handles as persistent ids, the probe's poison, a test's own
  function as a callback stub);
- worker -> judge: JSON text of a tagged tree, decoded by the judge strictly (`Conn.decode`) into
  exact builtin values, or ["R", id, type name] handles to objects kept in the worker; a reply
  that is not exactly that ends the worker (`WorkerGone`).
Requests: "init" (a fresh namespace: setup, then code), "call" and "op" on a handle; while
serving one the worker may call back ("cb": a test's function, or the probe's stub for `aux`).
Replies: "ready", "ok", "ret" (with in-place changes to list/dict/set/bytearray arguments),
"exc", "mem". Each tag and field: docs/SANDBOX.md "The harness's processes, result lines and
wire".
"""
import _pickle
import builtins
import io
import json
import os
import struct
import sys
import types

# Captured at load, before any candidate code: a worker keeps answering after the code patches
# builtins, json or pickle (a judge never needs this: no candidate code runs there). The worker
# side below uses only these names, methods of exact builtin types and C code (the JSON encoder
# is _json's: json.dumps itself would look up `isinstance` in builtins at run time).
_type, _len, _isinstance, _id, _getattr, _repr, _str = type, len, isinstance, id, getattr, repr, str
_int, _float, _complex, _bool, _bytes, _bytearray = int, float, complex, bool, bytes, bytearray
_list, _tuple, _set, _frozenset, _dict, _hex, _iter, _next = list, tuple, set, frozenset, dict, hex, iter, next
_callable, _exec, _compile, _Base, _MemErr = callable, exec, compile, BaseException, MemoryError
_issubclass, _enumerate, _zip, _min, _memoryview = issubclass, enumerate, zip, min, memoryview
_OSError = OSError
_ValueError, _RuntimeError, _EOFError = ValueError, RuntimeError, EOFError
_loads_json = json.loads
_Pickler, _Unpickler, _pickle_dumps = _pickle.Pickler, _pickle.Unpickler, _pickle.dumps
_BytesIO, _pack, _unpack = io.BytesIO, struct.pack, struct.unpack
_read, _write, _exit, _getpid, _devnull = os.read, os.write, os._exit, os.getpid, os.devnull
_open, _getframe, _sys = open, sys._getframe, sys
_int_str, _float_float, _complex_cx, _str_str = int.__int__, float.__float__, complex.__complex__, str.__str__

MAX_MSG = 16 << 20  # bytes in one frame, either way
MAX_DEPTH = 100  # nesting the worker sends as values; deeper parts go as handles
MAX_ITEMS = 2_000_000  # items in one value
MAX_INT_HEX = 1 << 20  # hex digits of one big int
ALLOWED_DUNDERS = frozenset({"__name__", "__qualname__", "__doc__", "__module__"})
BUILTIN_EXC = {n: c for n, c in vars(builtins).items() if _isinstance(c, _type) and _issubclass(c, _Base)}


def _recv_exact(fd, n):
    parts, got = [], 0
    while got < n:
        b = _read(fd, _min(n - got, 1 << 20))
        if not b:
            raise _EOFError("the other side closed the pipe")
        parts.append(b)
        got += _len(b)
    return b"".join(parts)


def recv_frame(fd):
    (n,) = _unpack(">I", _recv_exact(fd, 4))
    if n > MAX_MSG:
        raise _ValueError(f"a frame of {n} bytes (at most {MAX_MSG})")
    return _recv_exact(fd, n)


def send_frame(fd, payload):
    data = _memoryview(_pack(">I", _len(payload)) + payload)
    while data:
        data = data[_write(fd, data):]


# ------------------------------------------------------------------------------ worker side

def _not_a_value(o):
    raise TypeError(f"not a tree value: {o!r:.50}")


# json.dumps(tree, ensure_ascii=True) done by _json's C encoder alone (trees hold only exact
# list, str, int, float, bool and None)
_c_encode = json.encoder.c_make_encoder(None, _not_a_value, json.encoder.encode_basestring_ascii, None,
                                        ":", ",", False, False, True)


def _dumps(tree):
    return "".join(_c_encode(tree, 0))


class _TooBig(Exception):
    pass


class Poisoned(BaseException):  # not an Exception: `except Exception` in the code cannot eat it
    pass


class Poison:
    """The cooperation probe's stand-in for a result it cannot perturb: any use raises."""
    __slots__ = ()


def _poisoned(*a, **k):
    raise Poisoned("aux's result was replaced by the cooperation probe")


for _n in ("__bool__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__",
           "__iter__", "__len__", "__getitem__", "__setitem__", "__contains__", "__getattr__",
           "__call__", "__index__", "__int__", "__float__", "__complex__", "__str__", "__repr__",
           "__format__", "__bytes__", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__",
           "__rmul__", "__truediv__", "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__",
           "__rmod__", "__pow__", "__rpow__", "__neg__", "__pos__", "__abs__", "__and__",
           "__rand__", "__or__", "__ror__", "__xor__", "__rxor__", "__lshift__", "__rshift__",
           "__invert__", "__round__", "__enter__", "__reversed__"):
    setattr(Poison, _n, _poisoned)


def site_label(f):
    """A call site: function name, line within that function (its def line = 1), offset, and
    (3.11+) the call's line.column in the program (two identical generator expressions in one
    function have the same name, relative line and offset, and must still be two sites)."""
    code = f.f_code
    label = f"{code.co_name}:{f.f_lineno - code.co_firstlineno + 1}:{f.f_lasti}"
    positions = _getattr(code, "co_positions", None)
    if positions is not None:
        pos = _list(positions())  # one entry per 2-byte code unit
        if f.f_lasti // 2 < _len(pos):
            label += f":{pos[f.f_lasti // 2][0]}.{pos[f.f_lasti // 2][2]}"
    return label


class _WorkerUnpickler(_Unpickler):
    worker = None

    def persistent_load(self, pid):
        if pid[0] == "R":
            return self.worker.obj(pid[1])
        if pid[0] == "P":
            return self.worker.poison
        if pid[0] == "J":
            return self.worker.callback_stub(pid[1])
        raise _pickle.UnpicklingError("unknown persistent id")


class Worker:
    """Serves one judge over (rfd, wfd) until the judge closes its end. Runs in the candidate's
    process: nothing here is trusted by the judge."""

    def __init__(self, rfd, wfd, seeded=False):
        self.rfd, self.wfd = rfd, wfd
        self.seed = None
        if seeded:  # the probe seeds each trial; imported now (an import after the code patched
            import random  # builtins.max fails) and only then (a plain check needs none of it)
            self.seed = random.seed
        self.compiled = {}  # (source, name) -> code: the probe runs the same code again and again
        self.objs = []  # handle id -> object (kept alive, so an id() is never reused)
        self.ids = {}  # id(object) -> handle id
        self.ns = None
        self.poison = Poison()
        self.handles_made = 0
        self.unpickler = _WorkerUnpickler

    # -- values out
    def handle(self, v):
        self.handles_made += 1
        h = self.ids.get(_id(v))
        if h is None:
            h = _len(self.objs)
            self.objs.append(v)
            self.ids[_id(v)] = h
        return ["R", h, _type(v).__name__[:100]]

    def enc(self, v):
        """v as a tagged tree; a value too deep or too big to send goes whole as a handle."""
        try:
            return self._enc(v, 0, [MAX_ITEMS])
        except _TooBig:
            return self.handle(v)

    def _enc(self, v, depth, left):
        t = _type(v)
        if v is None or t is _bool or t is _str:
            return v
        if t is _int:
            return v if -(1 << 62) < v < (1 << 62) else ["I", _hex(v)]
        if t is _float:
            return v
        if depth > MAX_DEPTH:
            raise _TooBig()
        left[0] -= 1
        if left[0] < 0:
            raise _TooBig()
        if t is _list or t is _tuple or t is _set or t is _frozenset:
            tag = "L" if t is _list else "T" if t is _tuple else "S" if t is _set else "F"
            return [tag] + [self._enc(x, depth + 1, left) for x in v]
        if t is _dict:
            out = ["D"]
            for k, x in v.items():
                out.append(self._enc(k, depth + 1, left))
                out.append(self._enc(x, depth + 1, left))
            return out
        if t is _bytes:
            return ["B", v.hex()]
        if t is _bytearray:
            return ["A", v.hex()]
        if t is _complex:
            return ["C", v.real, v.imag]
        # subclasses of the builtins go as their base value (a namedtuple as a tuple, a Counter
        # as a dict, an IntEnum as an int); numpy scalars as the Python number
        try:
            if _isinstance(v, _bool):
                return _bool(v)
            if _isinstance(v, _int):
                return self._enc(_int_str(v), depth, left)
            if _isinstance(v, _float):
                return _float_float(v)
            if _isinstance(v, _str):
                return _str_str(v)
            for base in (_list, _tuple, _set, _frozenset, _dict, _bytes, _bytearray, _complex):
                if _isinstance(v, base):
                    return self._enc(base(v), depth, left)
            if _getattr(t, "__module__", None) == "numpy" and _callable(_getattr(v, "item", None)) \
                    and _getattr(v, "shape", None) == ():
                return self._enc(v.item(), depth, left)
        except _TooBig:
            raise
        except _Base:
            pass
        return self.handle(v)

    def exc_reply(self, e):
        if _isinstance(e, _MemErr):
            return ["mem"]
        t = _type(e)
        bases = [c.__name__ for c in t.__mro__ if BUILTIN_EXC.get(c.__name__) is c]
        try:
            made = self.handles_made
            a = e.args
            if _isinstance(e, _OSError) and e.filename is not None:  # (not in args, but in its text)
                a = (e.errno, e.strerror, e.filename, None, e.filename2)
            args = self.enc(_tuple(a))
            if self.handles_made != made:  # not plain data: the text says it
                args = None
        except _Base:
            args = None
        try:
            text = _str(e)
        except _Base:
            text = "<exception that cannot be printed>"
        return ["exc", bases, t.__name__[:100], args, text[:2000]]

    def obj(self, h):
        """A handle's object: by number, or by name in the current namespace (the probe's handles
        outlive the namespace they were made in)."""
        return self.objs[h] if _type(h) is _int else self.ns[h]

    # -- values in
    def unpickle(self, data):
        u = self.unpickler(_BytesIO(data))
        u.worker = self
        return u.load()

    def send(self, tree):
        send_frame(self.wfd, _dumps(tree).encode())

    def recv(self):
        return self.unpickle(recv_frame(self.rfd))

    # -- calls back into the judge
    def callback(self, msg):
        self.send(msg)
        while True:
            m = self.recv()
            if m[0] == "cbret":
                return m[1]
            if m[0] == "cbexc":
                cls = BUILTIN_EXC.get(m[1], _RuntimeError)
                raise cls(m[2])
            self.send(self.dispatch(m))

    def enc_args(self, a, k):
        return [self.enc(_list(a)), self.enc(_dict(k))]

    def callback_stub(self, cid):
        def from_the_test(*a, **k):
            return self.callback(["cb", cid] + self.enc_args(a, k))
        return from_the_test

    def aux_stub(self):
        def aux(*a, **k):  # the helper, called from the code: the judge forwards it (and watches)
            return self.callback(["cb", "aux", site_label(_getframe(1))] + self.enc_args(a, k))
        return aux

    # -- requests
    def dispatch(self, m):
        try:
            op = m[0]
            if op == "init":
                return self.init(*m[1:])
            if op == "call":
                _, h, a, k = m
                return self.call(self.obj(h), a, k)
            if op == "op":
                _, name, h, arg = m
                return ["ret", self.enc(self.op(name, self.obj(h), arg)), []]
            return ["exc", ["ValueError"], "ValueError", None, "unknown request"]
        except _Base as e:
            return self.exc_reply(e)

    def init(self, setup, code, opts):
        if opts.get("quiet"):
            _sys.stdout = _sys.stderr = _open(_devnull, "w")
        if opts.get("seed") is not None and self.seed is not None:
            self.seed(opts["seed"])
        # Not "__main__": the `if __name__ == "__main__":` demo blocks models like to add (input(),
        # prints) are not part of the answer and must not run.
        ns = {"__name__": "__candidate__", "__builtins__": builtins}
        self.ns = ns
        if setup:
            _exec(self.compile(setup + "\n", "<setup>"), ns)
        before = _dict(ns)
        _exec(self.compile(code, "<candidate>"), ns)
        if opts.get("stub"):
            ns[opts["stub"]] = self.aux_stub()
        names = []
        for k, v in _list(ns.items()):
            if _type(k) is _str and not (k.startswith("__") and k.endswith("__")) and before.get(k, ns) is not v:
                names.append([k, self.enc(v)])
        return ["ok", names]

    def compile(self, source, name):
        c = self.compiled.get((source, name))
        if c is None:
            c = self.compiled[(source, name)] = _compile(source, name, "exec", dont_inherit=True)
        return c

    def call(self, fn, a, k):
        mutable = [(i, x) for i, x in _enumerate(a) if _type(x) in (_list, _dict, _set, _bytearray)]
        mutable += [(n, x) for n, x in k.items() if _type(x) in (_list, _dict, _set, _bytearray)]
        before = [_dumps(self.enc(x)) for _, x in mutable]
        r = fn(*a, **k)
        out = self.enc(r)
        changed = []
        for (where, x), b in _zip(mutable, before):
            now = self.enc(x)
            if _dumps(now) != b:
                changed.append([where, now])
        return ["ret", out, changed]

    def op(self, name, obj, arg):
        if name == "getattr":
            return _getattr(obj, arg)
        if name == "getitem":
            return obj[arg]
        if name == "iter":
            return _iter(obj)
        if name == "next":
            return _next(obj)
        if name == "len":
            return _len(obj)
        if name == "bool":
            return _bool(obj)
        if name == "str":
            return _str(obj)
        if name == "repr":
            return _repr(obj)
        if name == "int":
            return _int(obj)
        if name == "float":
            return _float(obj)
        if name == "index":
            return obj.__index__()
        raise _ValueError("unknown operation")

    def serve(self):
        """Answer requests until the judge goes; then end this process (no atexit hooks)."""
        try:
            self.send(["ready", _getpid()])
            while True:
                try:
                    m = self.recv()
                except _EOFError:
                    break
                self.send(self.dispatch(m))
        except _Base:
            pass
        _exit(0)


def exec_main():
    """A worker started as a fresh interpreter (`python -I -S -c <this file> <sys.path as JSON>`),
    on fds 3 (requests) and 4 (replies): the judge's restarts, which must not inherit its memory."""
    _sys.path[:] = _loads_json(_sys.argv[1])
    try:
        import _sitebuiltins
        builtins.exit = _sitebuiltins.Quitter("exit", "Ctrl-D (i.e. EOF)")
        builtins.quit = _sitebuiltins.Quitter("quit", "Ctrl-D (i.e. EOF)")
    except ImportError:
        pass
    Worker(3, 4, seeded=True).serve()


# ------------------------------------------------------------------------------- judge side

class WorkerGone(BaseException):
    """The worker ended, broke the protocol or was interrupted mid-request: nothing it says
    counts any more (a BaseException, and the judge also checks `Conn.dead` after each test, so
    a test's own `except` cannot turn this into a pass)."""


class Stop(BaseException):
    """The cooperation probe's trial deadline passed (raised by its SIGALRM handler)."""


POISON = Poison()  # the judge's marker; it reaches a worker as that worker's own poison


def plain_copy(v):
    """A decoded value with its containers copied (handles and atoms shared)."""
    t = _type(v)
    if t is list:
        return [plain_copy(x) for x in v]
    if t is dict:
        return {k: plain_copy(x) for k, x in v.items()}
    if t is tuple:
        return tuple([plain_copy(x) for x in v])
    if t is set or t is bytearray:
        return t(v)
    return v


class Remote:
    """A handle to an object the candidate's code made, kept in its worker. Calls, attribute reads,
    indexing, iteration and conversions (len, bool, str, repr, int, float, index) are asked of
    the worker and come back as plain data or further handles, as from a function; comparisons,
    hashing and arithmetic are the judge's own: a handle equals only itself."""
    __slots__ = ("_conn", "_hid", "_tname", "__weakref__")

    def __init__(self, conn, hid, tname):
        self._conn, self._hid, self._tname = conn, hid, tname

    def __call__(self, *a, **k):
        return self._conn.call(self, a, k)

    def __getattr__(self, name):
        if name.startswith("__") and name not in ALLOWED_DUNDERS:
            raise AttributeError(name)
        return self._conn.op("getattr", self, name)

    def __getitem__(self, key):
        return self._conn.op("getitem", self, key)

    def __iter__(self):
        return self._conn.op("iter", self, None)

    def __next__(self):
        return self._conn.op("next", self, None)

    def _typed(self, name, types):
        r = self._conn.op(name, self, None)
        if _type(r) not in types:
            raise TypeError(f"{name}() of the code's {self._tname} object gave {_type(r).__name__}")
        return r

    def __len__(self):
        r = self._typed("len", (int,))
        if r < 0:
            raise ValueError("__len__() should return >= 0")
        return r

    def __bool__(self):
        return self._typed("bool", (bool,))

    def __str__(self):
        return self._typed("str", (str,))

    def __repr__(self):
        try:
            return self._typed("repr", (str,))
        except Exception:
            return f"<{self._tname} object in the sandbox>"

    def __int__(self):
        return self._typed("int", (int,))

    def __float__(self):
        return self._typed("float", (float,))

    def __index__(self):
        return self._typed("index", (int,))


class _JudgePickler(_Pickler):
    conn = None

    def persistent_id(self, obj):
        t = _type(obj)
        if t is Remote:
            if obj._conn is not self.conn:
                raise TypeError(f"a {obj._tname} object of another sandboxed process cannot be passed here")
            return ("R", obj._hid)
        if t is Poison:
            return ("P",)
        if t is types.FunctionType or t is types.MethodType:  # the test's own: called back in the judge
            self.conn.callbacks.append(obj)
            return ("J", _len(self.conn.callbacks) - 1)
        return None


class Conn:
    """The judge's end of one worker. `request` sends and waits, serving the worker's callbacks;
    any failure in between marks the connection dead (the worker is then killed, if known)."""

    def __init__(self, rfd, wfd, pid=None, name="worker"):
        self.rfd, self.wfd, self.pid, self.name = rfd, wfd, pid, name
        self.dead = None  # why, once nothing it says counts
        self.memory = False  # it reported a MemoryError
        self.remotes = {}
        self.callbacks = []  # the test's functions passed to the code, by id
        self.on_aux = None  # the cooperation probe's handler for the helper's calls
        self.pending_init = False  # an "init" was sent whose answer is not read yet
        self._exc_types = {}

    # -- lifecycle
    def ready(self):
        """Wait for the worker's first frame (sent before any candidate code runs)."""
        try:
            m = _loads_json(recv_frame(self.rfd))
            if _type(m) is not list or m[:1] != ["ready"] or _type(m[1]) is not int:
                raise ValueError(f"unexpected first frame {m!r:.100}")
            self.pid = m[1]
        except BaseException as e:
            self.kill(f"did not start: {e!r}")
            raise WorkerGone(self.dead)

    def kill(self, why):
        if self.dead is None:
            self.dead = why
        if self.pid:
            try:
                os.kill(self.pid, 9)
            except OSError:
                pass
            self.pid = None
        for fd in (self.rfd, self.wfd):
            try:
                os.close(fd)
            except OSError:
                pass
        self.rfd = self.wfd = -1

    # -- values to the worker
    def pickle(self, msg):
        buf = _BytesIO()
        p = _JudgePickler(buf, protocol=5)
        p.conn = self
        try:
            p.dump(msg)
        except (_pickle.PicklingError, TypeError, AttributeError, RecursionError, ValueError) as e:
            raise TypeError(f"cannot pass this value to the code under test: {e}") from None
        return buf.getvalue()

    # -- values from the worker
    def decode(self, t):
        """A tagged tree as exact builtin values and Remote handles; ValueError for anything else."""
        try:
            return self._decode(t)
        except ValueError:
            raise
        except (TypeError, RecursionError, OverflowError, IndexError) as e:
            raise ValueError(f"not a value ({type(e).__name__})") from None

    def _decode(self, t):
        tt = _type(t)
        if t is None or tt is bool or tt is int or tt is float or tt is str:
            return t
        if tt is not list or not t or _type(t[0]) is not str:
            raise ValueError("not a value")
        tag, rest = t[0], t[1:]
        if tag == "L":
            return [self._decode(x) for x in rest]
        if tag == "T":
            return tuple([self._decode(x) for x in rest])
        if tag == "S":
            return {self._decode(x) for x in rest}
        if tag == "F":
            return frozenset([self._decode(x) for x in rest])
        if tag == "D":
            if _len(rest) % 2:
                raise ValueError("odd dict")
            return {self._decode(rest[i]): self._decode(rest[i + 1]) for i in range(0, _len(rest), 2)}
        if _len(rest) == 1 and _type(rest[0]) is str:
            if tag == "B":
                return bytes.fromhex(rest[0])
            if tag == "A":
                return bytearray.fromhex(rest[0])
            if tag == "I" and _len(rest[0]) <= MAX_INT_HEX:
                return int(rest[0], 16)
        if tag == "C" and _len(rest) == 2 and all(_type(x) in (int, float) for x in rest):
            return complex(float(rest[0]), float(rest[1]))
        if tag == "R" and _len(rest) == 2 and _type(rest[0]) is int and _type(rest[1]) is str:
            r = self.remotes.get(rest[0])
            if r is None:
                r = self.remotes[rest[0]] = Remote(self, rest[0], rest[1][:100])
            return r
        raise ValueError(f"not a value: tag {tag!r}")

    def error(self, bases, name, args, text):
        """The exception the worker raised, as the judge's own: its nearest builtin class (a
        subclass of it named like the code's class), never anything the code defined."""
        base = next((BUILTIN_EXC[b] for b in bases if _type(b) is str and b in BUILTIN_EXC), Exception)
        if base is MemoryError:  # said, not raised: still the end of this worker
            self.memory = True
            self.kill("memory")
            return WorkerGone("memory")
        cls = base
        if _type(name) is str and name != base.__name__ and name.isidentifier():
            cls = self._exc_types.get((name, base))
            if cls is None:
                if _len(self._exc_types) > 256:
                    self._exc_types.clear()
                cls = self._exc_types[(name, base)] = _type(name, (base,), {"__module__": "sandboxed"})
        text = text if _type(text) is str else ""
        try:
            decoded = self.decode(args) if args is not None else None
        except ValueError:
            decoded = None
        for make in ((lambda: cls(*decoded)) if _type(decoded) is tuple else (lambda: cls(text)),
                     lambda: cls(text), lambda: RuntimeError(f"{name}: {text}")):
            try:
                return make()
            except Exception:
                continue

    # -- requests
    def recv(self):
        try:
            m = _loads_json(recv_frame(self.rfd))
        except EOFError:
            raise WorkerGone("ended") from None
        if _type(m) is not list or not m or _type(m[0]) is not str:
            raise ValueError("not a message")
        return m

    def request(self, msg):
        self.start(msg)
        return self.reply()

    def start(self, msg):
        """Send a request without waiting (`reply` reads its answer)."""
        if self.dead is not None:
            raise WorkerGone(self.dead)
        data = self.pickle(msg)  # before anything is sent: an unpicklable argument leaves us whole
        try:
            send_frame(self.wfd, data)
        except BaseException as e:
            self.kill(f"{type(e).__name__}: {e}"[:200])
            if _isinstance(e, (Stop, KeyboardInterrupt, MemoryError)):
                raise
            raise WorkerGone(self.dead) from None

    def settle(self):
        """Read the answer of an "init" sent with init_later: the code loaded, or this worker is
        done (a request after it must not read that answer as its own)."""
        if self.pending_init:
            self.pending_init = False
            m = self.reply()
            if m[0] != "ok":
                self.kill("the code did not load")
                raise WorkerGone(self.dead)

    def reply(self):
        """The answer to the request sent last, serving the worker's callbacks meanwhile."""
        if self.dead is not None:
            raise WorkerGone(self.dead)
        if self.pending_init:
            self.settle()
        try:
            while True:
                m = self.recv()
                if m[0] == "cb" and _len(m) >= 4:
                    self.serve_callback(m)
                    continue
                return m
        except WorkerGone as e:
            self.kill(e.args[0] if e.args else "ended")
            raise
        except BaseException as e:  # broken frame, bad JSON, the probe's Stop mid-request...
            self.kill(f"{type(e).__name__}: {e}"[:200])
            if _isinstance(e, (Stop, KeyboardInterrupt, MemoryError)):  # the judge's own
                raise
            raise WorkerGone(self.dead) from None

    def serve_callback(self, m):
        try:
            if m[1] == "aux" and _len(m) == 5 and _type(m[2]) is str:
                label, a, k = m[2][:300], self.decode(m[3]), self.decode(m[4])
                raw = json.dumps([m[3], m[4]])  # the arguments exactly as sent: the probe's cache key
                fn = self.on_aux
                if fn is None:
                    raise NameError("aux is not served here")
            elif _type(m[1]) is int and 0 <= m[1] < _len(self.callbacks) and _len(m) == 4:
                label, a, k, fn = None, self.decode(m[2]), self.decode(m[3]), self.callbacks[m[1]]
            else:
                raise ValueError("not a callback")
        except ValueError:
            raise
        except Exception as e:
            send_frame(self.wfd, _pickle_dumps(("cbexc", "NameError", str(e))))
            return
        if _type(a) is not list or _type(k) is not dict or not all(_type(x) is str for x in k):
            raise ValueError("bad callback arguments")
        try:
            r = fn(*a, **k) if label is None else fn(label, a, k, raw)
            out = self.pickle(("cbret", r))
        except (WorkerGone, Stop, KeyboardInterrupt, MemoryError):
            raise
        except BaseException as e:
            name = next((c.__name__ for c in _type(e).__mro__ if BUILTIN_EXC.get(c.__name__) is c), "Exception")
            try:
                text = str(e)
            except Exception:
                text = ""
            out = _pickle_dumps(("cbexc", name, text[:2000]))
        send_frame(self.wfd, out)

    def result(self, m, a=(), k=None):
        """The value of a "ret" reply (its in-place changes applied to a and k), or the raise."""
        if m[0] == "ret" and _len(m) == 3 and _type(m[2]) is list:
            value = self.decode(m[1])
            for change in m[2]:
                if _type(change) is not list or _len(change) != 2:
                    raise ValueError("bad change")
                where, new = change
                target = (a[where] if _type(where) is int and 0 <= where < _len(a) else
                          k.get(where) if k is not None and _type(where) is str else None)
                new = self.decode(new)
                if target is None or _type(target) is not _type(new):
                    continue
                if _type(target) is dict or _type(target) is set:
                    target.clear()
                    target.update(new)
                elif _type(target) is list or _type(target) is bytearray:
                    target[:] = new
            return value
        if m[0] == "exc" and _len(m) == 5 and _type(m[1]) is list:
            raise self.error(*m[1:])
        if m[0] == "mem":
            self.memory = True
            self.kill("memory")
            raise WorkerGone("memory")
        raise ValueError("not a reply")

    def checked(self, msg, a=(), k=None):
        m = self.request(msg)
        try:
            return self.result(m, a, k)
        except ValueError as e:  # (a raised ValueError of the code comes as "exc", never here)
            if m[0] == "exc":
                raise
            self.kill(f"bad reply: {e}")
            raise WorkerGone(self.dead) from None

    def call(self, remote, a, k):
        if remote._conn is not self:
            raise TypeError("a handle of another sandboxed process")
        return self.checked(("call", remote._hid, a, k), a, k)

    def op(self, name, remote, arg):
        return self.checked(("op", name, remote._hid, arg))

    def init(self, setup, code, **opts):
        """A fresh namespace in the worker: {name: value or Remote} of what the code defined or
        changed after setup; raises what setup or code raised."""
        self.init_start(setup, code, **opts)
        return self.init_finish()

    def init_start(self, setup, code, **opts):
        self.start(("init", setup, code, opts))

    def init_later(self, setup, code, **opts):
        """A fresh namespace without waiting: the next request reads the answer first (`settle`)."""
        self.settle()
        self.start(("init", setup, code, opts))
        self.pending_init = True

    def init_finish(self):
        m = self.reply()
        if m[0] == "ok" and _len(m) == 2 and _type(m[1]) is list:
            out = {}
            try:
                for item in m[1]:
                    if _type(item) is not list or _len(item) != 2 or _type(item[0]) is not str:
                        raise ValueError("bad name")
                    out[item[0]] = self.decode(item[1])
            except ValueError as e:
                self.kill(f"bad reply: {e}")
                raise WorkerGone(self.dead) from None
            return out
        try:
            return self.result(m)
        except ValueError as e:
            if m[0] == "exc":
                raise
            self.kill(f"bad reply: {e}")
            raise WorkerGone(self.dead) from None

